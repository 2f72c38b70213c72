"""The registry of named policies: what the harness knows by name, each at a budget and with a
schedule.

Names are what ``kvcache-ext eval --policy`` and ``make_policy`` take. "full" is HF's full cache
(the model unpatched). The schedule is the same for every named policy of one run
(``--prefill-block``, ``--decode-every``), so that methods are compared under one protocol; the
papers' own protocols are in docs/policies.md and the protocol of each result in docs/results.md.

A scorer joins the registry under a name with one call, from its own file or from the script
that runs it, and is then run by that name like any other (``kvcache-ext eval`` in the same
process, ``make_policy``)::

    register_policy("my-scorer", scorer=lambda budget: MyScorer())
    register_policy("ada-my-scorer", scorer=lambda budget: MyScorer(), allocation=AdaKV)

The library's own policies are the entries of ``BUILT_IN`` below.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

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
    Spanned,
    Spans,
    StreamingLLM,
)
from kvcache_ext.checks import Bool
from kvcache_ext.policies.schedule import LOOKAHEAD


def _h2o(budget: int) -> H2O:
    # The H2O paper's own split: half heavy hitters, half recent window (the RoCo paper's
    # "following H2O, i.e. r = B/2": Ren and Zhu, 2024, §5.1.5).
    return H2O(recent=budget // 2)


# name -> (scorer(budget), allocation() or None: the Policy's default, uniform[, lookahead: decode
# steps before the one-shot compression, on top of the run's schedule[, lookahead_queries]])
BUILT_IN = {
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
    # Per query head, combined by the L2 norm (docs/policies.md, CAOTE's "GQA").
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
    # KVzip's scores shared by whole spans (Spanned) before its global top-k: words and numbers,
    # numbers only, sentences; and the span-free ablations of its allocation (a half-uniform
    # floor per head, Ada-KV's alpha, over the same layer split) and of its GQA reduction.
    "kvzip-global-spans": (lambda b: Spanned(KVzip()), lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    "kvzip-global-numbers": (lambda b: Spanned(KVzip(), Spans("number")),
                             lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    "kvzip-global-sentences": (lambda b: Spanned(KVzip(), Spans("sentence")),
                               lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    # Sentences with each one other change: their mean, equal layer budgets (heads still by the
    # scores), the model's own softmax over the whole context.
    "kvzip-global-sentences-mean": (lambda b: Spanned(KVzip(), Spans("sentence", "mean")),
                                    lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    "kvzip-layers-sentences": (lambda b: Spanned(KVzip(), Spans("sentence")), lambda: AdaKV(alpha=1.0)),
    "kvzip-global-context-sentences": (lambda b: Spanned(KVzip(softmax="context"), Spans("sentence")),
                                       lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    # Both, with the chat template's prefix rebuilt and rated as the context is (skip_prefix=None).
    "kvzip-global-context-sentences-rebuild": (
        lambda b: Spanned(KVzip(softmax="context", skip_prefix=None), Spans("sentence")),
        lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    # Sentences blended with each token's own score (Spans' share: 0.25, 0.5, 0.75 of a
    # token's score its sentence's), between KVzip's token selection and whole sentences.
    **{f"kvzip-global-context-sentences-share{round(100 * share)}": (
        lambda b, share=share: Spanned(KVzip(softmax="context"), Spans("sentence", share=share)),
        lambda: AdaKV(alpha=1.0, layers=AcrossLayers())) for share in (0.25, 0.5, 0.75)},
    # Sentences that choose which tokens each head keeps but not how many: the budget split over
    # layers and heads by KVzip's own token scores (budgets="tokens").
    "kvzip-global-sentences-token-budgets": (lambda b: Spanned(KVzip(), Spans("sentence"), budgets="tokens"),
                                             lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    "kvzip-global-context-sentences-token-budgets": (
        lambda b: Spanned(KVzip(softmax="context"), Spans("sentence"), budgets="tokens"),
        lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    "kvzip-global-floor": (lambda b: KVzip(), lambda: AdaKV(alpha=0.5, layers=AcrossLayers())),
    "kvzip-global-gqa-mean": (lambda b: KVzip(gqa="mean"), lambda: AdaKV(alpha=1.0, layers=AcrossLayers())),
    # The pooling ablation: the pooling methods without it, the others with max-pool kernel 7.
    "snapkv-nopool": (lambda b: SnapKV(kernel=1), None),
    "ahakv-nopool": (lambda b: AhaKV(score_pool=None), None),
    "kvec-nopool": (lambda b: KVEC(kernel=1), None),
    "h2o-pool": (lambda b: Pooled(_h2o(b)), None),
    "tova-pool": (lambda b: Pooled(TOVA()), None),
    "roco-pool": (lambda b: Pooled(RoCo()), None),
    # Whole spans (Spans: words and numbers, by the max): a number kept whole or dropped whole.
    # Needs the model's tokenizer (kvcache-ext eval passes it).
    "snapkv-spans": (lambda b: Spanned(SnapKV()), None),
    "ada-snapkv-spans": (lambda b: Spanned(SnapKV()), lambda: AdaKV()),
    "ahakv-spans": (lambda b: Spanned(AhaKV()), None),
    # One-shot compression deferred by L decode steps whose queries join SnapKV's observation
    # window (Schedule lookahead): L = 8, and the ablation's 4 and 16.
    "snapkv-lookahead": (lambda b: SnapKV(), None, 8),
    "ada-snapkv-lookahead": (lambda b: SnapKV(), lambda: AdaKV(), 8),
    "ada-snapkv-spans-lookahead": (lambda b: Spanned(SnapKV()), lambda: AdaKV(), 8),
    "ada-snapkv-lookahead4": (lambda b: SnapKV(), lambda: AdaKV(), 4),
    "ada-snapkv-lookahead16": (lambda b: SnapKV(), lambda: AdaKV(), 16),
    # The ablation: deferred by 8 steps, but the prompt scored by its own window.
    "ada-snapkv-deferred": (lambda b: SnapKV(), lambda: AdaKV(), 8, False),
    # Whole sentences (Spans("sentence")): without and with the lookahead.
    "ada-snapkv-sentences": (lambda b: Spanned(SnapKV(), Spans("sentence")), lambda: AdaKV()),
    "ada-snapkv-sentences-lookahead": (lambda b: Spanned(SnapKV(), Spans("sentence")), lambda: AdaKV(), 8),
}

RESERVED = ("full", "all")   # HF's full cache; every name (parse_policies)
# The evaluation's ceiling (``evaluation.oracle``): it needs the full cache's answer to the prompt
# it compresses, so only ``kvcache-ext eval`` runs it; ``make_policy`` refuses these names.
ORACLE_POLICIES = ("oracle", "oracle-uniform")
_REGISTRY: dict[str, tuple[Callable, Callable | None, int, bool]] = {}


def register_policy(name: str, scorer: Callable, allocation: Callable | None = None, *,
                    replace: bool = False, lookahead: int = 0, lookahead_queries: bool = True) -> None:
    """Makes ``name`` a policy that ``make_policy`` and ``kvcache-ext eval --policy`` know.

    ``scorer(budget)`` builds its scorer (a ``kvcache_ext.policies.Scorer``) for a budget in
    tokens per KV head; ``allocation()`` builds its allocation (a class such as ``AdaKV``, or a
    function), None: the Policy's default (uniform). Names are lower case, without spaces or
    commas; a name already taken is refused unless ``replace=True``. ``lookahead``: decode steps
    before its one-shot compression (``Schedule(lookahead=...)``, set on the run's schedule), and
    ``lookahead_queries``: whether their queries join the observation window."""
    if not isinstance(name, str) or not name or name != name.strip().lower() or "," in name or " " in name:
        raise ValueError(f"register_policy name must be a non-empty lower-case name without spaces or "
                         f"commas, got {name!r}")
    if name in RESERVED + ORACLE_POLICIES:
        raise ValueError(f"register_policy name {name!r} is reserved ({', '.join(RESERVED + ORACLE_POLICIES)})")
    if not callable(scorer):
        raise TypeError(f"register_policy scorer must be a function of the budget that returns a Scorer, "
                        f"got {type(scorer).__name__}")
    if allocation is not None and not callable(allocation):
        raise TypeError(f"register_policy allocation must be a function (or class) that returns an "
                        f"Allocation, or None, got {type(allocation).__name__}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"policy {name!r} is already registered (replace=True replaces it)")
    lookahead = LOOKAHEAD(lookahead, "register_policy lookahead")
    lookahead_queries = Bool()(lookahead_queries, "register_policy lookahead_queries")
    _REGISTRY[name] = (scorer, allocation, lookahead, lookahead_queries)


def unregister_policy(name: str) -> None:
    """Forgets a registered name (ValueError if it is not registered)."""
    if name not in _REGISTRY:
        raise ValueError(f"policy {name!r} is not registered; registered: {', '.join(_REGISTRY)}")
    del _REGISTRY[name]


def policy_names() -> tuple[str, ...]:
    """Every name ``make_policy`` takes: "full", then the registered policies in order."""
    return ("full",) + tuple(_REGISTRY)


for _name, (_scorer, _allocation, *_schedule) in BUILT_IN.items():
    register_policy(_name, _scorer, _allocation, **dict(zip(("lookahead", "lookahead_queries"), _schedule)))


def make_policy(name: str, budget: int, schedule: Schedule | None = None) -> Policy | None:
    """The policy called ``name`` at ``budget`` tokens per KV head (None for "full")."""
    key = name.strip().lower()
    if key == "full":
        return None
    if key in ORACLE_POLICIES:
        raise ValueError(f"policy {name!r} is the evaluation's oracle: it needs the full cache's answer to the "
                         "prompt it compresses, so it is no policy to serve or patch a model with; kvcache-ext eval "
                         f"--policy {key} runs it (passkey, needle, ruler)")
    if key not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}")
    scorer, allocation, lookahead, lookahead_queries = _REGISTRY[key]
    if lookahead:
        schedule = dataclasses.replace(schedule or Schedule(), lookahead=lookahead,
                                       lookahead_queries=lookahead_queries)
    kwargs = {"schedule": schedule} if schedule is not None else {}
    if allocation is not None:
        kwargs["allocation"] = allocation()
    return Policy(scorer(budget), budget=budget, **kwargs)


def parse_policies(text: str) -> list[str]:
    """A comma-separated list of names; "all" is every name of ours (kvpress's presses,
    ``kvpress-*``, and the oracles, ``ORACLE_POLICIES``, are named one by one)."""
    from kvcache_ext.evaluation.kvpress_runs import KVPRESS_POLICIES
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    known = policy_names()
    if not names:
        raise ValueError(f"no policy named in {text!r}; known: {', '.join(known)} (or all)")
    if names == ["all"]:
        return list(known)
    unknown = [n for n in names if n not in known + KVPRESS_POLICIES + ORACLE_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(known)} (or all), kvpress's "
                         f"{', '.join(KVPRESS_POLICIES)}, and the oracles {', '.join(ORACLE_POLICIES)}")
    return names


def policy_runs(policies, budgets, schedule: Schedule | None = None):
    """(name, budget, Policy) of every named policy but "full" at every budget, in order."""
    return [(name, budget, make_policy(name, budget, schedule))
            for name in policies if name != "full" for budget in budgets]


def run_label(name: str, kv_dtype: str | None) -> str:
    """The name a run is recorded under: the policy's, and the pages' dtype when it is not the
    model's (``snapkv+int8``), so that both stand as their own rows in a report."""
    return name if kv_dtype is None or name == "full" else f"{name}+{kv_dtype}"
