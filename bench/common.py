"""Timing, bandwidth and result-file helpers shared by the benchmarks."""
from __future__ import annotations

import datetime
import glob
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")

# A script's own folder, not the working directory, heads sys.path: without this a benchmark
# run from a checkout would measure whatever kvcache_ext pip installed last. The checkout
# wins when it holds a built extension (build_ext --inplace, pip install -e .).
if glob.glob(os.path.join(ROOT, "kvcache_ext", "_C*")) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)


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


def kernel_time(fn, device: str, *, setup=None, repeats: int = 7, warmup: int = 2) -> float:
    """Seconds of device work per fn() call: on CUDA the sum of the kernels' and copies' own
    durations (torch.profiler, CUPTI), the median over ``repeats`` calls, each profiled alone
    (``setup()``, untimed, runs before each, outside the profile), without the launch gaps and
    host work that the wall time of ``time_op`` includes. On CPU there is no device apart from
    the host: the wall time (``time_op``'s median) is returned."""
    if not device.startswith("cuda"):
        return time_op(fn, device, setup=setup, repeats=repeats, warmup=warmup)
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn(setup()) if setup else fn()
    times = []
    for _ in range(repeats):
        arg = setup() if setup else None
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(arg) if setup else fn()
            sync(device)
        # The device's own events only (kernels, copies, memsets): a CPU-side event (an op, a
        # runtime call) also reports the time of the kernels under it, which would count twice.
        times.append(sum(e.device_time_total for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA) * 1e-6)
    return statistics.median(times)


def time_interleaved(fns: dict, device: str, *, repeats: int = 7, warmup: int = 2) -> dict:
    """Median seconds of each fn in ``fns`` ({name: fn}), the calls taken in turns (a, b, c,
    a, b, c, ...) so that a slow stretch of the machine weighs on every ratio's both sides."""
    times = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth(device: str, nbytes: int = 256 << 20) -> float:
    """The machine's copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = time_op(lambda: dst.copy_(src), device)
    return 2 * nbytes / seconds / 1e9


def free_port() -> int:
    """A TCP port of this machine that nothing listens on now (for a server or a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the machine type where that is unavailable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} CPU"


def build_description() -> dict:
    """What the measured kvcache_ext is: its path, its build, the CPU vector ISA it uses."""
    import kvcache_ext
    return {"path": os.path.dirname(kvcache_ext.__file__), **kvcache_ext.build_info(),
            "cpu_isa": kvcache_ext._C.cpu_isa(), "cpu_cores": os.cpu_count()}


def commit_state() -> tuple[str | None, bool | None]:
    """(HEAD's short hash, whether the tree differs from it), or (None, None) outside a checkout.
    Where the tree travelled without .git (the GPU check), $KVCACHE_EXT_COMMIT names the commit,
    a ``+dirty`` suffix saying that the tree differed from it."""
    given = os.environ.get("KVCACHE_EXT_COMMIT")
    if given:
        return given.removesuffix("+dirty"), given.endswith("+dirty")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        # bench/results is left out: a benchmark's own JSON does not make the code it ran dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!bench/results"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip() != ""
        return commit or None, dirty if commit else None
    except (OSError, subprocess.CalledProcessError):
        return None, None


def git_commit() -> str:
    """HEAD's short hash (``+dirty`` when the tree differs from it), or "unknown" outside a checkout."""
    commit, dirty = commit_state()
    return "unknown" if commit is None else commit + ("+dirty" if dirty else "")


def run_metadata(device: str = "cpu") -> dict:
    """What every benchmark's JSON records of its run: the device (a GPU's name, or the CPU's
    model and threads), the date and time (ISO 8601, local), and the commit (HEAD's short hash,
    None outside a checkout) with ``dirty``, whether the tree differed from it."""
    commit, dirty = commit_state()
    return {"device": device_name(device), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": commit, "dirty": dirty}


def write_out(path: str, args, meta: dict | None = None, *, device: str | None = None, **payload) -> None:
    """Writes a bench's ``--out`` JSON: ``meta`` (the run's metadata, ``run_metadata``: device,
    date, commit; its arguments, torch, the build and ``meta``) and ``payload`` (records, rows),
    and says where. ``device`` defaults to ``args.device`` where the bench has one, else the CPU."""
    device = device or getattr(args, "device", None) or "cpu"
    head = {**run_metadata(device), "args": vars(args), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "build": build_description(), **(meta or {})}
    with open(path, "w") as f:
        json.dump({"meta": head, **payload}, f, indent=1)
    print(f"wrote {path}")


def write_results(name: str, device: str, rows: list[dict], extra: dict | None = None) -> str:
    """Writes bench/results/<name>-<cpu|gpu name>-<date>.json and returns its path."""
    os.makedirs(RESULTS, exist_ok=True)
    today = datetime.date.today().isoformat()
    tag = "cpu" if device == "cpu" else device_name(device).replace(" ", "-")
    path = os.path.join(RESULTS, f"{name}-{tag}-{today}.json")
    doc = {"benchmark": name, **run_metadata(device), "torch": torch.__version__, **(extra or {}),
           "rows": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    return path
