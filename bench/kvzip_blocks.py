"""KVzip's score blocks: how large a block of queries' logits should be (kvcache_ext.engine.reconstruction).

A pass scores the context's keys one block of queries at a time: a product writes the block's
log probabilities, a max over its queries reads them back. This times one layer call of
``score_pass`` on SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, batch 1) at
several block sizes, interleaved, and prints the median of each, side by side:

    python bench/kvzip_blocks.py [--repeats 6]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import common  # noqa: F401  (the checkout's kvcache_ext first on sys.path)
import kvcache_ext.engine.reconstruction as reconstruction
from kvcache_ext.policies import KVzip

SIZES_MIB = (1, 2, 4, 8)
SHAPES = ((1040, 1020), (2060, 2040), (2060, 4080))   # (pass queries, scored keys)


def time_shape(queries: int, keys: int, repeats: int) -> dict:
    B, Hq, H, D = 1, 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, queries, D, generator=gen)
    k, v = (torch.randn(B, H, keys, D, generator=gen) for _ in range(2))
    ctx = reconstruction.Context(k=k, v=v, pos=torch.arange(keys)[None], valid=torch.ones(B, keys, dtype=torch.bool),
                                 scale=D ** -0.5, scores=torch.zeros(B, H, keys), window=(0, keys))
    scorer, lse = KVzip(), torch.randn(B, Hq, queries, generator=gen)
    scored, _ = reconstruction.scored_keys(ctx, scorer)
    chosen = reconstruction.BLOCK_BYTES
    seconds = {mib: [] for mib in SIZES_MIB}
    try:
        for _ in range(repeats):
            for mib in SIZES_MIB:
                reconstruction.BLOCK_BYTES = mib << 20
                start = time.perf_counter()
                reconstruction.score_pass(ctx, scorer, q, lse, scored, None)
                seconds[mib].append(time.perf_counter() - start)
    finally:
        reconstruction.BLOCK_BYTES = chosen
    return {mib: statistics.median(s) for mib, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; the library's blocks: "
          f"{reconstruction.BLOCK_BYTES >> 20} MiB")
    print("| pass queries | scored keys | " + " | ".join(f"{m} MiB ms" for m in SIZES_MIB) + " | 8 MiB / 2 MiB |")
    print("|---|---|" + "---|" * (len(SIZES_MIB) + 1))
    for queries, keys in SHAPES:
        ms = {m: s * 1e3 for m, s in time_shape(queries, keys, args.repeats).items()}
        print(f"| {queries} | {keys} | " + " | ".join(f"{ms[m]:.1f}" for m in SIZES_MIB)
              + f" | {ms[8] / ms[2]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
