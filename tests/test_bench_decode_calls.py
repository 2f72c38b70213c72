"""bench/decode_calls.py runs (a tiny random Llama): both policies are timed call by call, and
with pages reserved first no call adds any; both paths (the eager fast path, the ops) run side
by side and write their JSON."""
import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from child import child_env   # noqa: E402
from test_bench_e2e import LAYERS   # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "decode_calls.py")


@pytest.mark.parametrize("reserve", [False, True])
def test_decode_calls_times_every_layer_call(reserve):
    steps = 8
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--context", "512", "--batch", "2",
                           "--steps", str(steps)] + (["--reserve"] if reserve else []),
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {m.group(1): m for m in re.finditer(r"^\| (snapkv|ada-snapkv) \| fast \| [\d.]+ \| (\d+) of (\d+) \|",
                                                proc.stdout, re.M)}
    assert set(rows) == {"snapkv", "ada-snapkv"}, proc.stdout
    for row in rows.values():
        assert int(row.group(3)) == steps * LAYERS          # every layer's call of every step
        if reserve:
            assert int(row.group(2)) == 0                  # no call added pages


def test_decode_calls_times_both_paths_side_by_side(tmp_path):
    steps, out = 8, tmp_path / "calls.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--context", "512", "--batch", "2",
                           "--steps", str(steps), "--paths", "fast,ops", "--out", str(out)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = re.findall(r"^\| (snapkv|ada-snapkv) \| (fast|ops) \| [\d.]+ \| (\d+) of (\d+) \|", proc.stdout, re.M)
    assert {(name, path) for name, path, _, _ in rows} == {(n, p) for n in ("snapkv", "ada-snapkv")
                                                           for p in ("fast", "ops")}, proc.stdout
    assert all(int(calls) == steps * LAYERS for *_, calls in rows)
    # the two paths of a policy add pages on the same calls: the same work, the same caches
    adding = {(name, path): int(n) for name, path, n, _ in rows}
    assert all(adding[name, "fast"] == adding[name, "ops"] for name in ("snapkv", "ada-snapkv"))
    assert re.search(r"^snapkv: ops / fast = [\d.]+ per call", proc.stdout, re.M), proc.stdout
    record = json.loads(out.read_text())
    assert len(record["rows"]) == 4 and all(len(s["step_s"]) == steps for s in record["steps"])


def test_decode_calls_refuses_an_unknown_path():
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--paths", "fast,slow"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--paths" in proc.stderr
