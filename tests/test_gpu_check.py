"""bench/gpu_check.sh on a machine without a GPU: --dry-run walks every stage and prints what it
would run; bad arguments are refused with the accepted values."""
import json
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
STAGES = ["env", "build", "probe", "test", "sanitize", "bench", "ncu", "e2e"]


def run(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_dry_run_walks_every_stage():
    out = run("--dry-run", "--stages", ",".join(STAGES), "--e2e-args", "--contexts 8192 --batches 1")
    assert out.returncode == 0, out.stderr
    for stage in STAGES:
        assert f"[{stage}] would run:" in out.stdout, stage
    assert "--contexts 8192 --batches 1" in out.stdout
    assert "compute-sanitizer" in out.stdout and "bench/nsight/profile.sh" in out.stdout
    assert "dry run: would write" in out.stdout
    # The test stage runs the custom ops' opcheck and the patch-time head_dim checks on CUDA too.
    assert "tests/test_ops.py" in out.stdout and "tests/test_patch.py" in out.stdout
    # One pytest process per test file: a crash in one does not hide the others.
    assert "for f in tests/test_build.py" in out.stdout and "bench/gpu_probe.py --gdb" in out.stdout


def test_default_stages_leave_out_e2e():
    out = run("--dry-run")
    assert out.returncode == 0
    assert "[e2e]" not in out.stdout and "[ncu] would run" in out.stdout


def test_bad_arguments_are_refused():
    out = run("--stages", "build,fly")
    assert out.returncode == 2 and "unknown stage 'fly'" in out.stderr and "env build" in out.stderr
    out = run("--frobnicate")
    assert out.returncode == 2 and "unknown option" in out.stderr
    out = run("--deadline")
    assert out.returncode == 2 and "--deadline needs seconds" in out.stderr
    out = run("--deadline", "5m")
    assert out.returncode == 2 and "whole seconds" in out.stderr and "'5m'" in out.stderr


def test_probe_runs_each_case_in_its_own_process():
    """bench/gpu_probe.py: here the CPU op's bad input raises; the CUDA cases are skipped
    without a GPU and run (each in a subprocess, a crash recorded as such) with one."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_probe.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["cpu_op_dtype"]["verdict"] == results["cpu_op_batch"]["verdict"] == "raised"
    assert "must have dtype Half, got Float" in results["cpu_op_dtype"]["output"][-1]
    assert "q has batch 1 but the store has batch 2" in results["cpu_op_batch"]["output"][-1]
    cuda = torch.cuda.is_available()
    cuda_cases = [name for name in results if "cuda" in name]
    assert len(cuda_cases) == 7
    for name in cuda_cases:
        assert results[name]["verdict"] == ("raised" if cuda else "skipped (no CUDA here)"), name
    one = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_probe.py"), "--case", "nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert one.returncode == 2 and "invalid choice: 'nope'" in one.stderr
