"""A scorer from outside the library, added the documented way: its own code (here, in this file)
and one ``register_policy`` call, nothing else edited. It then runs by name through the
evaluation harness (``make_policy``, ``kvcache-ext eval``) and through ``patch`` + ``generate``."""
import json
from dataclasses import dataclass

import pytest
import torch

import kvcache_ext
import kvcache_ext.hf.models as models
from kvcache_ext import cli
from kvcache_ext.evaluation import make_policy, policy_names, register_policy
from kvcache_ext.evaluation.named_policies import parse_policies, unregister_policy
from kvcache_ext.policies import AdaKV, Capabilities, EveryStep, Policy, Scorer
from test_patch import inputs
from tiny_models import tiny_model

NAME = "newest-first"


@dataclass
class NewestFirst(Scorer):
    """A throwaway scorer: a token's score is its position, so each head keeps its newest tokens."""

    def prompt_scores(self, p):
        B, H, n, _ = p.k.shape
        return p.pos[:, None, :].expand(B, H, n).float(), None

    def cache_scores(self, view):
        return view.pos.float()


@dataclass
class HeavyLast(Scorer):
    """A throwaway scorer with state, declared in its capabilities alone: one channel to which
    the storage adds the attention each token receives, and the latest query's attention read
    at every eviction. Nothing of the engine knows it."""

    capabilities = Capabilities(channels=1, accumulates=("mass",), evict_stats=("last",))

    def prompt_scores(self, p):
        B, H, n, _ = p.k.shape
        mass = sum(probs.sum(dim=2) for _, probs in p.probs())               # [B, Hq, n]
        mass = mass.unflatten(1, (H, p.groups)).sum(dim=2)                    # per KV head
        return mass, mass[..., None]

    def cache_scores(self, view):
        return view.channels[..., 0] + view.stats["last"].sum(dim=-1)


@pytest.fixture
def registered():
    register_policy(NAME, scorer=lambda budget: NewestFirst())
    register_policy(f"ada-{NAME}", scorer=lambda budget: NewestFirst(), allocation=AdaKV)
    yield NAME
    unregister_policy(NAME)
    unregister_policy(f"ada-{NAME}")


def test_a_registered_scorer_is_a_named_policy(registered):
    assert policy_names()[-2:] == (NAME, f"ada-{NAME}")
    assert parse_policies(f"full, {NAME.upper()}") == ["full", NAME]
    policy = make_policy(NAME, 24)
    assert isinstance(policy.scorer, NewestFirst) and policy.budget == 24
    assert isinstance(make_policy(f"ada-{NAME}", 24).allocation, AdaKV)


def test_it_runs_through_patch_and_generate(registered):
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=30, pad=[0, 5])
    with kvcache_ext.patch(model, make_policy(NAME, 8)) as handle:
        cache = handle.new_cache()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             **kvcache_ext.with_cache(model, cache))
    assert out.shape == (2, 33)
    for layer in range(2):
        parts = cache.layer_kv(layer).view(None, False)
        for b, real in enumerate((30, 25)):
            for h in range(2):
                kept = sorted(parts["pos"][b, h][parts["mask"][b, h]].tolist())
                # The prompt's 8 newest positions, then the 2 tokens decoding appended (the third
                # generated token is never fed back).
                assert kept == list(range(real - 8, real + 2)), (layer, b, h)


def test_a_scorer_with_state_evicts_every_step_through_its_capabilities():
    """HeavyLast evicting at every decode step: the ragged path gives the reference path's
    logits and holds its budget, from what its capabilities declare alone."""
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    ids, mask = inputs(batch=2, length=30, pad=[0, 5])
    policy = Policy(HeavyLast(), budget=10, schedule=EveryStep())
    logits = []
    with kvcache_ext.patch(model, policy) as handle:
        for cache in (handle.new_cache(), handle.new_cache(reference=True)):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, **kvcache_ext.with_cache(model, cache))
            logits.append(torch.stack(out.logits))
            assert all(int(kept.max()) <= 10 for kept in cache.kept_tokens())
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_it_runs_by_name_through_kvcache_ext_eval(registered, default_model, monkeypatch, tmp_path):
    monkeypatch.setattr(models, "load_model", lambda name=None, **kwargs: default_model)
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--task", "passkey", "--policy", f"full,{NAME}", "--budget", "64", "--lengths", "300",
                     "--depths", "0.5", "--mode", "agnostic", "--json", str(out), "--no-progress"]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"full", NAME}
    assert rows[NAME]["budget"] == 64 and rows[NAME]["n"] == 1
    assert rows[NAME]["kv_fraction"] < 0.5 <= rows["full"]["kv_fraction"]


def test_register_policy_refuses_what_it_cannot_keep(registered):
    with pytest.raises(ValueError, match="already registered"):
        register_policy(NAME, scorer=lambda budget: NewestFirst())
    register_policy(NAME, scorer=lambda budget: NewestFirst(), replace=True)
    for bad, match in [("full", "reserved"), ("all", "reserved"), ("Mine", "lower-case"), ("a,b", "commas"),
                       ("", "non-empty"), (7, "lower-case")]:
        with pytest.raises(ValueError, match=match):
            register_policy(bad, scorer=lambda budget: NewestFirst())
    with pytest.raises(TypeError, match="scorer must be a function"):
        register_policy("mine", scorer=NewestFirst())
    with pytest.raises(TypeError, match="allocation must be"):
        register_policy("mine", scorer=lambda budget: NewestFirst(), allocation=AdaKV())
    with pytest.raises(ValueError, match="not registered"):
        unregister_policy("mine")
    assert "mine" not in policy_names()
