"""The harness's runs of one prompt decoded together (``evaluation.decode_together``): each row
of the stacked cache holds what its run's cache holds, and ``run_prompt`` gives the same
records decoding together as decoding each run alone: the same tokens, the same bytes held
(rows that end early at the EOS included), in both prompt modes, on a GQA Llama and on a
Gemma 3 with sliding-window layers (whose question, in the agnostic mode, goes one token at a
time past the window), with KVzip's reconstruction passes and a lookahead policy
(which decodes alone) in the same prompt."""
from types import SimpleNamespace

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import kvcache_ext
from kvcache_ext.evaluation import compressed_cache, record_prefill, register_policy, unregister_policy
from kvcache_ext.evaluation.decode_together import kept_mask, stacked_cache, stacking_policy
from kvcache_ext.evaluation.retrieval import run_prompt
from kvcache_ext.policies import AcrossLayers, AdaKV, KVzip, Policy, SnapKV, TOVA

pytestmark = pytest.mark.usefixtures("one_thread")

N = 200   # prompt tokens (SnapKV's window of 32, widened by the lookahead, fits under a quarter)
POLICIES = ["full", "snapkv", "ada-snapkv", "tova", "together-kvzip", "ada-snapkv-lookahead"]


@pytest.fixture(scope="module", autouse=True)
def small_kvzip():
    """KVzip's global selection with chunks and templates a tiny vocabulary holds."""
    register_policy("together-kvzip", lambda budget: KVzip(chunk=16, prompt=(5, 6, 7), continue_prompt=(8, 9),
                                                           suffix=(10,), skip_prefix=None),
                    lambda: AdaKV(alpha=1.0, layers=AcrossLayers()))
    yield
    unregister_policy("together-kvzip")


def _prompt(seed, max_new_tokens=8):
    ids = torch.randint(0, VOCAB, (N,), generator=torch.Generator().manual_seed(seed))
    return SimpleNamespace(input_ids=ids, haystack_end=N - 6, length=N, depth=0.5, seed=seed, answer="?",
                           max_new_tokens=max_new_tokens, score=lambda text: 0.0)


def _tokenizer(eos=None):
    return SimpleNamespace(eos_token_id=eos, encode=lambda text, add_special_tokens=False: [],
                           decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))


def _model(arch):
    if arch == "gemma3_text":   # sliding layers of 64 tokens, shorter than the prompt
        return tiny_model("gemma3_text", heads=4, kv_heads=1, layers=2, sliding_window=64)
    return tiny_model("llama", heads=4, kv_heads=2, layers=2)


def _runs(model, mode, together, eos=None, seed=3):
    return run_prompt(model, _tokenizer(eos), _prompt(seed), "passkey", mode, POLICIES, [0.5, 0.25],
                      max_new_tokens=8, together=together)


def _same_records(alone, together):
    assert [(r.policy, r.budget) for r in together] == [(r.policy, r.budget) for r in alone]
    for a, t in zip(alone, together):
        key = (a.policy, a.budget)
        assert t.output == a.output, key
        assert t.kv_bytes == a.kv_bytes, key
        assert (t.budget_tokens, t.full_bytes) == (a.budget_tokens, a.full_bytes), key
        assert a.decoded_rows == 1
        alone_run = a.policy == "full" or "lookahead" in a.policy
        assert t.decoded_rows == (1 if alone_run else len(together) - 3), key   # full and the lookahead's two


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("mode", ["aware", "agnostic"])
def test_runs_decoded_together_give_the_records_of_runs_decoded_alone(arch, mode):
    model = _model(arch)
    with torch.no_grad():
        alone = _runs(model, mode, together=False)
        _same_records(alone, _runs(model, mode, together=True))
    # The budgets changed what was kept: the rows hold different bytes and the check can fail.
    assert len({r.kv_bytes for r in alone}) >= 3


def test_rows_that_end_at_the_eos_hold_what_their_runs_hold_alone():
    model = _model("llama")
    with torch.no_grad():
        first = _runs(model, "aware", together=False)
        # An EOS that some runs generate early and others later or never.
        outputs = {r.policy + str(r.budget): r.output.split() for r in first}
        eos = int(outputs["snapkv0.25"][2])
        alone = _runs(model, "aware", together=False, eos=eos)
        lengths = {len(r.output.split()) for r in alone if r.policy != "full"}
        assert len(lengths) > 1 and min(lengths) < 8, lengths   # rows end at different steps
        _same_records(alone, _runs(model, "aware", together=True, eos=eos))


def test_a_stacked_row_holds_its_runs_tokens():
    model = _model("llama")
    prompt = _prompt(5).input_ids[None]
    policies = [Policy(SnapKV(window=4), budget=10), Policy(TOVA(), budget=20, allocation=AdaKV()),
                Policy(SnapKV(window=4), budget=N)]
    with torch.no_grad():
        recorded = record_prefill(model, prompt)
        caches = []
        for policy in policies:
            with kvcache_ext.patch(model, policy) as handle:
                caches.append(compressed_cache(policy, recorded, handle.model_parts))
        with kvcache_ext.patch(model, stacking_policy(recorded)) as handle:
            stacked = stacked_cache(handle.policy, caches, recorded, handle.model_parts)
    for layer in range(2):
        rows = kept_mask(stacked, layer, N)
        assert rows.shape == (3, 2, N)
        for row, cache in enumerate(caches):
            assert torch.equal(rows[row], kept_mask(cache, layer, N)[0])
            view = cache.layer_kv(layer).view({}, True)
            mine = stacked.layer_kv(layer).view({}, True)
            held = int(view["mask"][0].sum(-1).max())
            assert torch.equal(mine["k"][row, :, :held][view["mask"][0, :, :held]],
                               view["k"][0, :, :held][view["mask"][0, :, :held]])
    assert kept_mask(caches[0], 0, N).sum() < kept_mask(caches[1], 0, N).sum() < kept_mask(caches[2], 0, N).sum()
    with pytest.raises(ValueError, match="no caches to stack"):
        stacked_cache(stacking_policy(recorded), [], recorded)


def test_decode_alone_is_an_eval_option():
    from kvcache_ext import cli
    parse = lambda *argv: cli.build_parser().parse_args(["eval", "--task", "ruler", *argv])   # noqa: E731
    assert parse("--decode-alone").decode_alone is True and parse().decode_alone is False
