"""``kvcache-ext check``: every kernel on one device against the plain-PyTorch reference, and a
patched tiny model against its reference path (``kvcache_ext.evaluation.device_check``); a table,
and exit status 1 naming each failing kernel."""
from __future__ import annotations

import sys
import time


def add_arguments(p) -> None:
    from kvcache_ext.cli.args import device
    p.add_argument("--device", type=device, default="cpu",
                   help="cpu, cuda or cuda:N (default cpu); what the device does not serve (int8 pages off "
                        "the CPU) is reported as not served, not failed")


def main(args) -> int:
    import torch

    from kvcache_ext import _C
    from kvcache_ext.evaluation import device_check, gpu_record

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    print(f"kvcache-ext check on {device} ({where}; torch {torch.__version__}, kvcache_ext built "
          f"{'with' if _C.build_info()['cuda'] else 'without'} CUDA kernels): every op and a patched tiny "
          "model against kvcache_ext.reference; error = max |got - want| / (1 + |want|) of the part nearest its "
          "tolerance", flush=True)
    print("\n".join(device_check.HEADER), flush=True)
    start = time.perf_counter()
    rows = device_check.run(device, on_row=lambda row: print(device_check.table_line(row), flush=True))
    counts = {status: sum(row.status == status for row in rows) for status in ("pass", "FAIL", "not served")}
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s: {counts['pass']} passed, "
          f"{counts['FAIL']} failed, {counts['not served']} not served on {device}")
    print("\n".join(gpu_record.describe()))
    failed = device_check.failures(rows)
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return 1
    return 0
