"""bench/shared_prefix.py at its smallest: one context's three questions served by HF's paged
cache, by SnapKV with each request's own copy, and by SnapKV over the context shared; the JSON
says what each method answered and held, and the ratios against HF's paged cache."""
import json
import os
import subprocess
import sys

from child import child_env
from test_serving import needs_engine

pytestmark = needs_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shared_prefix_bench_reports_every_method(tmp_path):
    out = tmp_path / "shared.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "shared_prefix.py"), "--length", "300", "--contexts", "1",
         "--repeats", "1", "--num-blocks", "64", "--max-tokens", "4", "--methods", "full,snapkv,snapkv+shared",
         "--out", str(out)],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {"device", "date", "commit", "dirty"} <= set(doc["meta"])
    rows = {r["method"]: r for r in doc["rows"]}
    assert set(rows) == {"full", "snapkv", "snapkv+shared"}
    for row in rows.values():
        assert row["requests"] == 3 and row["errors"] == 0 and len(row["answers"]) == 3
        assert 0 <= row["right"] <= 3 and row["most_decoding"] >= 1 and row["most_held_bytes"] > 0
        assert row["decoding_vs_full"] == row["most_decoding"] / rows["full"]["most_decoding"]
    assert rows["snapkv+shared"]["prefix_seconds"] > 0 and rows["snapkv"]["prefix_seconds"] < 0.01
    # Each request's own compressed copy of the context, against one copy read by all three.
    assert rows["snapkv+shared"]["most_held_bytes"] < rows["snapkv"]["most_held_bytes"]
    assert "of full" in proc.stdout
