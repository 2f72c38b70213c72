"""bench/kvzip_selection.py on the default model and a short prompt: its ``global`` selection
under the default reading is the harness's ``kvzip-global`` (same answer, same bytes), under
``rebuild`` it is ``kvzip-global-rebuild``; a selection that pools the scores keeps other tokens
than one that does not; every chunk size asked for runs its own passes; unknown names and bad
numbers are refused."""
import importlib.util
import os
import sys

import pytest
import torch

from kvcache_ext.evaluation.retrieval import run_prompt
from kvcache_ext.tasks import make_passkey_prompt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kvzip_selection  # noqa: E402
from test_bench_e2e import parser_error  # noqa: E402

KEEPS = [0.25, 0.1]


@pytest.fixture(scope="module")
def runs(default_model):
    model, tokenizer = default_model
    prompt = make_passkey_prompt(tokenizer, 320, 0.5, seed=3)
    with torch.no_grad():
        bench = kvzip_selection.run_prompt(model, tokenizer, prompt, ["chat", "rebuild"], [2048, 128],
                                           ["global", "pool7"], KEEPS)
        harness = run_prompt(model, tokenizer, prompt, "passkey", "agnostic",
                             ["full", "kvzip-global", "kvzip-global-rebuild"], KEEPS)
    return bench, harness


def test_global_is_the_harness_kvzip_global_under_both_readings(runs):
    bench, harness = runs
    names = {"chat": "kvzip-global", "rebuild": "kvzip-global-rebuild"}
    for reading, name in names.items():
        for keep in KEEPS:
            row = (reading, 2048, "global", keep)
            ours = next(r for r in bench if (r["reading"], r["chunk"], r["selection"], r["keep"]) == row)
            theirs = next(r for r in harness if (r.policy, r.budget) == (name, keep))
            assert (ours["output"], ours["correct"], ours["kv_bytes"]) == (theirs.output, theirs.correct,
                                                                           theirs.kv_bytes)
    full = next(r for r in bench if r["selection"] == "full")
    assert full["output"] == next(r for r in harness if r.policy == "full").output


def test_every_reading_chunk_selection_and_keep_is_run_and_timed(runs):
    bench, _ = runs
    rows = [(r["reading"], r["chunk"], r["selection"], r["keep"]) for r in bench if r["selection"] != "full"]
    assert rows == [(a, c, s, k) for a in ("chat", "rebuild") for c in (2048, 128) for s in ("global", "pool7")
                    for k in KEEPS]
    assert all(r["passes_s"] > 0 and r["kv_bytes"] > 0 for r in bench if r["selection"] != "full")


def test_pooled_scores_leave_the_skipped_prefix_out_and_spread_over_neighbours():
    scores = [torch.tensor([[[0.0, 0.0, 0.125, 0.75, 0.125, 0.25, 0.125]]])]
    rebuilt = torch.tensor([[False, False, True, True, True, True, True]])
    out = kvzip_selection.pooled(scores, kvzip_selection.Pooling(3), rebuilt)[0]
    assert out.tolist() == [[[0.0, 0.0, 0.75, 0.75, 0.75, 0.25, 0.25]]]
    plain = kvzip_selection.pooled(scores, None, rebuilt)[0]
    assert torch.equal(plain, scores[0]) and plain is not scores[0]


@pytest.mark.parametrize("argv,message", [
    (["--selections", "global,pool4"], "argument --selections: takes global, pool3,"),
    (["--readings", "drop"], "argument --readings: takes chat, rebuild (comma-separated); got 'drop'"),
    (["--tasks", "passkey,haystack"], "argument --tasks: takes passkey, needle (comma-separated)"),
    (["--keep", "0.1,1.5"], "argument --keep: must be fractions in (0, 1], got 1.5 in '0.1,1.5'"),
    (["--kvpress-keep", "x"], "argument --kvpress-keep: expected comma-separated fractions in (0, 1], got 'x'"),
    (["--chunks", "2048,0"], "argument --chunks: must be positive integers, got 0 in '2048,0'"),
    (["--lengths", "1024,x"], "argument --lengths: expected comma-separated positive integers, got 'x'"),
    (["--depths", "0.5,1.2"], "argument --depths: must be depths in [0, 1], got 1.2"),
    (["--kvpress-plus"], "--kvpress-plus: runs kvpress's KVzip+ beside")])
def test_bad_arguments_are_refused(argv, message):
    assert message in parser_error(kvzip_selection.main, argv)


def test_kvpress_without_kvpress_is_refused(capsys):
    if importlib.util.find_spec("kvpress") is not None:
        pytest.skip("kvpress imports here: --kvpress would run the whole bench")
    with pytest.raises(SystemExit):
        kvzip_selection.main(["--kvpress"])
    err = capsys.readouterr().err
    assert "--kvpress: kvpress cannot be imported (ModuleNotFoundError" in err and 'pip install ".[bench]"' in err


def test_table_counts_answers_and_kvpress_outputs_that_are_ours():
    def run(seed, reading, selection, keep, correct, output, chunk=2048):
        chunk = chunk if reading else None
        return dict(seed=seed, reading=reading, chunk=chunk, selection=selection, keep=keep, correct=correct,
                    output=output)
    records = [run(1, None, "full", None, True, "12345"), run(2, None, "full", None, True, "54321"),
               run(1, "chat", "global", 0.05, True, "12345"), run(2, "chat", "global", 0.05, False, "1."),
               run(1, None, "kvpress", 0.05, True, "12345"), run(2, None, "kvpress", 0.05, False, "2."),
               run(1, None, "kvpress-plus", 0.05, False, "x"), run(2, None, "kvpress-plus", 0.05, False, "y"),
               run(1, "chat", "global", 0.05, True, "12345", 1024), run(2, "chat", "global", 0.05, True, "54321", 1024),
               run(1, "chat", "global", 0.1, True, "12345", 1024)]
    text = kvzip_selection.table(records, ["chat"], [2048, 1024], ["global"], [0.05])
    assert "2 prompts; the full cache answers 2" in text
    assert "| reading | chunk | selection | keep 0.1 | keep 0.05 |" in text
    assert "| chat | 2048 | global | — | 1/2 |" in text and "| chat | 1024 | global | 1/2 | 2/2 |" in text
    assert "| kvpress 0.5.5 | 2048 | kvpress | — | 1/2 |" in text
    assert "| kvpress 0.5.5 | 2048 | kvpress-plus | — | 0/2 |" in text
    # kvpress's outputs are compared with ours at kvpress's chunk only (the 1024 runs answer both)
    assert "word for word, in 1 of 2 runs" in text


def test_out_json_carries_the_arguments_commit_and_build(tmp_path, capsys):
    import argparse
    import json

    import common
    path = tmp_path / "out.json"
    common.write_out(str(path), argparse.Namespace(keep="0.05"), {"prefix_tokens": 24}, records=[{"correct": True}])
    doc = json.loads(path.read_text())
    assert doc["records"] == [{"correct": True}]
    assert doc["meta"]["args"] == {"keep": "0.05"} and doc["meta"]["prefix_tokens"] == 24
    assert doc["meta"]["commit"] and doc["meta"]["torch"] == torch.__version__ and "path" in doc["meta"]["build"]
    assert f"wrote {path}" in capsys.readouterr().out
