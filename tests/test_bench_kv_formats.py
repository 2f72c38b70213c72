"""bench/kv_formats.py --model tiny: every format's round trip against the rows, the int8 one the
pages' own format, and the JSON has its rows; the 4-bit and fp8 round trips on hand-made rows."""
import json
import os
import subprocess
import sys

import pytest
import torch
from child import child_env

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from kv_formats import fp8_round_trip, four_bit_round_trip  # noqa: E402


def test_the_smoke_run(tmp_path):
    out = tmp_path / "formats.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kv_formats.py"), "--model", "tiny",
                           "--length", "128", "--out", str(out)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["int8", "fp8-e4m3", "int4-g32"]
    # Random rows: int8 within a percent, and each coarser format further off.
    assert 0 < rows["int8"]["k_error"] < 0.01
    assert rows["int8"]["k_error"] < rows["fp8-e4m3"]["k_error"] < rows["int4-g32"]["k_error"]
    assert rows["int8"]["row_bytes"] == 16 + 2 and rows["int4-g32"]["row_bytes"] == 8 + 2   # head_dim 16


def test_the_simulated_formats_on_hand_made_rows():
    x = torch.tensor([[7.0, -3.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # 4 bits, one group: scale 1, steps round half to even.
    assert torch.equal(four_bit_round_trip(x, 4), torch.tensor([[7.0, -4.0, 1.0, 0.0], [0.0] * 4]))
    # Two groups of two: scales 1 and 1/7, each group's largest value exact.
    two = four_bit_round_trip(x, 2)
    assert two[0, 0] == 7.0 and two[0, 2] == pytest.approx(1.0, rel=1e-3) and two[0, 3] == 0
    # e4m3 with the row's scale: the largest value exact, zeros stay zeros.
    fp8 = fp8_round_trip(x)
    assert fp8[0, 0] == pytest.approx(7.0, rel=1e-3) and torch.equal(fp8[1], torch.zeros(4))
