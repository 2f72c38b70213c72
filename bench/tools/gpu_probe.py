"""Which errors raised in C++ reach Python on this machine, and which kill the process.

An extension linked against a private static libstdc++ can crash where a C++ exception should
reach Python as an error (docs/gpu.md, "Building the CUDA kernels"): bad inputs handed to the
CUDA attention op (head_dim 8, a q of the wrong batch, a q of the wrong dtype) must raise their
ValueError or TypeError from csrc/, as the same checks do on the CPU. Each case below raises one
error in its own process, so that one crash does not hide the others:

    python bench/tools/gpu_probe.py                 # every case; a table and a JSON line
    python bench/tools/gpu_probe.py --case NAME     # one case in this process (what the table runs)
    python bench/tools/gpu_probe.py --gdb           # also a native backtrace of each crash (cuda-gdb)

Exit status: 0 when every case raised the error it should, 1 otherwise. Without a GPU (or
a CUDA build) the CUDA cases are skipped and said so.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/
import common  # noqa: E402,F401  (a checkout's built extension ahead of an installed copy)

import kvcache_ext  # noqa: E402
from kvcache_ext.kernels.ops import ops  # noqa: E402


def _store(device: str, batch: int = 1, head_dim: int = 64, dtype=torch.float16):
    """A store of 2 KV heads holding 8 tokens per segment."""
    store = kvcache_ext.RaggedKVStore(batch, 2, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, 2, 8, head_dim).to(dtype).to(device)
    store.append(k, k.clone(), torch.arange(8))
    return store


def _attention_op(store, q):
    """The attention_run op itself, past ragged_attention's Python checks."""
    plan = store.attention_plan(q.shape[1] // store.heads * q.shape[2])
    pool, table, lens = store._current()
    return ops.attention_run(q, pool, table, lens, plan, None, 0.125, store.heads, store._page_size,
                             store._head_dim, store._channels, store._dtype, False, False, False, False)


def torch_cuda_error():
    """torch's own error from a CUDA op: do C++ exceptions reach Python at all here?"""
    torch.zeros(2, 3, device="cuda") @ torch.zeros(4, 5, device="cuda")


def cpu_op_dtype():
    _attention_op(_store("cpu"), torch.randn(1, 2, 1, 64))


def cpu_op_batch():
    _attention_op(_store("cpu", batch=2), torch.randn(1, 4, 2, 64, dtype=torch.float16))


def cuda_op_dtype():
    """The crash of 2026-11-26: ops.cpp's check_query, the op dispatched to its CUDA kernel."""
    _attention_op(_store("cuda"), torch.randn(1, 2, 1, 64, device="cuda"))


def cuda_op_batch():
    """The crash of 2026-11-26 (runs 2 and 3 both stopped on this line of test_bad_input, right
    after the dtype case raised its TypeError): q of batch 1 for a store of batch 2."""
    _attention_op(_store("cuda", batch=2), torch.randn(1, 4, 2, 64, dtype=torch.float16, device="cuda"))


def cuda_op_dtype_then_batch():
    """The two in one process, as test_bad_input ran them: is it the second error that kills?"""
    try:
        cuda_op_dtype()
    except TypeError:
        pass
    cuda_op_batch()


def cuda_op_shape():
    """Another check of ops.cpp under the CUDA key: a keep mask of the wrong length."""
    store = _store("cuda")
    ops.store_compact(*store._current(), torch.ones(3, dtype=torch.bool, device="cuda"), store._page_size,
                      store._head_dim, store._channels, store._dtype)


def cuda_kernel_head_dim():
    """A check inside attention_cuda.cu (nvcc-compiled host code): head_dim 8 has no kernel."""
    store = _store("cuda", head_dim=8)
    _attention_op(store, torch.randn(1, 2, 1, 8, dtype=torch.float16, device="cuda"))


def cuda_pybind_dtype():
    """A dtype check reached through pybind11 (the host page allocator's prepare_append, which
    RaggedKVStore.append calls first), not the dispatcher."""
    store = _store("cuda")
    k = torch.randn(1, 2, 1, 64, device="cuda")   # float32 for a float16 store
    store.append(k, k, torch.tensor([8]))


# name -> (function, the exception it must raise)
CASES = {
    "torch_cuda_error": (torch_cuda_error, RuntimeError),
    "cpu_op_dtype": (cpu_op_dtype, TypeError),
    "cpu_op_batch": (cpu_op_batch, ValueError),
    "cuda_op_dtype": (cuda_op_dtype, TypeError),
    "cuda_op_batch": (cuda_op_batch, ValueError),
    "cuda_op_dtype_then_batch": (cuda_op_dtype_then_batch, ValueError),
    "cuda_op_shape": (cuda_op_shape, ValueError),
    "cuda_kernel_head_dim": (cuda_kernel_head_dim, ValueError),
    "cuda_pybind_dtype": (cuda_pybind_dtype, TypeError),
}


def run_one(name: str) -> int:
    func, expected = CASES[name]
    try:
        func()
        if torch.cuda.is_available():
            torch.cuda.synchronize()   # an error of a kernel launched asynchronously shows here
    except expected as e:
        print(f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return 0
    except Exception as e:  # noqa: BLE001  (the wrong type is a finding too)
        print(f"raised {type(e).__name__}, expected {expected.__name__}: {str(e).splitlines()[0][:200]}")
        return 3
    print(f"no error, expected {expected.__name__}")
    return 4


def run_bounded(cmd: list[str], seconds: int, env: dict | None = None) -> tuple[int | None, list[str]]:
    """Runs cmd; its exit code (None past ``seconds``: a device call has minutes, not hours) and lines."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds, env=env)
    except subprocess.TimeoutExpired:
        return None, [f"timed out after {seconds} s"]
    return done.returncode, (done.stdout + done.stderr).strip().splitlines()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), help="run one case in this process")
    parser.add_argument("--gdb", action="store_true", help="rerun each crash under cuda-gdb for a backtrace")
    args = parser.parse_args()
    if args.case:
        return run_one(args.case)
    results = {}
    for name in CASES:
        if "cuda" in name and not (torch.cuda.is_available() and kvcache_ext.build_info()["cuda"]):
            results[name] = {"rc": None, "verdict": "skipped (no CUDA here)", "output": []}
            print(f"{name:24s} skipped (no CUDA here)", flush=True)
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--case", name]
        rc, said = run_bounded(cmd, 90)
        verdict = {0: "raised", 3: "wrong error", 4: "no error", None: "timeout"}.get(rc, f"crashed (exit {rc})")
        results[name] = {"rc": rc, "verdict": verdict, "output": said[-3:]}
        print(f"{name:24s} {verdict:20s} {said[-1] if said else ''}", flush=True)
        if rc not in (0, 3, 4, None):  # is it torch's C++ stack-trace capture? again without it
            quiet_rc, _ = run_bounded(cmd, 90, env={**os.environ, "TORCH_SHOW_CPP_STACKTRACES": "0"})
            results[name]["rc_without_cpp_stacktraces"] = quiet_rc
            print(f"    again with TORCH_SHOW_CPP_STACKTRACES=0: exit {quiet_rc}", flush=True)
        gdb = shutil.which("cuda-gdb")
        if args.gdb and rc not in (0, 3, 4, None) and gdb:
            _, trace = run_bounded([gdb, "-batch", "-ex", "run", "-ex", "bt 40", "--args", *cmd], 150)
            frames = [line for line in trace if line.startswith("#")]
            results[name]["backtrace"] = frames
            print("\n".join("    " + f for f in frames), flush=True)
    env = {k: os.environ.get(k) for k in ("TORCH_SHOW_CPP_STACKTRACES", "TORCH_DISABLE_ADDR2LINE")}
    print("environment:", env, "torch", torch.__version__)
    print(json.dumps(results))
    return 0 if all(r["rc"] == 0 for r in results.values() if not r["verdict"].startswith("skipped")) else 1


if __name__ == "__main__":
    sys.exit(main())
