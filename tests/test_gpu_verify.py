"""bench/tools/gpu_verify.sh and bench/tools/gpu_verify.py on a machine without a GPU, so that the one GPU
command cannot rot unseen: --dry-run walks every stage with its time estimate; bad arguments are
refused with the accepted values; the Python half (the table with its baselines and checks, the
sanitizers' driver, the report) runs tiny on the CPU."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOLS = ROOT / "bench" / "tools"
SCRIPT = TOOLS / "gpu_verify.sh"
STAGES = ["env", "build", "check", "bench", "tc", "sanitize", "e2e", "test", "gtest", "probe", "ncu"]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(TOOLS))


def run(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_dry_run_walks_every_stage_with_its_estimate():
    out = run("--dry-run", "--stages", ",".join(STAGES), "--e2e-args", "--contexts 8192 --batches 1")
    assert out.returncode == 0, out.stderr
    for stage in STAGES:
        assert f"[{stage}] ~" in out.stdout and "would run:" in out.stdout, stage
    assert "--contexts 8192 --batches 1" in out.stdout
    assert "compute-sanitizer --tool memcheck|racecheck|synccheck" in out.stdout
    assert "bench/nsight/profile.sh" in out.stdout and "bench/tools/gpu_probe.py --gdb" in out.stdout
    assert "would run: " + os.environ.get("PYTHON", "python3") + " -m kvcache_ext check --device cuda" in out.stdout
    # One pytest process per test file, the CUDA safety and host-sync tests among them.
    assert "for f in tests/test_build.py" in out.stdout and "tests/test_cuda_metadata.py" in out.stdout
    assert "WARNING: the plan's estimate exceeds the budget" in out.stdout   # every stage: too long


def test_default_plan_fits_nine_minutes_with_the_build():
    """The default stages, built from scratch, within the 540 s budget (less the report's 15 s)."""
    out = run("--dry-run")
    assert out.returncode == 0, out.stderr
    stages = [line.split("]")[0][1:] for line in out.stdout.splitlines() if line.startswith("[")]
    assert stages == ["env", "build", "check", "bench", "tc", "sanitize", "e2e"]   # the check first after the build
    plan = next(line for line in out.stdout.splitlines() if line.startswith("plan: ~"))
    assert int(plan.split("~")[1].split()[0]) <= 525, plan
    assert "WARNING" not in out.stdout
    assert "--model llama8b --contexts 8192 --batches 1,4 --budgets 1024" in out.stdout
    assert "--methods full,snapkv,snapkv-graph,h2o-step,h2o-step-graph" in out.stdout


def test_bad_arguments_are_refused():
    out = run("--stages", "build,fly")
    assert out.returncode == 2 and "unknown stage 'fly'" in out.stderr and "env build" in out.stderr
    out = run("--frobnicate")
    assert out.returncode == 2 and "unknown option" in out.stderr
    out = run("--budget")
    assert out.returncode == 2 and "--budget needs seconds" in out.stderr
    out = run("--budget", "5m")
    assert out.returncode == 2 and "whole seconds" in out.stderr and "'5m'" in out.stderr


def test_the_script_runs_its_cpu_stages_and_prints_the_table(tmp_path):
    """The run path of the script itself (no --dry-run): the check stage (kvcache-ext check on the
    CPU), the bench stage (every kernel, baseline and check at tiny sizes), the tc stage's table (on the CPU the switch routes nothing: both
    sides are the CPU kernel) and a tiny e2e run, on the CPU, results in a temporary folder, the
    table printed last; then the report of a table with an e2e record and the stages' summary."""
    env = {**os.environ, "GPU_VERIFY_RESULTS": str(tmp_path), "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--quick", "--stages", "check,bench,tc,e2e",
                          "--e2e-args", "--model tiny --quick --contexts 256 --batches 1 --budgets 64 --steps 2 "
                          "--methods snapkv,h2o-step"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "stages: check passed" in out.stdout and "bench passed" in out.stdout and "tc passed" in out.stdout \
        and "e2e passed" in out.stdout, out.stdout
    assert "| store_decode_step (captured) | int8 | " in (tmp_path / "gpu-verify" / "check.log").read_text()
    table_json = next(tmp_path.glob("gpu-verify-cpu-*[0-9].json"))
    tc = json.loads(next(tmp_path.glob("gpu-verify-tc-cpu-*[0-9].json")).read_text())
    assert [(r["case"], r["n"]) for r in tc["attention"]] == [("prefill", 64), ("prefill", 256)] + [("decode", 1)] * 3
    assert all(c["ok"] for c in tc["checks"]), tc["checks"]
    assert [r["switch"] for r in tc["attention"]] == ["KVCACHE_EXT_TC_PREFILL"] * 2 + ["KVCACHE_EXT_TC_DECODE"] * 3
    assert tc["copy_GBps"] > 0
    for r in tc["attention"]:
        assert r["tc_seconds"] > 0 and r["tc_stats_seconds"] > 0 and r["tc_max_abs_diff_vs_switch_off"] == 0
        assert 0 < r["tc_fraction_of_copy"] and 0 < r["fraction_of_copy"]
    doc = json.loads(table_json.read_text())
    assert doc["kernel_time"] == "wall time (CPU)" and doc["commit"] and doc["device"] and doc["date"]
    assert isinstance(doc["dirty"], bool)   # bench/common.py's run_metadata
    ops = [r["op"] for r in doc["kernels"]]
    assert ops.count("compact") == 2 and ops.count("append") == 2 and ops.count("evict_one") == 1
    assert ops.count("segmented_topk") == ops.count("grouped_topk") == 3
    for r in doc["kernels"]:   # on CPU the kernel time is the wall time, measured apart
        assert r["kernel_seconds"] > 0 and r["torch_kernel_seconds"] > 0
    assert len(doc["attention"]) == 4
    assert [(r["case"], r["lengths"]) for r in doc["int8"]] == [("decode", "uniform"), ("decode", "skewed"),
                                                                 ("prefill", "uniform")]
    for r in doc["int8"]:   # int8 pages against float32 ones: a quarter of the bytes and more
        assert r["seconds"] > 0 and r["plain_seconds"] > 0 and 0.2 < r["bytes"] / r["plain_bytes"] < 0.4, r
    assert all(c["ok"] for c in doc["checks"]), doc["checks"]
    assert sum("attention on int8 pages" in c["check"] for c in doc["checks"]) == 3
    tail = out.stdout[out.stdout.rindex("| metric"):]
    assert "e2e h2o-step (per-step eviction) / snapkv (one-shot) decode tok/s (ctx 256 x 1)" in tail
    assert "tensor-core prefill B=1 Hkv=8 n=256 vs SDPA" in tail and "stage tc " in tail
    assert "attention decode skewed on int8 pages vs float32 pages" in tail
    assert "attention prefill n=64 uniform on int8 pages vs float32 pages" in tail
    for line in ("tensor-core decode uniform B=4 Hkv=8 vs switch off", "tensor-core decode uniform B=4 Hkv=8 of copy",
                 "tensor-core decode skewed B=4 Hkv=8 stats overhead",
                 "scalar decode skewed B=4 Hkv=8 vs SDPA (padded)", "tensor-core decode batch 1 B=1 Hkv=1 of copy"):
        assert line in tail, line
    assert "| stage check " in tail and tail.rstrip().splitlines()[-1].startswith("goals missed:")
    e2e = {"rows": [{"method": m, "context": 64, "batch": 1, "budget": 16, "status": "ok", "prefill_s": 0.5,
                     "decode_tokens_per_s": tps, "host_s_per_step": host, "synced_step_s": 0.1}
                    for m, tps, host in (("snapkv", 10.0, 0.03), ("h2o-step", 8.0, 0.05), ("full", 9.0, 0.02),
                                         ("snapkv-graph", 20.0, 0.01), ("h2o-step-graph", 19.0, 0.012))]}
    (tmp_path / "e2e.json").write_text(json.dumps(e2e))
    (tmp_path / "stages.json").write_text(json.dumps({"stages": {"sanitize": {"status": "passed"}}}))
    rep = subprocess.run([sys.executable, str(TOOLS / "gpu_verify.py"), "report", str(table_json),
                          "--e2e", str(tmp_path / "e2e.json"), "--stages", str(tmp_path / "stages.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    line = next(ln for ln in rep.stdout.splitlines() if "h2o-step (per-step eviction) / snapkv (one-shot)" in ln)
    assert "0.80x" in line and "NO" in line
    line = next(ln for ln in rep.stdout.splitlines()
                if "h2o-step-graph (per-step eviction) / snapkv-graph (one-shot)" in ln)
    assert "0.95x" in line and "yes" in line
    # Host time a patched model adds per step, over the full cache's, as a share of its step;
    # of a graphed step, all of its host time.
    host = {m: next(ln for ln in rep.stdout.splitlines() if f"e2e {m} host time per step" in ln)
            for m in ("snapkv", "h2o-step", "snapkv-graph", "h2o-step-graph")}
    assert "| 10% " in host["snapkv"] and "yes" in host["snapkv"], host
    assert "| 30% " in host["h2o-step"] and "NO" in host["h2o-step"], host
    assert "host / step" in host["snapkv-graph"] and "| 10% " in host["snapkv-graph"] and "yes" in host["snapkv-graph"]
    assert "| 12% " in host["h2o-step-graph"] and "NO" in host["h2o-step-graph"], host
    assert "e2e full host time" not in rep.stdout
    assert any("stage sanitize" in ln and "yes" in ln for ln in rep.stdout.splitlines())


def test_the_sanitizer_driver_runs_on_cpu():
    """The driver compares every op on the device with the CPU; here both sides are the CPU."""
    res = subprocess.run([sys.executable, str(TOOLS / "gpu_verify.py"), "sanitize-driver", "--device",
                          "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("store ops equal, attention close, grouped top-k equal") == 4
    assert "page 16 int8: store ops equal" in res.stdout


def test_the_exact_topk_reference_is_the_reference():
    """gpu_verify.py's vectorized top-k (for benchmark scale) against kvcache_ext.reference.select,
    with ties, on a small store."""
    import gpu_verify
    import kvcache_ext
    from kvcache_ext.reference.select import grouped_topk, segmented_topk
    store = kvcache_ext.RaggedKVStore(2, 3, 8, dtype=torch.float32, page_size=4)
    kv = torch.randn(2, 3, 20, 8)
    store.append(kv, kv, torch.arange(20))
    store.compact(torch.rand(store.capacity, generator=torch.Generator().manual_seed(0)) < 0.6)
    scores = torch.randint(0, 4, (store.capacity,)).float()
    index, mask = store.slot_index()
    padded, pos = store.to_padded(scores, float("-inf")), store.to_padded(store.pos)
    lens = store.lens.view(-1)
    for grouped in (False, True):
        got = gpu_verify.exact_topk_keep(store, scores, 3, grouped)
        if grouped:
            want, _ = grouped_topk(padded.view(6, -1), pos.view(6, -1), lens, 3, torch.tensor([9, 9]))
        else:
            want = segmented_topk(padded.view(6, -1), pos.view(6, -1), lens, 3)
        assert torch.equal(store.to_padded(got, False).view(6, -1), want & mask.view(6, -1)), grouped


def test_probe_runs_each_case_in_its_own_process():
    """bench/tools/gpu_probe.py: here the CPU op's bad input raises; the CUDA cases are skipped
    without a GPU and run (each in a subprocess, a crash recorded as such) with one."""
    import kvcache_ext
    out = subprocess.run([sys.executable, str(TOOLS / "gpu_probe.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["cpu_op_dtype"]["verdict"] == results["cpu_op_batch"]["verdict"] == "raised"
    assert "q must have the store's dtype Half, got Float" in results["cpu_op_dtype"]["output"][-1]
    assert "q has batch 1 but the store has batch 2" in results["cpu_op_batch"]["output"][-1]
    cuda = torch.cuda.is_available() and kvcache_ext.build_info()["cuda"]
    cuda_cases = [name for name in results if "cuda" in name]
    assert len(cuda_cases) == 7
    for name in cuda_cases:
        assert results[name]["verdict"] == ("raised" if cuda else "skipped (no CUDA here)"), name
    one = subprocess.run([sys.executable, str(TOOLS / "gpu_probe.py"), "--case", "nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert one.returncode == 2 and "invalid choice: 'nope'" in one.stderr


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
