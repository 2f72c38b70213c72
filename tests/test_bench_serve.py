"""bench/serve.py at its smallest: HF's paged cache and SnapKV each served by `kvcache-ext serve`,
the same passkey load, faults to the eviction server only; the JSON says what each request
became and the ratios against HF's paged cache."""
import json
import os
import subprocess
import sys

from child import child_env
from test_serve_load import NEEDS_A_SERVER

pytestmark = NEEDS_A_SERVER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serve_bench_reports_every_request_and_the_ratios(tmp_path):
    out = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "serve.py"), "--lengths", "256", "--requests", "2",
         "--faults", "1", "--num-blocks", "4", "--max-tokens", "4", "--device", "cpu", "--dtype", "float32",
         "--methods", "full,snapkv", "--logs", str(tmp_path), "--out", str(out)],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {"device", "date", "commit", "dirty"} <= set(doc["meta"]) and "threads" in doc["meta"]["device"]
    rows = {r["method"]: r for r in doc["rows"]}
    full, snapkv = rows["full"], rows["snapkv"]
    assert (full["sent"], full["completed"], full["lost"]) == (2, 2, 0)
    assert (snapkv["sent"], snapkv["completed"], snapkv["refused"], snapkv["cancelled"], snapkv["lost"]) == \
        (6, 2, 2, 2, 0)
    idle = {"running": 0, "waiting": 0, "reserved_bytes": 0, "held_bytes": 0}
    assert snapkv["idle_after"] == {**idle, "kept_for_reuse_bytes": 0}
    # HF's paged cache keeps complete blocks for reuse once idle: apart from what requests hold.
    assert {k: full["idle_after"][k] for k in idle} == idle and full["idle_after"]["kept_for_reuse_bytes"] >= 0
    assert full["budget_bytes"] == snapkv["budget_bytes"] > 0
    assert 0 < snapkv["most_held_bytes"] < full["most_held_bytes"]   # the same load holds less with eviction
    assert snapkv["running_vs_full"] == snapkv["most_running"] / full["most_running"]
    assert full["exit_status"] == snapkv["exit_status"] == 0
    assert "1.00x the requests running at once" in proc.stdout
