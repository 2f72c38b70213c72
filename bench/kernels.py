"""Store and selection kernels against torch baselines, with the copy bandwidth of the same run.

    python bench/kernels.py [--device cpu|cuda] [--quick]

Each line prints the kernel's achieved GB/s (bytes read + written), that as a fraction of the
machine's copy bandwidth measured in this run, and the speed-up over a torch baseline doing
the same work. Results go to bench/results/kernels-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (first: it puts a built checkout ahead of an installed copy)
import kvcache_ext  # noqa: E402
from common import build_description, copy_bandwidth, device_name, time_op, write_results  # noqa: E402

D = 128
DTYPE = torch.float16


def filled_store(segments: int, length: int, device: str) -> kvcache_ext.RaggedKVStore:
    store = kvcache_ext.RaggedKVStore(1, segments, D, dtype=DTYPE, device=device)
    store.reserve(length)
    kv = torch.randn(1, segments, length, D, dtype=DTYPE, device=device)
    store.append(kv, kv, torch.arange(length, device=device))
    return store


def bench_compact(segments: int, length: int, keep_fraction: float, device: str):
    """Stable in-place compaction vs gather into new tensors (torch index_select)."""
    ref_store = filled_store(segments, length, device)
    gen = torch.Generator(device=device).manual_seed(0)
    keep = torch.rand(ref_store.capacity, generator=gen, device=device) < keep_fraction
    idx = keep.nonzero().squeeze(1)
    kept = idx.numel()
    # Every kept row after the first evicted slot of its segment moves: count those bytes.
    row_bytes = 2 * D * DTYPE.itemsize + 4 + 4  # K + V rows, pos, one score channel
    moved_rows = int(sum(int(seg.cumprod(0).logical_not()[seg].sum()) for seg in
                         keep.view(segments, length).cpu()))
    moved_bytes = 2 * moved_rows * row_bytes

    def rebuild():
        store = filled_store(segments, length, device)
        return store
    t_ours = time_op(lambda store: store.compact(keep), device, setup=rebuild, repeats=5)
    flat = (ref_store.k, ref_store.v, ref_store.pos, ref_store.scores)
    t_torch = time_op(lambda: [t.index_select(0, idx) for t in flat], device)
    return {"op": "compact", "segments": segments, "length": length, "keep": keep_fraction,
            "kept": kept, "moved_MiB": moved_bytes / 2**20, "seconds": t_ours,
            "GBps": moved_bytes / t_ours / 1e9, "torch_seconds": t_torch,
            "speedup_vs_torch": t_torch / t_ours,
            "baseline": "index_select of K, V, pos, scores into new tensors"}


def bench_append(segments: int, length: int, n: int, device: str):
    """Appending n tokens per segment vs torch.cat of the padded cache (what a dense cache does)."""
    store = filled_store(segments, length, device)
    new = torch.randn(1, segments, n, D, dtype=DTYPE, device=device)
    pos = torch.arange(length, length + n, device=device)
    store.append(new, new, pos)  # the slots appended to below are allocated and touched once
    back_to_length = store.from_padded(
        (torch.arange(length + n, device=device) < length).expand(1, segments, -1), False)
    dense = torch.randn(1, segments, length, D, dtype=DTYPE, device=device)
    t_ours = time_op(lambda _: store.append(new, new, pos), device,
                     setup=lambda: store.compact(back_to_length), repeats=10)
    t_torch = time_op(lambda: (torch.cat([dense, new], 2), torch.cat([dense, new], 2)), device)
    written = 2 * segments * n * D * DTYPE.itemsize * 2  # K and V, read + written
    return {"op": "append", "segments": segments, "length": length, "n": n, "seconds": t_ours,
            "GBps": written / t_ours / 1e9, "torch_seconds": t_torch,
            "speedup_vs_torch": t_torch / t_ours, "baseline": "torch.cat of K and V [1, H, L, D]"}


def bench_topk(segments: int, length: int, k: int, device: str):
    """Segmented top-k on the store layout vs torch.topk on the padded [segments, length] scores."""
    store = filled_store(segments, length, device)
    scores = torch.rand(store.capacity, device=device)
    padded = store.to_padded(scores, float("-inf")).view(segments, -1)
    t_ours = time_op(lambda: store.select(k, scores), device)
    t_torch = time_op(lambda: torch.topk(padded, k, dim=1), device)
    read = store.capacity * (4 + 4)  # scores and positions
    return {"op": "segmented_topk", "segments": segments, "length": length, "k": k,
            "seconds": t_ours, "GBps": read / t_ours / 1e9, "torch_seconds": t_torch,
            "speedup_vs_torch": t_torch / t_ours, "baseline": "torch.topk on the padded scores"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    args = parser.parse_args(argv)
    device = args.device
    gpu = device.startswith("cuda")
    scale = 1 if not args.quick else 1 / 16
    copy_gbps = copy_bandwidth(device, int((1 << 30 if gpu else 256 << 20) * scale))
    print(f"kvcache_ext: {build_description()}")
    print(f"device: {device_name(device)}; copy bandwidth {copy_gbps:.1f} GB/s (read + write)")
    # Compaction moves >= 64 MiB on CPU and >= 256 MiB on GPU (the targets).
    L = int((32768 if gpu else 8192) * scale)
    rows = []
    for keep in (0.5, 0.125):
        rows.append(bench_compact(32, L, keep, device))
    for n in (1, 512):
        rows.append(bench_append(32, L // 2, n, device))
    for length in (4096, 32768):
        length = max(64, int(length * scale))
        rows.append(bench_topk(32, length, length // 8, device))
    for row in rows:
        row["fraction_of_copy"] = row["GBps"] / copy_gbps
        size = {k: row[k] for k in ("segments", "length", "keep", "n", "k") if k in row}
        print(f"{row['op']:>15} {size}: {row['seconds'] * 1e3:9.3f} ms  {row['GBps']:7.2f} GB/s "
              f"= {row['fraction_of_copy']:6.1%} of copy  |  {row['speedup_vs_torch']:6.2f}x vs torch "
              f"({row['baseline']})")
    if not args.quick:
        path = write_results("kernels", device, rows, {"copy_GBps": copy_gbps,
                                                       "build": build_description()})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
