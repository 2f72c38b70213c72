"""Store and selection kernels against torch baselines doing the same job, with the copy bandwidth
of the same run.

    python bench/kernels.py [--device cpu|cuda] [--quick]

Each line prints our wall time and kernel time, the achieved GB/s (bytes read + written, by
kernel time), that as a fraction of the machine's copy bandwidth measured in this run, and the
speed-up over a torch baseline doing the same job, wall time against wall time. Kernel time
(``common.kernel_time``) is on CUDA the sum of the device work's own durations (the profiler),
without launch gaps or host work; on CPU there is no device apart from the host, and kernel time
is the wall time. Results go to bench/results/kernels-<device>-<date>.json.

The baselines (like for like):
- top-k: from the store's slot-layout scores, pad them to [segments, longest] (``to_padded``),
  ``torch.topk``, and scatter the chosen slots into a [capacity] keep mask, all timed, as our
  op returns that mask; grouped (Ada-KV) top-k takes ``torch.topk`` over each batch item's heads
  flattened to [batch, heads * longest];
- compaction: ``index_select`` of every part the store holds per token (K, V, position, score
  channel) by the kept slots into new tensors; we count the bytes of the rows that move. The
  baseline is handed the kept slots' indices (computed outside its timing); ours runs twice:
  ``compact(keep)``, which reads the new lengths back (a host sync on CUDA), and
  ``compact(keep, lens=...)`` with the lengths likewise computed outside its timing, as the
  engine's per-step eviction has them (a top-k of k per head keeps min(len, k)): no sync;
- per-step eviction's compaction (``evict_one``: one token out of every segment, the lengths
  given): ours unordered (``compact(stable=False)``, what H2O and StreamingLLM run) against the
  same ``index_select`` baseline and ours stable;
- append: ``torch.cat`` of the dense K and V with the new token.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (first: it puts a built checkout ahead of an installed copy)
import kvcache_ext  # noqa: E402
from common import (build_description, copy_bandwidth, device_name, kernel_time, time_op,  # noqa: E402
                    write_results)  # noqa: E402

D = 128
DTYPE = torch.float16


def filled_store(batch: int, heads: int, length: int, device: str, dtype=DTYPE) -> kvcache_ext.RaggedKVStore:
    store = kvcache_ext.RaggedKVStore(batch, heads, D, dtype=dtype, device=device)
    store.reserve(length)
    kv = torch.randn(batch, heads, length, D, dtype=dtype, device=device)
    store.append(kv, kv, torch.arange(length, device=device))
    return store


def timings(ours, baseline, device: str, *, setup=None, repeats: int = 7) -> dict:
    """Wall and kernel time of ours (with ``setup`` before every call) and of the baseline."""
    wall = time_op(ours, device, setup=setup, repeats=repeats)
    kern = kernel_time(ours, device, setup=setup, repeats=repeats)
    base_wall = time_op(baseline, device, repeats=repeats)
    base_kern = kernel_time(baseline, device, repeats=repeats)
    return {"seconds": wall, "kernel_seconds": kern, "torch_seconds": base_wall,
            "torch_kernel_seconds": base_kern, "speedup_vs_torch": base_wall / wall,
            "kernel_speedup_vs_torch": base_kern / kern if kern > 0 else None}


def compaction_mask(store, keep_fraction: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=store.device).manual_seed(seed)
    return torch.rand(store.capacity, generator=gen, device=store.device) < keep_fraction


def moved_rows(keep: torch.Tensor, segments: int, length: int) -> int:
    """Kept rows after the first evicted slot of their segment: the rows compaction moves."""
    seg = keep.view(segments, length).cpu()
    return int(torch.logical_and(seg, seg.cumprod(1).logical_not()).sum())


def bench_compact(segments: int, length: int, keep_fraction: float, device: str):
    """In-place compaction vs gathering every part of the kept slots into new tensors."""
    ref_store = filled_store(1, segments, length, device)
    keep = compaction_mask(ref_store, keep_fraction)
    idx = keep.nonzero().squeeze(1)
    # K + V rows, pos, one score channel: read and written once per moved row.
    row_bytes = 2 * D * DTYPE.itemsize + 4 + 4
    moved_bytes = 2 * moved_rows(keep, segments, length) * row_bytes
    parts = (ref_store.k, ref_store.v, ref_store.pos, ref_store.scores)
    t = timings(lambda store: store.compact(keep), lambda: [p.index_select(0, idx) for p in parts],
                device, setup=lambda: filled_store(1, segments, length, device), repeats=5)
    lens = keep.view(1, segments, length).sum(-1).cpu()      # what a top-k of k per head knows
    given = time_op(lambda store: store.compact(keep, lens=lens), device,
                    setup=lambda: filled_store(1, segments, length, device), repeats=5)
    return {"op": "compact", "segments": segments, "length": length, "keep": keep_fraction,
            "kept": idx.numel(), "moved_MiB": moved_bytes / 2**20, **t,
            "lens_given_seconds": given, "lens_given_speedup_vs_torch": t["torch_seconds"] / given,
            "GBps": moved_bytes / t["kernel_seconds"] / 1e9,
            "baseline": "index_select of K, V, pos and the score channel by the kept slots"}


def bench_evict_one(segments: int, length: int, device: str):
    """Per-step eviction's compaction: one token out of every segment (a random place), the
    lengths given. Ours unordered (``stable=False``: the segment's last token fills the place)
    against ours stable (every later token moves) and ``index_select`` of the kept tokens of
    every part (a dense cache's way)."""
    ref_store = filled_store(1, segments, length, device)
    gen = torch.Generator().manual_seed(9)
    out_at = torch.randint(0, length, (segments,), generator=gen)
    keep = ref_store.from_padded((torch.arange(length) != out_at[:, None]).view(1, segments, length).to(device),
                                 False)
    idx = keep.nonzero().squeeze(1)
    parts = (ref_store.k, ref_store.v, ref_store.pos, ref_store.scores)
    lens = torch.full((1, segments), length - 1)

    def fresh():
        return filled_store(1, segments, length, device)
    t = timings(lambda store: store.compact(keep, lens=lens, stable=False),
                lambda: [p.index_select(0, idx) for p in parts], device, setup=fresh, repeats=5)
    stable = time_op(lambda store: store.compact(keep, lens=lens), device, setup=fresh, repeats=5)
    stable_kernel = kernel_time(lambda store: store.compact(keep, lens=lens), device, setup=fresh, repeats=5)
    return {"op": "evict_one", "segments": segments, "length": length, **t, "stable_seconds": stable,
            "stable_kernel_seconds": stable_kernel, "stable_over_unordered": stable / t["seconds"],
            "stable_kernel_over_unordered": stable_kernel / t["kernel_seconds"] if t["kernel_seconds"] else None,
            "baseline": "index_select of K, V, pos and the score channel by the kept slots"}


def bench_append(segments: int, length: int, n: int, device: str):
    """Appending n tokens per segment vs torch.cat of the dense cache (what a dense cache does)."""
    store = filled_store(1, segments, length, device)
    new = torch.randn(1, segments, n, D, dtype=DTYPE, device=device)
    pos = torch.arange(length, length + n, device=device)
    store.append(new, new, pos)  # the slots appended to below are allocated and touched once
    back_to_length = store.from_padded(
        (torch.arange(length + n, device=device) < length).expand(1, segments, -1), False)
    dense = torch.randn(1, segments, length, D, dtype=DTYPE, device=device)
    t = timings(lambda _: store.append(new, new, pos),
                lambda: (torch.cat([dense, new], 2), torch.cat([dense, new], 2)), device,
                setup=lambda: store.compact(back_to_length), repeats=10)
    written = 2 * segments * n * D * DTYPE.itemsize * 2  # K and V, read + written
    return {"op": "append", "segments": segments, "length": length, "n": n, **t,
            "GBps": written / t["kernel_seconds"] / 1e9,
            "baseline": "torch.cat of K and V [1, H, L, D]"}


def topk_baseline(store, scores: torch.Tensor, k: int, grouped: bool):
    """torch.topk doing our op's job: pad the slot-layout scores, take the top k of each segment
    (grouped: of each batch item's heads together), scatter them into a [capacity] keep mask."""
    B, H = store.batch, store.heads
    index, mask = store.slot_index()                       # [B, H, L]: computed once, as ours has it
    target = index.masked_fill(~mask, store.capacity)      # padding lands on a spare slot

    def run():
        padded = scores[index].masked_fill(~mask, float("-inf"))          # [B, H, L]
        rows = padded.view(B, -1) if grouped else padded.view(B * H, -1)
        chosen = torch.topk(rows, k * H if grouped else k, dim=1).indices
        slots = target.view(rows.shape).gather(1, chosen)
        keep = torch.zeros(store.capacity + 1, dtype=torch.bool, device=scores.device)
        return keep.scatter_(0, slots.reshape(-1), True)[:store.capacity]
    return run


def bench_topk(batch: int, heads: int, length: int, k: int, device: str, grouped: bool = False):
    """Segmented (or grouped) top-k on the store layout vs the torch.topk baseline above."""
    store = filled_store(batch, heads, length, device)
    gen = torch.Generator(device=device).manual_seed(1)
    scores = torch.rand(store.capacity, generator=gen, device=device)
    budget = k * heads if grouped else k
    t = timings(lambda: store.select(budget, scores, grouped=grouped),
                topk_baseline(store, scores, k, grouped), device)
    read = store.capacity * (4 + 4)  # scores and positions
    return {"op": "grouped_topk" if grouped else "segmented_topk", "batch": batch, "heads": heads,
            "segments": batch * heads, "length": length, "k": k, **t,
            "GBps": read / t["kernel_seconds"] / 1e9,
            "baseline": "pad + torch.topk + scatter into the keep mask"}


TOPK_CASES = (  # (batch, KV heads, length, k per head): the goals' sizes, and batch 1 with 2 KV heads
    (4, 8, 4096, 512), (4, 8, 32768, 4096), (1, 2, 32768, 4096))


def run_all(device: str, quick: bool = False) -> tuple[list[dict], float]:
    gpu = device.startswith("cuda")
    scale = 1 if not quick else 1 / 64
    copy_gbps = copy_bandwidth(device, int((1 << 30 if gpu else 256 << 20) * scale))
    # Compaction moves >= 64 MiB on CPU and >= 256 MiB on GPU (the goals' sizes).
    L = max(64, int((32768 if gpu else 8192) * scale))
    rows = []
    for keep in (0.5, 0.125):
        rows.append(bench_compact(32, L, keep, device))
    rows.append(bench_evict_one(32, max(64, int(4096 * scale)), device))
    for n in (1, 512 if not quick else 8):
        rows.append(bench_append(32, L // 2, n, device))
    for batch, heads, length, k in TOPK_CASES:
        length, k = max(64, int(length * scale)), max(8, int(k * scale))
        for grouped in (False, True):
            rows.append(bench_topk(batch, heads, length, k, device, grouped))
    for row in rows:
        if "GBps" in row:   # evict_one moves a token per segment: no bandwidth to speak of
            row["fraction_of_copy"] = row["GBps"] / copy_gbps
    return rows, copy_gbps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    args = parser.parse_args(argv)
    rows, copy_gbps = run_all(args.device, args.quick)
    print(f"kvcache_ext: {build_description()}")
    print(f"device: {device_name(args.device)}; copy bandwidth {copy_gbps:.1f} GB/s (read + write)"
          + ("" if args.device.startswith("cuda") else "; on CPU kernel time is the wall time"))
    for row in rows:
        size = {k: row[k] for k in ("batch", "heads", "segments", "length", "keep", "n", "k") if k in row}
        bandwidth = (f"{row['GBps']:7.2f} GB/s = {row['fraction_of_copy']:6.1%} of copy" if "GBps" in row else
                     f"stable compaction {row['stable_over_unordered']:.1f}x as long")
        print(f"{row['op']:>15} {size}: {row['seconds'] * 1e3:9.3f} ms wall, {row['kernel_seconds'] * 1e3:9.3f} "
              f"ms kernel  {bandwidth}  |  "
              f"{row['speedup_vs_torch']:6.2f}x vs torch ({row['baseline']})"
              + (f"; lengths given {row['lens_given_seconds'] * 1e3:.3f} ms wall, "
                 f"{row['lens_given_speedup_vs_torch']:.2f}x" if "lens_given_seconds" in row else ""))
    if not args.quick:
        path = write_results("kernels", args.device, rows, {"copy_GBps": copy_gbps,
                                                            "build": build_description()})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
