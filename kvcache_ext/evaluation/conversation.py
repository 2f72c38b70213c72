"""The multi-question task: one context compressed once, then questions as turns of one chat.

Each policy's cache is built from one shared dense prefill of the context (as for passkey and
needle in agnostic mode, ``shared_prefill``); the questions are then fed one after another over
that same cache, each followed by the model's greedy answer, which stays in the cache for the
next turn. One record per question.
"""
from __future__ import annotations

import torch

from kvcache_ext.hf.patching import patch
from kvcache_ext.evaluation.named_policies import run_label
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.evaluation.decoding import cache_bytes, full_cache_from, greedy_continue
from kvcache_ext.evaluation.retrieval import RetrievalRecord, prompt_runs
from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill, score_by_reconstruction
from kvcache_ext.tasks import check_answer
from kvcache_ext.tasks.multi_question import make_multi_question_prompt


def ask_in_turns(model, cache, prompt, eos: int | None, max_new_tokens: int):
    """Feeds every question turn over ``cache``, each after the previous answer; returns the
    answers' token ids and decode seconds per token, per question."""
    device = next(model.parameters()).device
    answers, unfed = [], None
    for turn in prompt.turns:
        ids = turn[None].to(device)
        if unfed is not None and unfed != eos:   # the answer's last token was not fed back yet
            ids = torch.cat([torch.tensor([[unfed]], device=device), ids], dim=1)
        logits = model(ids, **with_cache(model, cache), use_cache=True).logits[:, -1]
        new, decode_s = greedy_continue(model, cache, logits, max_new_tokens, eos)
        answers.append((new, decode_s))
        unfed = new[-1]
    return answers


@torch.no_grad()
def run_multi_question(model, tokenizer, policies, budgets, lengths, seeds: int = 1, schedule=None,
                       max_new_tokens: int = 8, on_run=None, kv_dtype: str | None = None,
                       first_seed: int = 0) -> list[RetrievalRecord]:
    """Every (policy, budget) on every prompt; a float budget keeps that fraction of the context.
    ``on_run(records)`` is called as each run ends, with its records (one per question).
    Block-wise schedules are refused (the shared prefill is one-shot). ``kv_dtype``: what the
    policies' pages hold (``patch``'s; their runs are recorded as ``run_label`` names them).
    ``first_seed``: the seed of the first prompt (the next ones count up from it)."""
    if schedule is not None and schedule.prefill_block is not None:
        raise ValueError("the multi-question task compresses the context once (one-shot schedule)")
    device = next(model.parameters()).device
    records, seed = [], first_seed
    for n in lengths:
        for _ in range(seeds):
            prompt = make_multi_question_prompt(tokenizer, n, seed=seed)
            seed += 1
            context = prompt.context[None].to(device)
            recorded = record_prefill(model, context)
            full_bytes = None
            for label, name, tokens, policy in prompt_runs(policies, budgets, context.shape[1], schedule):
                if policy is None:
                    cache, prefill_s = full_cache_from(model, recorded), recorded.seconds
                    answers = ask_in_turns(model, cache, prompt, tokenizer.eos_token_id, max_new_tokens)
                    full_bytes = cache_bytes(cache)
                else:
                    with patch(model, policy, tokenizer=tokenizer, kv_dtype=kv_dtype) as handle:
                        cache = compressed_cache(policy, recorded, handle.model_parts, kv_dtype)
                        prefill_s = recorded.seconds + score_by_reconstruction(handle, cache, recorded, context)
                        answers = ask_in_turns(model, cache, prompt, tokenizer.eos_token_id, max_new_tokens)
                if name == "full" and "full" not in policies:
                    continue
                held, run = cache_bytes(cache), []
                for (new, decode_s), answer, depth in zip(answers, prompt.answers, prompt.depths):
                    text = tokenizer.decode(new, skip_special_tokens=True)
                    run.append(RetrievalRecord(
                        "multi", "agnostic", run_label(name, kv_dtype), label, prompt.length, depth, prompt.seed,
                        answer, text, check_answer(text, answer), held, full_bytes, decode_s, tokens, prefill_s))
                records += run
                if on_run is not None:
                    on_run(run)
    return records
