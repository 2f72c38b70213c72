"""Timing, bandwidth and result-file helpers shared by the benchmarks."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_op(fn, device: str, *, setup=None, repeats: int = 7, warmup: int = 2) -> float:
    """Median seconds of fn(); setup() (untimed) runs before every call and returns fn's argument."""
    times = []
    for i in range(warmup + repeats):
        arg = setup() if setup else None
        sync(device)
        t0 = time.perf_counter()
        fn(arg) if setup else fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int = 256 << 20) -> float:
    """The machine's copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = time_op(lambda: dst.copy_(src), device)
    return 2 * nbytes / seconds / 1e9


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def git_commit() -> str:
    """HEAD's short hash, or $KVCACHE_EXT_COMMIT where the tree travelled without .git (gpu_check.sh)."""
    if os.environ.get("KVCACHE_EXT_COMMIT"):
        return os.environ["KVCACHE_EXT_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(name: str, device: str, rows: list[dict], extra: dict | None = None) -> str:
    """Writes bench/results/<name>-<cpu|gpu name>-<date>.json and returns its path."""
    os.makedirs(RESULTS, exist_ok=True)
    today = datetime.date.today().isoformat()
    tag = "cpu" if device == "cpu" else device_name(device).replace(" ", "-")
    path = os.path.join(RESULTS, f"{name}-{tag}-{today}.json")
    doc = {"benchmark": name, "device": device_name(device), "date": today, "commit": git_commit(),
           "torch": torch.__version__, **(extra or {}), "rows": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    return path
