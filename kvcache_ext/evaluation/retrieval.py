"""Passkey and needle retrieval under eviction, in two prompt modes.

- ``aware``: the question is part of the prompt that gets compressed (the papers' setting:
  SnapKV's observation window then holds the question).
- ``agnostic``: the context (everything before the question) is compressed first; the question
  arrives afterwards over the compressed cache, as kvpress evaluates. Query-aware scorers can
  no longer aim at the question.

With a one-shot schedule every policy shares one dense prefill per prompt
(``shared_prefill``); a block-wise prefill runs the patched model on the prompt for each policy.
The oracles (``evaluation.oracle``) run last on each prompt, from the full cache's answer to it.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from kvcache_ext.hf.patching import patch
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.evaluation.decoding import (
    cache_bytes,
    full_cache_from,
    greedy_continue,
)
from kvcache_ext.evaluation.decode_together import (
    bytes_after_decoding,
    decodes_together,
    greedy_rows,
    stacked_cache,
    stacking_policy,
)
from kvcache_ext.evaluation.kvpress_runs import KVPRESS_POLICIES, run_press_budgets
from kvcache_ext.evaluation.named_policies import ORACLE_POLICIES, policy_runs, run_label
from kvcache_ext.evaluation.oracle import oracle_policy, timed_answer_scores
from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill, score_by_reconstruction
from kvcache_ext.tasks import make_needle_prompt, make_passkey_prompt
from kvcache_ext.tasks.ruler import make_ruler_prompt

MODES = ("aware", "agnostic")
MAKERS = {"passkey": make_passkey_prompt, "needle": make_needle_prompt}


@dataclass
class RetrievalRecord:
    task: str
    mode: str
    policy: str
    budget: int | float | None     # tokens per KV head, or (a float) the fraction of the compressed part kept
    length: int
    depth: float
    seed: int
    answer: str
    output: str
    correct: bool
    kv_bytes: int
    full_bytes: int
    decode_s_per_token: float
    budget_tokens: int | None = None   # tokens per KV head this run kept (= budget unless a fraction)
    prefill_s: float | None = None     # the prompt's prefill, reconstruction passes included
    score: float | None = None         # share of the expected answers in the output (RULER's metric; 0 or 1 else)
    # Rows of the batch its decoding ran in (``decode_together``; decode_s_per_token is then a
    # step of that batch), 1: alone.
    decoded_rows: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


def split_prompt(prompt, mode: str):
    """(context ids, question ids or None) [1, n] of a retrieval prompt in ``mode``."""
    ids = prompt.input_ids[None]
    if mode == "aware":
        return ids, None
    if mode == "agnostic":
        return ids[:, :prompt.haystack_end], ids[:, prompt.haystack_end:]
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def windowed(recorded) -> bool:
    """Whether a recorded prefill's model has sliding-window layers."""
    return recorded is not None and any(window is not None for window in recorded.windows)


@torch.no_grad()
def ask(model, cache, question: torch.Tensor, one_at_a_time: bool = False) -> torch.Tensor:
    """The last logits [B, V] after ``question`` [B, m] over ``cache``. ``one_at_a_time``: as m
    one-token steps, for a model with sliding-window layers: the engine windows a one-token
    step exactly, and refuses several tokens over a cache that has passed the window."""
    if not one_at_a_time:
        return model(question, **with_cache(model, cache), use_cache=True).logits[:, -1]
    for t in range(question.shape[1]):
        logits = model(question[:, t:t + 1], **with_cache(model, cache), use_cache=True).logits[:, -1]
    return logits


@torch.no_grad()
def budget_tokens(budget: int | float, length: int) -> int:
    """Tokens per KV head of a budget given in tokens (int) or as the fraction of a prompt of
    ``length`` tokens that is kept (float, rounded up)."""
    return budget if isinstance(budget, int) else max(1, math.ceil(budget * length))


def prompt_runs(policies, budgets, length: int, schedule=None) -> list:
    """``(budget as given, name, tokens per KV head, Policy)`` of the full cache (first, with
    ``None``s) and of every named policy at every budget, for a compressed part of ``length``."""
    labels = [None] + [b for name in policies if name != "full" for b in budgets]
    runs = policy_runs(policies, [budget_tokens(b, length) for b in budgets], schedule)
    return [(label, *run) for label, run in zip(labels, [("full", None, None)] + runs)]


def run_prompt(model, tokenizer, prompt, task: str, mode: str, policies: list[str], budgets: list,
               schedule=None, max_new_tokens: int | None = 8, on_run=None,
               kv_dtype: str | None = None, together: bool = True) -> list[RetrievalRecord]:
    """Every (policy, budget) on one prompt in one mode. ``on_run(record)`` is called as each run
    ends, with its record. A float budget keeps that fraction of the part compressed (the context
    in agnostic mode). ``max_new_tokens=None``: the prompt's own (a RULER task's). ``kv_dtype``: what
    our policies' pages hold (``patch``'s; their runs are recorded as ``run_label`` names them).
    ``together``: the one-shot runs of our policies decode as the rows of one batch
    (``decode_together``; their records come once all have decoded); False: each alone."""
    if max_new_tokens is None:
        max_new_tokens = prompt.max_new_tokens
    device = next(model.parameters()).device
    context, question = split_prompt(prompt, mode)
    context = context.to(device)
    question = question.to(device) if question is not None else None
    eos = tokenizer.eos_token_id
    recorded = None
    full_bytes = None

    def last_logits(cache, recorded_logits, rows: int = 1):
        if question is None:
            return recorded_logits[:, -1].expand(rows, -1)
        return ask(model, cache, question.expand(rows, -1), one_at_a_time=windowed(recorded))

    def record(name, budget, new, decode_s, held, tokens=None, prefill_s=None, rows=1):
        text = tokenizer.decode(new, skip_special_tokens=True)
        score = prompt.score(text)
        return RetrievalRecord(task, mode, name, budget, prompt.length, prompt.depth, prompt.seed,
                               prompt.answer, text, score == 1.0, held, full_bytes,
                               decode_s, tokens, prefill_s, score, rows)

    # The full cache runs first: every record carries its bytes, for the "KV kept / full" column.
    out = []
    ours = [name for name in policies if name not in KVPRESS_POLICIES + ORACLE_POLICIES]
    full_answer = None
    waiting = []   # (index in out, name, budget as given, tokens, prefill seconds, cache): to decode together
    for label, name, budget, policy in prompt_runs(ours, budgets, context.shape[1], schedule):
        if recorded is None and (policy is None or policy.schedule.prefill_block is None):
            recorded = record_prefill(model, context)
        if policy is None:
            cache = full_cache_from(model, recorded)
            new, decode_s = greedy_continue(model, cache, last_logits(cache, recorded.logits),
                                            max_new_tokens, eos)
            full_bytes = cache_bytes(cache)
            full_answer = new
            if "full" not in policies:
                continue
            out.append(record(name, None, new, decode_s, full_bytes, prefill_s=recorded.seconds))
            on_run and on_run(out[-1])
        elif together and decodes_together(policy):
            with patch(model, policy, tokenizer=tokenizer, kv_dtype=kv_dtype) as handle:
                cache = compressed_cache(policy, recorded, handle.model_parts, kv_dtype)
                prefill_s = recorded.seconds + score_by_reconstruction(handle, cache, recorded, context)
            waiting.append((len(out), run_label(name, kv_dtype), label, budget, prefill_s, cache))
            out.append(None)
        else:
            with patch(model, policy, tokenizer=tokenizer, kv_dtype=kv_dtype) as handle:
                if policy.schedule.prefill_block is None:
                    cache = compressed_cache(policy, recorded, handle.model_parts, kv_dtype)
                    prefill_s = recorded.seconds + score_by_reconstruction(handle, cache, recorded, context)
                    logits = last_logits(cache, recorded.logits)
                else:
                    cache = handle.new_cache()
                    start = time.perf_counter()
                    logits = model(context, **with_cache(model, cache), use_cache=True).logits[:, -1]
                    prefill_s = time.perf_counter() - start
                    if question is not None:
                        logits = model(question, **with_cache(model, cache), use_cache=True).logits[:, -1]
                new, decode_s = greedy_continue(model, cache, logits, max_new_tokens, eos)
                out.append(record(run_label(name, kv_dtype), label, new, decode_s, cache_bytes(cache), budget,
                                  prefill_s))
            on_run and on_run(out[-1])
    if waiting:
        # Every one-shot run of the prompt decodes as a row of one batch (``decode_together``).
        with patch(model, stacking_policy(recorded), tokenizer=tokenizer, kv_dtype=kv_dtype) as handle:
            stacked = stacked_cache(handle.policy, [entry[-1] for entry in waiting], recorded, handle.model_parts,
                                    kv_dtype)
            rows = len(waiting)
            news, step_s = greedy_rows(model, stacked, last_logits(stacked, recorded.logits, rows), max_new_tokens,
                                       eos)
        asked = 0 if question is None else question.shape[1]
        for (at, name, label, budget, prefill_s, cache), new in zip(waiting, news):
            held = bytes_after_decoding(cache, asked, len(new) - 1, question_in_steps=windowed(recorded))
            out[at] = record(name, label, new, step_s, held, budget, prefill_s, rows=rows)
            on_run and on_run(out[at])
    oracles = [name for name in policies if name in ORACLE_POLICIES]
    if oracles:
        # The full cache's answer, teacher-forced after what the model read (the question too, in
        # agnostic mode), rates the compressed part's tokens once for every budget.
        asked = context if question is None else torch.cat([context, question], dim=1)
        scores, scoring_s = timed_answer_scores(model, asked, full_answer, context.shape[1])
        for name in oracles:
            for label in budgets:
                tokens = budget_tokens(label, context.shape[1])
                policy = oracle_policy(name, tokens, scores)
                with patch(model, policy, tokenizer=tokenizer, kv_dtype=kv_dtype) as handle:
                    cache = compressed_cache(policy, recorded, handle.model_parts, kv_dtype)
                    new, decode_s = greedy_continue(model, cache, last_logits(cache, recorded.logits),
                                                    max_new_tokens, eos)
                    out.append(record(run_label(name, kv_dtype), label, new, decode_s, cache_bytes(cache), tokens,
                                      recorded.seconds + scoring_s))
                on_run and on_run(out[-1])
    for name in [name for name in policies if name in KVPRESS_POLICIES]:
        # One prefill (and KVzip's passes) for every budget of the press (``run_press_budgets``).
        runs = run_press_budgets(model, tokenizer, name, budgets, context, question, max_new_tokens)
        for label, (new, decode_s, held, prefill_s) in zip(budgets, runs):
            out.append(record(name, label, new, decode_s, held, budget_tokens(label, context.shape[1]), prefill_s))
            on_run and on_run(out[-1])
    return out


def make_prompts(tokenizer, task: str, lengths, depths, seeds: int, ruler_tasks=(), first_seed: int = 0):
    """The task's prompts: every length x depth, ``seeds`` of each (distinct seeds throughout,
    counted from ``first_seed``); for ``task="ruler"``, every RULER task of ``ruler_tasks`` x
    length, seeds ``first_seed`` to ``first_seed + seeds - 1`` of each (the tasks place their
    needles themselves: ``depths`` is not used)."""
    prompts, seed = [], first_seed
    if task == "ruler":
        return [make_ruler_prompt(tokenizer, name, n, seed=s) for name in ruler_tasks for n in lengths
                for s in range(first_seed, first_seed + seeds)]
    make = MAKERS[task]
    for n in lengths:
        for depth in depths:
            for _ in range(seeds):
                prompts.append(make(tokenizer, n, depth, seed=seed))
                seed += 1
    return prompts


def run_retrieval(model, tokenizer, task: str, policies, budgets, lengths, depths, modes=MODES, seeds: int = 1,
                  schedule=None, max_new_tokens: int | None = 8, progress: bool = True,
                  on_record=None, ruler_tasks=(), kv_dtype: str | None = None,
                  together: bool = True, first_seed: int = 0) -> list[RetrievalRecord]:
    """Every prompt in every mode; ``on_record(record)`` as each run ends. ``task="ruler"``: the
    prompts of ``ruler_tasks``, each record under its RULER task's name. ``first_seed``: where
    the prompts' seeds start (``make_prompts``)."""
    from tqdm.auto import tqdm
    prompts = make_prompts(tokenizer, task, lengths, depths, seeds, ruler_tasks, first_seed)
    per_prompt = ("full" in policies) + sum(len(budgets) for p in policies if p != "full")
    bar = tqdm(total=len(prompts) * len(modes) * per_prompt, desc=f"eval {task}", unit="run",
               disable=not progress)
    records = []
    for mode in modes:
        for prompt in prompts:
            records += run_prompt(model, tokenizer, prompt, getattr(prompt, "task", task), mode, policies, budgets,
                                  schedule, max_new_tokens,
                                  on_run=lambda r: (bar.update(1), on_record and on_record(r)), kv_dtype=kv_dtype,
                                  together=together)
    bar.close()
    return records
