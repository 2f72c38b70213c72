"""Small CUDA driver for the Nsight profiles of the attention and compaction kernels.

    python bench/nsight/drive.py [--gib 1] [--batch 4] [--lengths uniform|skewed]
                                 [--warmup 3] [--iters 3] [--no-stats] [--no-compact]

Builds a bf16 store of about --gib GiB of live K+V (8 KV heads, head_dim 128), runs the
decode attention (G = 4 query heads per KV head, n = 1) --warmup times unprofiled, then
between cudaProfilerStart/Stop (what ``ncu --profile-from-start off`` and
``nsys --capture-range=cudaProfilerApi`` wait for): --iters decode calls without statistics,
one with stats=True, one on the tensor-core decode (KVCACHE_EXT_TC_DECODE=1 for that call), the segmented and grouped top-k of a quarter of each segment's tokens
(--no-select skips them), and one in-place compaction keeping half of the slots at random. Each
step sits in an NVTX range. bench/nsight/profile.sh runs it under ncu or nsys.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
import kvcache_ext  # noqa: E402
from attention import (D, G, HKV, TC_DECODE_SWITCH, build_store, skewed_lengths,  # noqa: E402  (bench/attention.py)
                       uniform_lengths)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="live K+V in GiB (default 1)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lengths", choices=("uniform", "skewed"), default="uniform")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--no-stats", action="store_true", help="skip the stats=True call")
    parser.add_argument("--no-compact", action="store_true", help="skip the compaction")
    parser.add_argument("--no-select", action="store_true", help="skip the top-k")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        sys.exit("drive.py: torch sees no CUDA GPU; the Nsight profiles need one")
    if not kvcache_ext.build_info()["cuda"]:
        sys.exit("drive.py: kvcache_ext was built without CUDA kernels; rebuild it where nvcc is "
                 "available (pip install --no-build-isolation .)")
    device, dtype = "cuda", torch.bfloat16
    row_bytes = 2 * D * dtype.itemsize  # one token's K and V
    mean_len = max(64, int(args.gib * 2**30 / row_bytes / (args.batch * HKV)) // 64 * 64)
    if args.lengths == "uniform":
        lens = uniform_lengths(args.batch, HKV, mean_len)
    else:
        lens, _ = skewed_lengths(args.batch, HKV, mean_len)
    store, k, v = build_store(lens, dtype, device, seed=1)
    del k, v  # the dense copy is only needed by the SDPA baselines of bench/attention.py
    torch.cuda.empty_cache()
    live = store.num_tokens * row_bytes
    print(f"{torch.cuda.get_device_name()}: store B={args.batch} Hkv={HKV} D={D} bf16, {args.lengths} "
          f"lengths (mean {mean_len}, max {int(lens.max())}), {live / 2**30:.2f} GiB live K+V, "
          f"capacity {store.capacity} slots", flush=True)

    gen = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(args.batch, HKV * G, 1, D, dtype=dtype, device=device, generator=gen)
    keep = torch.rand(store.capacity, device=device, generator=gen) < 0.5
    scores = torch.rand(store.capacity, device=device, generator=gen)
    budget = max(1, int(lens.float().mean()) // 4)

    def tensor_core_decode():
        saved = os.environ.get(TC_DECODE_SWITCH)
        os.environ[TC_DECODE_SWITCH] = "1"
        try:
            kvcache_ext.ragged_attention(q, store)
        finally:
            if saved is None:
                os.environ.pop(TC_DECODE_SWITCH)
            else:
                os.environ[TC_DECODE_SWITCH] = saved

    for _ in range(args.warmup):
        kvcache_ext.ragged_attention(q, store)
        tensor_core_decode()
        if not args.no_stats:
            kvcache_ext.ragged_attention(q, store, stats=True)
    torch.cuda.synchronize()

    nvtx = torch.cuda.nvtx
    torch.cuda.profiler.start()
    for i in range(args.iters):
        nvtx.range_push(f"decode attention {i}")
        kvcache_ext.ragged_attention(q, store)
        nvtx.range_pop()
    nvtx.range_push("decode attention, tensor cores")
    tensor_core_decode()
    nvtx.range_pop()
    if not args.no_stats:
        nvtx.range_push("decode attention, stats=True")
        kvcache_ext.ragged_attention(q, store, stats=True)
        nvtx.range_pop()
    if not args.no_select:
        nvtx.range_push("segmented top-k, a quarter")
        store.select(budget, scores)
        nvtx.range_pop()
        nvtx.range_push("grouped top-k, a quarter")
        store.select(budget * HKV, scores, grouped=True)
        nvtx.range_pop()
    if not args.no_compact:
        nvtx.range_push("compact, keep 1/2")
        store.compact(keep)
        nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled: {args.iters} decode call(s), 1 on tensor cores" + ("" if args.no_stats else ", 1 with stats")
          + ("" if args.no_select else ", 2 top-k (segmented, grouped)")
          + ("" if args.no_compact else f", 1 compaction ({store.num_tokens} tokens kept)"), flush=True)


if __name__ == "__main__":
    main()
