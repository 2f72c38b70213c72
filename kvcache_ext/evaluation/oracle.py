"""The oracle row of the evaluation: each head keeps the tokens that the full cache's own answer
attends to most. It is a ceiling to measure methods against, not a method.

The oracle is known only after the fact. To rate a prompt it needs the answer that the full
cache gives to that same prompt, so no server and no user could run it. It is therefore not a
registered policy: ``make_policy`` and ``kvcache-ext serve`` refuse its names, and only
``kvcache-ext eval --policy oracle`` (``evaluation.retrieval``) runs it, right after the full
cache's run on the same prompt.

How a prompt is rated (``answer_scores``): the prompt and the full cache's greedy answer are
teacher-forced through the model in one dense prefill (``record_prefill``: the model's own
queries and keys, after RoPE). In agnostic mode the prompt is the context followed by the
question. A compressed token's score in a (layer, KV head) is the softmax probability that the
answer's tokens, used as queries, give it, summed over the answer's positions and the G query
heads of the KV head. These are the probabilities that eager attention computes; on a
sliding-window layer the softmax runs over each query's window. The compressed cache is then
built from the prompt's own recording, as for every other one-shot policy. It keeps the
best-rated tokens of each head at the budget, with no protected window and no pooling, and the
answer is generated over it.

Two names, which differ only in how the budget is allocated:

- ``oracle``: Ada-KV's head-wise allocation (``AdaKV()``, alpha 0.5, as ``ada-snapkv`` and
  ``ada-kvzip`` use). Each layer's budget is split over its heads by where the answer's
  attention falls.
- ``oracle-uniform``: the same budget on every head (as ``snapkv``).
"""
from __future__ import annotations

import time

import torch

from kvcache_ext.evaluation.named_policies import ORACLE_POLICIES
from kvcache_ext.evaluation.shared_prefill import record_prefill
from kvcache_ext.policies import AdaKV, Policy, Protection, Scorer, Uniform
from kvcache_ext.policies.scorer import group_reduce
from kvcache_ext.policies.views import CacheView, PromptView

ALLOCATIONS = dict(zip(ORACLE_POLICIES, (AdaKV, Uniform)))   # oracle, oracle-uniform


class AnswerOracle(Scorer):
    """The oracle's scorer. It holds each layer's precomputed scores ``[B, H, n]`` (from
    ``answer_scores``) of the n tokens of one prompt and gives them back at that prompt's
    one-shot prefill. Evaluation only: it needs the full cache's answer to that same prompt,
    so it cannot serve any other prompt or request (see the module's docstring)."""

    def __init__(self, scores):
        if not isinstance(scores, (list, tuple)) or not scores or \
                not all(isinstance(s, torch.Tensor) and s.dim() == 3 for s in scores):
            raise ValueError("AnswerOracle scores must be a non-empty list of [B, H, n] tensors, one per layer "
                             f"(answer_scores' result), got {type(scores).__name__}")
        self.scores = list(scores)

    def __repr__(self) -> str:
        B, H, n = self.scores[0].shape
        return f"AnswerOracle({len(self.scores)} layers of [{B}, {H}, {n}] answer-attention scores)"

    def default_protection(self) -> Protection:
        return Protection()

    def check(self, schedule) -> None:
        if schedule.prefill_block is not None or schedule.evicts_over_cache:
            raise ValueError("the oracle rates one prompt's tokens once, after its prefill: it needs the "
                             f"one-shot schedule (no --prefill-block, no --decode-every), got {schedule}")

    def check_model(self, model) -> None:
        if len(self.scores) != model.num_layers or self.scores[0].shape[1] != model.kv_heads:
            raise ValueError(f"AnswerOracle scores are for {len(self.scores)} layers of {self.scores[0].shape[1]} "
                             f"KV heads; the model has {model.num_layers} layers of {model.kv_heads}")

    def prompt_scores(self, p: PromptView):
        scores = self.scores[p.layer_idx]
        if tuple(scores.shape) != tuple(p.k.shape[:3]):
            raise ValueError(f"AnswerOracle scores of layer {p.layer_idx} have shape {tuple(scores.shape)}, but "
                             f"the prompt compressed is {tuple(p.k.shape[:3])} (batch, KV heads, tokens): the "
                             "scores are of another prompt")
        return scores.to(device=p.k.device, dtype=torch.float32), None

    def cache_scores(self, view: CacheView):
        raise RuntimeError("the oracle evicts once, after the prompt (one-shot schedule only)")


def _ids(value, name: str) -> torch.Tensor:
    """``value`` as token ids [1, n], n >= 1 (a list of ints or a 1-D or [1, n] tensor)."""
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise ValueError(f"{name} must be a non-empty list of token ids, got {value!r}")
        value = torch.tensor([value], dtype=torch.long)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be token ids (a list of ints or a tensor), got {type(value).__name__}")
    if value.dim() == 1:
        value = value[None]
    if value.dim() != 2 or value.shape[0] != 1 or value.shape[1] == 0:
        raise ValueError(f"{name} must be the token ids of one non-empty sequence ([n] or [1, n]), "
                         f"got shape {tuple(value.shape)}")
    if value.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must hold integer token ids, got {value.dtype}")
    return value.long()


@torch.no_grad()
def answer_scores(model, prompt_ids, answer_ids, scored: int | None = None) -> list[torch.Tensor]:
    """Per layer, ``[1, H, scored]`` float32: the attention that the answer's tokens give each of
    the first ``scored`` tokens of the prompt (default: all of them). ``prompt_ids`` is what the
    model read before answering, in agnostic mode the context followed by the question.
    ``answer_ids`` is the full cache's answer. Each score is the softmax probability, as the model
    computes it over everything a query sees, summed over the answer's positions (each answer
    token as a query, teacher-forced after the prompt) and over the G query heads of the KV head.
    The model must not be patched."""
    prompt = _ids(prompt_ids, "prompt_ids")
    answer = _ids(answer_ids, "answer_ids")
    n, m = prompt.shape[1], answer.shape[1]
    scored = n if scored is None else scored
    if isinstance(scored, bool) or not isinstance(scored, int) or not 1 <= scored <= n:
        raise ValueError(f"scored must be an int in [1, {n}] (the prompt's tokens to rate), got {scored!r}")
    device = next(model.parameters()).device
    ids = torch.cat([prompt, answer], dim=1).to(device)
    recorded = record_prefill(model, ids)
    windows = recorded.windows or [None] * len(recorded.views)
    out = []
    for view, window in zip(recorded.views, windows):
        total = None
        for i0, probs in view.probs(slice(n, n + m)):            # [1, Hq, c, n + m]
            if window is not None:   # HF's sliding mask: a query sees the keys of its last `window` positions
                q_pos = view.pos[:, i0:i0 + probs.shape[2]]
                seen = view.pos[:, None, :] > (q_pos[:, :, None] - window)
                probs = probs * seen[:, None]
                probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
            part = probs[..., :scored].sum(dim=2)                # [1, Hq, scored]
            total = part if total is None else total + part
        out.append(group_reduce(total, view.groups, "sum").float())
    return out


def oracle_policy(name: str, budget: int, scores) -> Policy:
    """The policy ``name`` (one of ``ORACLE_POLICIES``) at ``budget`` tokens per KV head over the
    prompt that ``scores`` rate (``answer_scores``). Evaluation only."""
    if name not in ALLOCATIONS:
        raise ValueError(f"unknown oracle {name!r}; known: {', '.join(ALLOCATIONS)}")
    return Policy(AnswerOracle(scores), budget=budget, allocation=ALLOCATIONS[name]())


def timed_answer_scores(model, prompt_ids, answer_ids, scored: int) -> tuple[list[torch.Tensor], float]:
    """``(answer_scores(...), seconds)``: the scores and the wall time of their teacher-forced pass."""
    start = time.perf_counter()
    scores = answer_scores(model, prompt_ids, answer_ids, scored)
    return scores, time.perf_counter() - start
