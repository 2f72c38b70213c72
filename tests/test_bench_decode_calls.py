"""bench/decode_calls.py runs (a tiny random Llama): both policies are timed call by call, and
with pages reserved first no call adds any."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from test_bench_e2e import LAYERS, child_env   # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "decode_calls.py")


@pytest.mark.parametrize("reserve", [False, True])
def test_decode_calls_times_every_layer_call(reserve):
    steps = 8
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--context", "512", "--batch", "2",
                           "--steps", str(steps)] + (["--reserve"] if reserve else []),
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {m.group(1): m for m in re.finditer(r"^\| (snapkv|ada-snapkv) \| [\d.]+ \| (\d+) of (\d+) \|",
                                                proc.stdout, re.M)}
    assert set(rows) == {"snapkv", "ada-snapkv"}, proc.stdout
    for row in rows.values():
        assert int(row.group(3)) == steps * LAYERS          # every layer's call of every step
        if reserve:
            assert int(row.group(2)) == 0                  # no call added pages
