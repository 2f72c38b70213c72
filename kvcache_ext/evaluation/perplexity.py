"""Perplexity of long prose under block-wise eviction (CAOTE's protocol: Goel et al., 2025, §4.3).

The text is fed in one call to the patched model with a ``BlockwisePrefill(m)`` schedule: the
layers process it m tokens at a time over the ragged cache and evict down to the budget after
each block, so every token is predicted from what was kept of the tokens before it. (A one-shot
schedule would evict only after the whole text, which leaves the perplexity unchanged.)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvcache_ext.hf.patching import patch
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.evaluation.decoding import cache_bytes
from kvcache_ext.evaluation.named_policies import policy_runs, run_label


@dataclass
class PerplexityRecord:
    task: str
    mode: str
    policy: str
    budget: int | None
    length: int
    seed: int
    nll: float          # mean next-token negative log-likelihood, nats
    tokens: int         # tokens predicted
    kv_bytes: int
    full_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def _mean_nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    return float(-logp.gather(-1, ids[0, 1:, None]).mean())


@torch.no_grad()
def run_text(model, ids: torch.Tensor, seed: int, policies, budgets, schedule, on_run=None, tokenizer=None,
             kv_dtype: str | None = None):
    """Every (policy, budget) on one text ``ids`` [1, n]. ``on_run(record)`` as each run ends.
    ``tokenizer``: the model's (what ``patch`` needs for a policy with spans). ``kv_dtype``: what
    the policies' pages hold (``patch``'s; their runs are recorded as ``run_label`` names them)."""
    from transformers import DynamicCache
    if schedule is None or schedule.prefill_block is None:
        raise ValueError("ppl needs a block-wise prefill schedule (e.g. --prefill-block 128)")
    n = ids.shape[1]
    full = DynamicCache(config=model.config)
    full_nll = _mean_nll(model(ids, **with_cache(model, full), use_cache=True).logits, ids)
    full_bytes = cache_bytes(full)
    del full
    out = []
    if "full" in policies:
        out.append(PerplexityRecord("ppl", "blockwise", "full", None, n, seed, full_nll, n - 1,
                                    full_bytes, full_bytes))
        on_run and on_run(out[-1])
    for name, budget, policy in policy_runs(policies, budgets, schedule):
        with patch(model, policy, tokenizer=tokenizer, kv_dtype=kv_dtype) as handle:
            cache = handle.new_cache()
            nll = _mean_nll(model(ids, **with_cache(model, cache), use_cache=True).logits, ids)
        out.append(PerplexityRecord("ppl", "blockwise", run_label(name, kv_dtype), budget, n, seed, nll, n - 1,
                                    cache_bytes(cache), full_bytes))
        on_run and on_run(out[-1])
    return out
