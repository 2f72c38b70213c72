"""``kvcache-ext check`` (kvcache_ext.evaluation.device_check): the whole check passes on the CPU and
prints every row; a planted wrong result (or a kernel that raises) fails it, naming the kernel;
its error measure is assert_close's criterion; a bad --device is refused naming what is accepted;
the GPU record it prints is the one docs/gpu.md gives."""
import json
import math
import pathlib
import re

import pytest
import torch

import kvcache_ext
import kvcache_ext.kernels.attention as attention_module
import kvcache_ext.kernels.select as select_module
import kvcache_ext.kernels.store as store_module
from kvcache_ext import cli
from kvcache_ext.evaluation import device_check, gpu_record

ROOT = pathlib.Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def test_the_check_passes_on_the_cpu_and_prints_every_row(capsys):
    assert cli.main(["check", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert "| op | dtype | max error | tolerance | pass |" in lines
    rows = [line for line in lines if line.startswith("| ") and not line.startswith(("| op ", "| ---"))]
    planned = device_check.planned()
    assert len(rows) == len(planned)
    for line, (op, dtype, _, switch) in zip(rows, planned):
        assert line.startswith(f"| {op} | {dtype} | "), line
        assert line.endswith(" | pass |") if switch is None else "| not served: " in line, line
    dtypes = {dtype for _, dtype, _, _ in planned}
    assert {"float32", "float16", "bfloat16", "int8"} <= dtypes
    ops = {op.split()[0] for op, _, _, _ in planned}
    assert set(kvcache_ext.kernels.ops.OPS) <= ops, "an op the check does not run"
    assert f"{len(planned)} rows in " in out and "0 failed" in out
    for line in gpu_record.describe():
        assert line in lines


class Planted:
    """``torch.ops.kvcache_ext`` with one op replaced."""

    def __init__(self, name, replacement):
        self.name, self.replacement = name, replacement

    def __getattr__(self, name):
        return self.replacement if name == self.name else getattr(torch.ops.kvcache_ext, name)


def test_a_wrong_attention_fails_the_check_naming_the_kernel(monkeypatch, capsys):
    """Every output of attention_run off by 0.1: its rows fail in every dtype, and the rows of the
    kernels it does not touch still pass."""
    def wrong(*args):
        out, *stats = torch.ops.kvcache_ext.attention_run(*args)
        return (out + 0.1, *stats)
    monkeypatch.setattr(attention_module, "ops", Planted("attention_run", wrong))
    assert cli.main(["check", "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    failed = re.findall(r"^FAILED: (.+?) \((.+?)\): (.*)$", err, re.MULTILINE)
    for dtype in device_check.DTYPES:
        assert ("attention_run", dtype) in [(op, d) for op, d, _ in failed], dtype
    assert all("out: max error" in why for op, _, why in failed if op == "attention_run")
    assert not [op for op, _, _ in failed if op.startswith(("store_", "segmented", "grouped", "attention_run stat"))]
    row = next(line for line in out.splitlines() if line.startswith("| attention_run | float32 | "))
    assert row.endswith(" | 1e-05 | FAIL |"), row


def test_a_wrong_compaction_and_a_raising_kernel_fail_their_rows(monkeypatch):
    """The unordered compaction keeps one token too many; segmented_topk raises: their rows fail,
    the stable compaction's and grouped_topk's pass."""
    def wrong_compact(pool, table, lens, keep, *args):
        stable = args[-1]
        if not stable:
            keep = keep.clone()
            keep[(~keep).nonzero()[:1]] = True
        return torch.ops.kvcache_ext.store_compact(pool, table, lens, keep, *args)

    def raising(*args):
        raise RuntimeError("planted")
    monkeypatch.setattr(store_module, "ops", Planted("store_compact", wrong_compact))
    monkeypatch.setattr(select_module, "ops", Planted("segmented_topk", raising))
    rows = {(row.op, row.dtype): row for row in device_check.run(CPU)}
    for dtype in device_check.DTYPES:
        assert rows["store_compact unordered", dtype].status == "FAIL", dtype
        assert rows["store_compact", dtype].status == "pass", dtype
    assert rows["segmented_topk", device_check.SCORE_DTYPE].why() == "raised RuntimeError: planted"
    assert rows["grouped_topk", device_check.SCORE_DTYPE].status == "pass"
    lines = device_check.failures(rows.values())
    assert "FAILED: segmented_topk (float32 scores): raised RuntimeError: planted" in lines
    assert any(line.startswith("FAILED: store_compact unordered (int8): lengths: max error ") for line in lines)


def test_the_error_is_assert_close_s_criterion():
    gen = torch.Generator().manual_seed(0)
    want = torch.randn(1000, generator=gen) * 10
    for tol in (1e-5, 2e-3, 5e-2):
        for scale in (0.5, 2.0):
            got = want + torch.randn(1000, generator=gen).sign() * tol * scale * (1 + want.abs())
            closes = True
            try:
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            except AssertionError:
                closes = False
            assert closes == (device_check.error(got, want) <= tol), (tol, scale)
    nan, inf = math.nan, math.inf
    assert device_check.error(torch.tensor([nan, inf, 1.0]), torch.tensor([nan, inf, 1.0])) == 0
    assert device_check.error(torch.tensor([nan]), torch.tensor([0.0])) == inf
    assert device_check.error(torch.tensor([inf]), torch.tensor([-inf])) == inf
    assert device_check.error(torch.zeros(2), torch.zeros(3)) == inf
    assert device_check.error(torch.tensor([True, False]), torch.tensor([True, True])) == 0.5   # |0 - 1| / (1 + 1)


def test_what_a_device_does_not_serve_is_not_a_failure():
    """A kernel switch picks a CUDA kernel: off CUDA its rows are not served, and that is no failure."""
    decode_tc = ("KVCACHE_EXT_TC_DECODE", "1")
    assert device_check.not_served(CPU, None) is None
    assert device_check.not_served(torch.device("cuda", 0), decode_tc) is None
    reason = device_check.not_served(CPU, decode_tc)
    assert "CUDA kernel" in reason
    row = device_check.Row("attention_run", "float16", not_served=reason)
    assert row.status == "not served" and device_check.failures([row]) == []
    assert f"| not served: {reason} |" in device_check.table_line(row)
    assert device_check.Row("attention_run", "float32").status == "FAIL"   # nothing compared is no pass


def test_a_kernel_switch_is_set_for_its_row_only(monkeypatch):
    """The switch's variable holds its value while the row's check runs, and its earlier value
    (or none) after, an exception included."""
    import os
    monkeypatch.delenv("KVCACHE_EXT_TC_DECODE", raising=False)
    monkeypatch.setenv("KVCACHE_EXT_TC_PREFILL", "1")
    seen = lambda: [os.environ.get("KVCACHE_EXT_TC_DECODE"), os.environ.get("KVCACHE_EXT_TC_PREFILL")]  # noqa: E731
    assert device_check._switched(seen, ("KVCACHE_EXT_TC_DECODE", "1")) == ["1", "1"]
    assert device_check._switched(seen, ("KVCACHE_EXT_TC_PREFILL", "0")) == [None, "0"]
    assert seen() == [None, "1"]

    def raising():
        raise RuntimeError("a kernel's fault")
    with pytest.raises(RuntimeError):
        device_check._switched(raising, ("KVCACHE_EXT_TC_PREFILL", "0"))
    assert seen() == [None, "1"]


@pytest.mark.parametrize("value", ["tpu", "cuda:-1", "", "meta", "cuda:99"])
def test_a_bad_device_is_refused_naming_it_and_what_is_accepted(value, capsys):
    assert cli.main(["check", "--device", value]) == 2
    err = capsys.readouterr().err
    assert "argument --device: " in err and repr(value) in err and "accepted here: cpu" in err


def test_cuda_where_there_is_none_is_refused_saying_why(monkeypatch, capsys):
    """No GPU that torch sees; a GPU but an extension built without CUDA kernels; an index past
    the GPUs there are."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["check", "--device", "cuda"]) == 2
    assert "torch sees no CUDA GPU here" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(kvcache_ext._C, "build_info", lambda: {"cuda": False})
    assert cli.main(["check", "--device", "cuda"]) == 2
    assert "built without its CUDA kernels" in capsys.readouterr().err
    monkeypatch.setattr(kvcache_ext._C, "build_info", lambda: {"cuda": True})
    assert cli.main(["check", "--device", "cuda:1"]) == 2
    assert "'cuda:1': this machine has 1 CUDA GPU(s); accepted here: cpu, cuda, cuda:0" in capsys.readouterr().err


def test_the_gpu_record_is_the_one_docs_gpu_md_gives():
    """docs/gpu.md's current result names the record's GPU and commit, and cites the stages'
    summary of that run, which holds them; the bullets of "The next GPU run" are the paths the
    record lists as not run."""
    doc = (ROOT / "docs" / "gpu.md").read_text()
    current = doc.split("## The current GPU result")[1].split("\n## ")[0]
    assert f"One {gpu_record.LAST_GPU}," in current and f"commit {gpu_record.LAST_GPU_COMMIT}," in current
    [cited] = re.findall(r"`(bench/results/gpu-verify-[^`]*-stages\.json)`", current)
    summary = json.loads((ROOT / cited).read_text())
    assert (summary["device"], summary["commit"]) == (gpu_record.LAST_GPU, gpu_record.LAST_GPU_COMMIT)
    nxt = doc.split("## The next GPU run")[1].split("\n## ")[0]
    assert tuple(re.findall(r"^- \*\*(.+?)\*\*", nxt, re.MULTILINE)) == gpu_record.NOT_RUN_ON_A_GPU
