"""The policies the harness knows by name, each at a budget and with a schedule.

Names are what ``kvcache-ext eval --policy`` takes. "full" is HF's full cache (the model
unpatched). The schedule is the same for every named policy of one run (``--prefill-block``,
``--decode-every``), so that methods are compared under one protocol; the papers' own protocols
are in docs/policies.md and the protocol of each result in docs/results.md.
"""
from __future__ import annotations

from kvcache_ext.policies import (
    CAOTE,
    H2O,
    KVEC,
    TOVA,
    KVzip,
    AcrossLayers,
    AdaKV,
    AhaKV,
    ExpectedAttention,
    Policy,
    Pooled,
    Pyramid,
    Random,
    RoCo,
    Schedule,
    ScissorHands,
    SnapKV,
    StreamingLLM,
)


def _h2o(budget: int) -> H2O:
    # The H2O paper's own split: half heavy hitters, half recent window (seed-003 §5).
    return H2O(recent=budget // 2)


# name -> (scorer(budget), allocation())
_RECIPES = {
    "streamingllm": (lambda b: StreamingLLM(), None),
    "random": (lambda b: Random(), None),
    "h2o": (_h2o, None),
    "tova": (lambda b: TOVA(), None),
    "tova-head": (lambda b: TOVA(per_head=True), None),
    "snapkv": (lambda b: SnapKV(), None),
    "pyramidkv": (lambda b: SnapKV(), lambda: Pyramid()),
    "ada-snapkv": (lambda b: SnapKV(), lambda: AdaKV()),
    "ada-pyramidkv": (lambda b: SnapKV(), lambda: AdaKV(layers=Pyramid())),
    # CAOTE's scores under the baselines' protocol: a block's output is computed before its
    # eviction, as for every other policy here, so that only the scores differ from the base's.
    # On the base's own score (gqa="shared", the default: base and +CAOTE differ only by CAOTE).
    "caote-h2o": (lambda b: CAOTE(_h2o(b), output_after_eviction=False), None),
    "caote-tova": (lambda b: CAOTE(TOVA(), output_after_eviction=False), None),
    "caote-tova-shared": (lambda b: CAOTE(TOVA(), gqa="shared", output_after_eviction=False), None),
    "caote-snapkv": (lambda b: CAOTE(SnapKV(), output_after_eviction=False), None),
    # Per query head, combined by the L2 norm (research/seed-000 §4.9's option 1).
    "caote-h2o-l2": (lambda b: CAOTE(_h2o(b), gqa="group_l2", output_after_eviction=False), None),
    "caote-tova-l2": (lambda b: CAOTE(TOVA(), gqa="group_l2", output_after_eviction=False), None),
    "caote-snapkv-l2": (lambda b: CAOTE(SnapKV(), gqa="group_l2", output_after_eviction=False), None),
    # CAOTE's Eq. 7 read literally (the library's default): a block's output over the kept tokens.
    "caote-h2o-eq7": (lambda b: CAOTE(_h2o(b)), None),
    "ahakv": (lambda b: AhaKV(), None),
    "roco": (lambda b: RoCo(), None),
    "scissorhands": (lambda b: ScissorHands(), None),
    "kvec": (lambda b: KVEC(), None),
    # Query-agnostic: KVzip's context reconstruction (its code's scoring softmax, and the
    # model's own probabilities over the whole context), uniform and head-wise (Ada-KV).
    "kvzip": (lambda b: KVzip(), None),
    "ada-kvzip": (lambda b: KVzip(), lambda: AdaKV()),
    "kvzip-context": (lambda b: KVzip(softmax="context"), None),
    "ada-kvzip-context": (lambda b: KVzip(softmax="context"), lambda: AdaKV()),
    "expected-attention": (lambda b: ExpectedAttention(), None),
    "ada-expected-attention": (lambda b: ExpectedAttention(), lambda: AdaKV()),
    # KVzip's own selection: one top-k over every head of every layer.
    "kvzip-global": (lambda b: KVzip(), lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    "kvzip-global-context": (lambda b: KVzip(softmax="context"), lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    # The chat template's prefix rebuilt and rated like the rest (skip_prefix=None; the default,
    # "chat", is kvpress's reading: neither rebuilt nor rated, its sinks apart).
    "kvzip-global-rebuild": (lambda b: KVzip(skip_prefix=None), lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    # The pooling ablation: the pooling methods without it, the others with max-pool kernel 7.
    "snapkv-nopool": (lambda b: SnapKV(kernel=1), None),
    "ahakv-nopool": (lambda b: AhaKV(score_pool=None), None),
    "kvec-nopool": (lambda b: KVEC(kernel=1), None),
    "h2o-pool": (lambda b: Pooled(_h2o(b)), None),
    "tova-pool": (lambda b: Pooled(TOVA()), None),
    "roco-pool": (lambda b: Pooled(RoCo()), None),
}

POLICY_NAMES = ("full",) + tuple(_RECIPES)


def make_policy(name: str, budget: int, schedule: Schedule | None = None) -> Policy | None:
    """The policy called ``name`` at ``budget`` tokens per KV head (None for "full")."""
    key = name.strip().lower()
    if key == "full":
        return None
    if key not in _RECIPES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    scorer, allocation = _RECIPES[key]
    kwargs = {"schedule": schedule} if schedule is not None else {}
    if allocation is not None:
        kwargs["allocation"] = allocation()
    return Policy(scorer(budget), budget=budget, **kwargs)


def parse_policies(text: str) -> list[str]:
    """A comma-separated list of names; "all" is every name."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no policy named in {text!r}; known: {', '.join(POLICY_NAMES)} (or all)")
    if names == ["all"]:
        return list(POLICY_NAMES)
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICY_NAMES)} (or all)")
    return names


def policy_runs(policies, budgets, schedule: Schedule | None = None):
    """(name, budget, Policy) of every named policy but "full" at every budget, in order."""
    return [(name, budget, make_policy(name, budget, schedule))
            for name in policies if name != "full" for budget in budgets]
