"""The evaluation harness: shared prefill = the patched model's own prefill, named policies,
the report's arithmetic, and the needle and prose tasks. The end-to-end `kvcache-ext eval` smoke
tests on the default model are in tests/test_cli.py."""
import math

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import kvcache_ext
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.evaluation import (
    compressed_cache,
    make_policy,
    policy_names,
    record_prefill,
)
from kvcache_ext.evaluation.named_policies import parse_policies
from kvcache_ext.evaluation.report import format_table, plot, summarize
from kvcache_ext.policies import (
    CAOTE,
    H2O,
    KVEC,
    TOVA,
    AdaKV,
    AhaKV,
    Policy,
    Pyramid,
    Schedule,
    SnapKV,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(length, seed=1):
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


SHARED_POLICIES = [
    Policy(SnapKV(window=8), budget=12),
    Policy(SnapKV(window=8), budget=12, allocation=AdaKV()),
    Policy(SnapKV(window=8), budget=12, allocation=AdaKV(layers=Pyramid())),
    Policy(H2O(recent=4), budget=10, schedule=Schedule(decode_every=1)),
    Policy(CAOTE(TOVA()), budget=9),
    Policy(KVEC(window=8), budget=12),
    Policy(AhaKV(recent=4), budget=12, schedule=Schedule(decode_every=1)),
]


@pytest.mark.parametrize("policy", SHARED_POLICIES,
                         ids=lambda p: f"{type(p.scorer).__name__}-{type(p.allocation).__name__}")
@pytest.mark.parametrize("layout", [(4, 2), (4, 1), (6, 3)], ids=["gqa", "mqa", "gqa3"])
def test_shared_prefill_equals_the_patched_prefill(policy, layout):
    heads, kv_heads = layout
    model = tiny_model("llama", heads=heads, kv_heads=kv_heads, layers=3)
    prompt, fed = _ids(40), _ids(6, seed=2)
    with torch.no_grad():
        recorded = record_prefill(model, prompt)
        assert not kvcache_ext.is_patched(model)
        # Only the last position's logits are kept: all that a run reads of them.
        assert recorded.logits.shape == (1, 1, model.config.vocab_size)
        with kvcache_ext.patch(model, policy) as handle:
            direct = handle.new_cache()
            direct_logits = [model(prompt, **with_cache(model, direct), use_cache=True).logits[:, -1]]
            shared = compressed_cache(policy, recorded)
            # The same bytes as the patched model holds (one prefill path: the slack released alike).
            assert shared.nbytes == direct.nbytes
            shared_logits = [recorded.logits[:, -1]]
            for t in range(fed.shape[1]):   # decode steps over each cache (with eviction, for some)
                tok = fed[:, t:t + 1]
                direct_logits.append(model(tok, **with_cache(model, direct), use_cache=True).logits[:, -1])
                shared_logits.append(model(tok, **with_cache(model, shared), use_cache=True).logits[:, -1])
    assert shared.get_seq_length() == direct.get_seq_length() == 46
    assert shared.nbytes == direct.nbytes
    for a, b in zip(direct.kept_tokens(), shared.kept_tokens()):
        assert torch.equal(a, b)
    for layer in range(3):
        d, s = direct.layer_kv(layer).view({}, True), shared.layer_kv(layer).view({}, True)
        assert torch.equal(d["pos"], s["pos"]) and torch.equal(d["mask"], s["mask"])
    torch.testing.assert_close(torch.stack(shared_logits), torch.stack(direct_logits), rtol=1e-5, atol=1e-5)
    # Eviction happened: the check is not the trivial keep-everything case.
    assert max(int(t.max()) for t in shared.kept_tokens()) < 40


def test_record_prefill_refuses_a_patched_model_and_block_schedules_cannot_share():
    model = tiny_model()
    recorded = record_prefill(model, _ids(20))
    with kvcache_ext.patch(model, Policy(SnapKV(window=4), budget=8)):
        with pytest.raises(ValueError, match="unpatch"):
            record_prefill(model, _ids(20))
    with pytest.raises(ValueError, match="block-wise"):
        compressed_cache(Policy(SnapKV(window=4), budget=8, schedule=Schedule(prefill_block=8)), recorded)


def test_every_named_policy_builds_and_unknown_names_are_refused():
    assert make_policy("full", 64) is None
    for name in policy_names()[1:]:
        assert make_policy(name, 64).budget == 64
        if make_policy(name, 64).schedule.lookahead:   # a deferred one-shot compression, and says so
            with pytest.raises(ValueError, match="lookahead"):
                make_policy(name, 64, Schedule(prefill_block=16, decode_every=1))
        elif not name.startswith(("kvec", "kvzip", "ada-kvzip")):   # K-VEC and KVzip are one-shot only, and say so
            assert make_policy(name, 64, Schedule(prefill_block=16, decode_every=1)).schedule.prefill_block == 16
    for name in ("kvec", "kvzip", "ada-kvzip", "kvzip-global"):
        with pytest.raises(ValueError, match="one-shot"):
            make_policy(name, 64, Schedule(prefill_block=16))
    assert isinstance(make_policy("ada-snapkv", 64).allocation, AdaKV)
    assert make_policy("h2o", 64).scorer.recent == 32          # the H2O paper's half-recent split
    # CAOTE under the baselines' protocol, and Eq. 7 literally under its own name.
    assert not make_policy("caote-h2o", 64).scorer.capabilities.output_after_eviction
    assert make_policy("caote-h2o-eq7", 64).scorer.capabilities.output_after_eviction
    assert make_policy("caote-tova-shared", 64).scorer.gqa == "shared"
    assert make_policy("caote-tova", 64).scorer.gqa == "shared"            # the base's own reading
    assert make_policy("caote-h2o-l2", 64).scorer.gqa == "group_l2"
    assert make_policy("ahakv-nopool", 64).scorer.score_pool is None
    assert make_policy("kvec-nopool", 64).scorer.kernel == 1 and make_policy("snapkv-nopool", 64).scorer.kernel == 1
    assert make_policy("roco-pool", 64).scorer.pooling.kernel == 7
    assert parse_policies("all") == list(policy_names())
    assert parse_policies(" SnapKV , full") == ["snapkv", "full"]
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("snapkv2", 64)
    with pytest.raises(ValueError, match="snapkv2"):
        parse_policies("full,snapkv2")


def _retrieval(policy, budget, correct, kv, mode="aware"):
    return {"task": "passkey", "mode": mode, "policy": policy, "budget": budget, "correct": correct,
            "kv_bytes": kv, "full_bytes": 100}


def test_summary_table_and_plot(tmp_path):
    records = [_retrieval("full", None, True, 100), _retrieval("full", None, False, 100),
               _retrieval("snapkv", 64, True, 10), _retrieval("snapkv", 64, False, 30),
               _retrieval("snapkv", 128, True, 40, mode="agnostic"),
               {"task": "ppl", "mode": "blockwise", "policy": "h2o", "budget": 64, "nll": 1.0,
                "tokens": 10, "kv_bytes": 5, "full_bytes": 50},
               {"task": "ppl", "mode": "blockwise", "policy": "h2o", "budget": 64, "nll": 2.0,
                "tokens": 30, "kv_bytes": 5, "full_bytes": 50},
               {"task": "fidelity", "mode": "teacher-forced", "policy": "tova", "budget": 64, "kl": 0.5,
                "top1": 0.5, "tokens": 2, "kv_bytes": 1, "full_bytes": 4},
               {"task": "fidelity", "mode": "teacher-forced", "policy": "tova", "budget": 64, "kl": 0.2,
                "top1": 1.0, "tokens": 8, "kv_bytes": 1, "full_bytes": 4}]
    rows = {(r["task"], r["mode"], r["policy"], r["budget"]): r for r in summarize(records)}
    snap = rows[("passkey", "aware", "snapkv", 64)]
    assert (snap["correct"], snap["n"], snap["accuracy"], snap["kv_fraction"]) == (1, 2, 0.5, 0.2)
    assert rows[("passkey", "aware", "full", None)]["accuracy"] == 0.5
    ppl = rows[("ppl", "blockwise", "h2o", 64)]
    assert ppl["nll"] == pytest.approx(1.75) and ppl["ppl"] == pytest.approx(math.exp(1.75))
    fid = rows[("fidelity", "teacher-forced", "tova", 64)]
    assert fid["kl"] == pytest.approx(0.26) and fid["top1"] == pytest.approx(0.9)
    assert [r["mode"] for r in summarize(records) if r["task"] == "passkey"][-1] == "agnostic"
    table = format_table(summarize(records))
    assert "| snapkv | 1/2 (0.20) |\n" in table             # one column: the budgets of its panel
    assert "| full | 1/2 (1.00) |\n" in table
    assert "| snapkv | 1/1 (0.40) |" in table                # agnostic, B=128
    assert "| h2o | 5.75 (0.10) |" in table
    assert "| tova | 0.260, top-1 0.90 (0.25) |" in table
    path = tmp_path / "plot.png"
    plot(summarize(records), str(path), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_both_storages_implement_the_storage_interface():
    """RaggedLayerKV and MaskedLayerKV provide every method of LayerStorage, with its arguments."""
    import inspect

    from kvcache_ext.engine.ragged_storage import RaggedLayerKV
    from kvcache_ext.reference.masked_cache import MaskedLayerKV
    from kvcache_ext.engine.storage import GraphStorage, LayerStorage

    for cls in (RaggedLayerKV, MaskedLayerKV):
        storage = cls(2, 3, 8, torch.float32, torch.device("cpu"), 2)
        assert isinstance(storage, LayerStorage)
        # A decode graph captures the steps of a storage that says it can (and has the methods).
        assert storage.graph_ready == isinstance(storage, GraphStorage) == (cls is RaggedLayerKV)
        for protocol in (LayerStorage, GraphStorage) if storage.graph_ready else (LayerStorage,):
            for name, member in vars(protocol).items():
                if name.startswith("_") or not callable(getattr(protocol, name, None)):
                    continue
                want = list(inspect.signature(getattr(protocol, name)).parameters)
                got = list(inspect.signature(getattr(cls, name)).parameters)
                assert got == want, (cls.__name__, name, got, want)
