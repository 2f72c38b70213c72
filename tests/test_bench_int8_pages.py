"""bench/int8_pages.py --model tiny --quick: every method runs, int8 pages hold about a third of
the unquantized store's bytes (the tiny model's head_dim is 16, where the scales and positions
weigh more than at 64), the 4-bit simulation runs on the reference path, and the JSON has its rows."""
import json
import os
import subprocess
import sys

import pytest
from child import child_env

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "int8_pages.py")


def test_the_smoke_run(tmp_path):
    out = tmp_path / "int8.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--quick", "--int4-sim", "--out", str(out)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "tokens = store" in proc.stdout   # the table is printed
    with open(out) as f:
        doc = json.load(f)
    rows = {r["method"]: r for r in doc["rows"]}
    assert list(rows) == ["full", "store@1", "int8@1", "int4sim@1", "store@0.25", "int8@0.25", "int4sim@0.25"]
    for keep in ("1", "0.25"):
        int8 = rows[f"int8@{keep}"]
        assert 0.2 < int8["bytes_x_store"] < 0.4, int8
        assert 0 <= int8["tokens_equal"] <= 1 and int8["x_store"] > 0
    assert rows["int8@0.25"]["kv_bytes"] < rows["store@0.25"]["kv_bytes"] < rows["full"]["kv_bytes"]
    for keep in ("1", "0.25"):   # a simulation: answers and tokens, no speed or bytes
        sim = rows[f"int4sim@{keep}"]
        assert 0 <= sim["tokens_equal"] <= 1 and sim["tokens_per_s"] is None and sim["kv_bytes"] is None, sim
    assert "device" in doc["meta"] and "date" in doc["meta"]
