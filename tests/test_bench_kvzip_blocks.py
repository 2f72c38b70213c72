"""bench/kvzip_blocks.py runs: every shape is timed at every block size, and its ratio column is
the 8 MiB time over the 2 MiB time of the same row."""
import os
import re
import subprocess
import sys

from child import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "kvzip_blocks.py")


def test_kvzip_blocks_times_every_shape_at_every_size():
    proc = subprocess.run([sys.executable, SCRIPT, "--repeats", "1"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      proc.stdout, re.M)
    assert [(int(q), int(k)) for q, k, *_ in rows] == [(1040, 1020), (2060, 2040), (2060, 4080)], proc.stdout
    for *_, mib1, mib2, mib4, mib8, ratio in rows:
        assert min(float(mib1), float(mib2), float(mib4), float(mib8)) > 0
        assert abs(float(ratio) - float(mib8) / float(mib2)) <= 0.01 + 0.01 * float(ratio)
