"""bench/memory.py --tiny --quick: the ragged cache holds fewer bytes than the masked full-size
cache, Ada-KV keeps exactly H * B * batch tokens per layer, and the JSON has its keys."""
import json
import os
import subprocess
import sys

import pytest
from child import child_env

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "memory.py")
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "memory.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--tiny", "--quick", "--batch", "2",
                           "--decode-steps", str(DECODE_STEPS), "--out", str(out)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "| prompt | B/head |" in proc.stdout   # the table is printed
    with open(out) as f:
        return json.load(f)


def test_json_keys(doc):
    for key in ("benchmark", "date", "commit", "dirty", "device", "torch", "transformers", "command", "machine",
                "model", "budgets", "verifications", "runtime_s", "rows"):
        assert key in doc, key
    assert doc["benchmark"] == "memory"
    assert "--tiny" in doc["command"]
    assert {"layers", "kv_heads", "head_dim", "dtype"} <= set(doc["model"])
    assert len(doc["rows"]) == 4   # --quick: 2 prompt lengths x 2 budgets
    for row in doc["rows"]:
        for key in ("prompt_len", "budget", "batch", "full_bytes", "masked_bytes", "reference_masked_nbytes",
                    "masked_over_ours", "full_over_ours", "ours"):
            assert key in row, key
        assert set(row["ours"]) == {"snapkv", "ada_snapkv", "ada_pyramid"}
        for result in row["ours"].values():
            for key in ("nbytes", "nbytes_shrunk", "kept_per_layer", "kept_total", "kv_live_bytes"):
                assert key in result, key


def test_ragged_holds_less_than_masked(doc):
    for row in doc["rows"]:
        ours = row["ours"]["ada_snapkv"]
        assert row["masked_bytes"] > row["full_bytes"]
        assert ours["nbytes"] < row["masked_bytes"]
        assert ours["nbytes"] < row["reference_masked_nbytes"]
        assert ours["nbytes_shrunk"] <= ours["nbytes"]
        assert row["masked_over_ours"] == pytest.approx(row["masked_bytes"] / ours["nbytes"])
        assert row["masked_over_ours"] > 1 and row["full_over_ours"] > 1
        # The live K+V are exactly the kept tokens; the store adds positions and tables.
        assert ours["kv_live_bytes"] < ours["nbytes_shrunk"]


def test_adakv_keeps_h_times_b_per_layer(doc):
    heads, layers = doc["model"]["kv_heads"], doc["model"]["layers"]
    for row in doc["rows"]:
        expected = heads * row["budget"] * row["batch"]
        for name in ("snapkv", "ada_snapkv"):
            result = row["ours"][name]
            assert result["kept_per_layer"] == [expected] * layers, (name, result["kept_per_layer"])
        per_head = row["ours"]["ada_snapkv"]["kept_per_head"]
        assert len(per_head) == layers and all(len(r) == row["batch"] and len(r[0]) == heads for r in per_head)
        assert row["reference_same_kept"]


def test_real_forward_matches_and_decode_adds_tokens(doc):
    verified = doc["verifications"]
    assert len(verified) == 3 * len(doc["rows"])   # --tiny: every policy and budget
    heads, batch = doc["model"]["kv_heads"], 2
    decoded = [v for v in verified if v["decode_steps"]]
    assert decoded, "the Ada-SnapKV verification decodes"
    for v in verified:
        assert v["same_kept_as_replay"] and v["same_nbytes_as_replay"] and v["decode_exact"]
    for v in decoded:
        assert v["decode_steps"] == DECODE_STEPS
        assert v["kept_per_layer_after_decode"] == [heads * (v["budget"] + DECODE_STEPS) * batch] * len(
            v["kept_per_layer_after_decode"])


@pytest.mark.parametrize("argv,message", [
    (["--lengths", "512,-1"], "argument --lengths: must be positive integers, got -1 in '512,-1'"),
    (["--budgets", "64,y"], "argument --budgets: expected comma-separated positive integers, got 'y'")])
def test_bad_lists_are_refused_at_the_parser(argv, message):
    from test_bench_e2e import usage_error
    assert message in usage_error(SCRIPT, argv)
