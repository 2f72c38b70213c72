"""bench/kvzip_prefill.py runs on the default model: every length and chunk size gets a row whose
ratio is the medians' ratio of its runs over the same dense runs, and ours is split into passes
and scores that lie inside it."""
import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from child import child_env
from test_bench_e2e import usage_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "kvzip_prefill.py")


def test_kvzip_prefill_rounds(tmp_path):
    out = tmp_path / "prefill.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--lengths", "256", "--rounds", "2", "--chunks", "2048,64",
                           "--out", str(out)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    printed = re.findall(r"^\| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|", proc.stdout, re.M)
    assert [int(chunk) for _, chunk, *_ in printed] == [2048, 64], proc.stdout
    doc = json.loads(out.read_text())
    assert doc["chunks"] == [2048, 64] and [row["chunk"] for row in doc["rows"]] == [2048, 64]
    for row, line in zip(doc["rows"], printed):
        assert row["context_tokens"] == int(line[0]) and len(row["dense_s"]) == len(row["ours"]) == 2
        assert row["dense_s"] == doc["rows"][0]["dense_s"]   # one dense run per round serves every chunk
        dense = statistics.median(row["dense_s"])
        ours = statistics.median(run["seconds"] for run in row["ours"])
        assert abs(row["ratio"] - ours / dense) < 1e-9 and abs(float(line[4]) - ours / dense) < 0.006
        for run in row["ours"]:
            assert 0 < run["scores"] < run["passes"] < run["seconds"]


@pytest.mark.parametrize("argv,message", [
    (["--rounds", "0"], "argument --rounds: must be an integer >= 1, got 0"),
    (["--keep", "1.5"], "--keep: a fraction in (0, 1], got 1.5"),
    (["--chunks", "1024,zero"],
     "argument --chunks: expected comma-separated positive integers, got 'zero' in '1024,zero'"),
    (["--lengths", "1024,0"], "argument --lengths: must be positive integers, got 0 in '1024,0'")])
def test_kvzip_prefill_refuses_bad_arguments(argv, message):
    assert message in usage_error(SCRIPT, argv)
