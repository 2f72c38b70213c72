"""bench/graph_host.py runs (a tiny random Llama): eager and graphed steps of both policies take
turns, every graphed step after the first two is a replay, and a replay's host work is a small
part of an eager step."""
import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from child import child_env   # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "graph_host.py")


def test_graph_host_times_eager_and_graphed_steps(tmp_path):
    steps, out = 8, tmp_path / "graph-host.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--context", "256", "--budget", "64",
                           "--steps", str(steps), "--turn", "3", "--out", str(out)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = re.findall(r"^(snapkv|h2o-step): eager step [\d.]+ ms, graphed step's host work [\d.]+ ms", proc.stdout,
                       re.M)
    assert lines == ["snapkv", "h2o-step"], proc.stdout
    record = json.loads(out.read_text())
    assert record["meta"]["backend"].startswith("NullGraphs") and record["meta"]["command"].startswith("python")
    assert {"device", "date", "commit", "dirty"} <= set(record["meta"])   # bench/common.py's run_metadata
    for row in record["rows"]:
        # 4 untimed steps and 8 timed: the first warms up, the second is captured, 10 replays
        assert row["graph"] == {"warmups": 1, "captures": 1, "replays": 10, "eager_steps": 1}, row
        assert 0 < row["graph_host_step_s"] < row["eager_step_s"]


def test_graph_host_refuses_a_bad_count():
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--steps", "0"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--steps must be >= 1, got 0" in proc.stderr
