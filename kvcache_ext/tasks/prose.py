"""Plain prose from the shipped corpus, as token ids (for perplexity and fidelity)."""
from __future__ import annotations

import random

import torch

from kvcache_ext.tasks.passkey import _corpus_units, _join


def prose_ids(tokenizer, n_tokens: int, seed: int = 0) -> torch.Tensor:
    """1-D ids of ``n_tokens`` tokens of corpus prose, starting at a sentence the seed picks
    (the corpus is read cyclically). Starts with the tokenizer's BOS token when it uses one."""
    if n_tokens < 2:
        raise ValueError(f"n_tokens must be at least 2, got {n_tokens}")
    units = _corpus_units()
    start = random.Random(f"prose-{seed}").randrange(len(units))
    # About 4 characters per token: take sentences until the text surely has enough tokens.
    chosen, chars = [], 0
    while chars < 6 * n_tokens + 200:
        chosen.append(units[(start + len(chosen)) % len(units)])
        chars += len(chosen[-1][0]) + 1
    ids = tokenizer(_join(chosen), add_special_tokens=True)["input_ids"]
    if len(ids) < n_tokens:
        raise RuntimeError("the corpus gave too few tokens")   # 6 chars per token is generous
    return torch.tensor(ids[:n_tokens], dtype=torch.long)
