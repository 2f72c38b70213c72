"""bench/kvpress_scored_once.py refuses bad arguments, and a missing kvpress, at its parser,
before it loads a model. (Its check itself, scored once against kvpress's pipeline, is
tests/test_ruler.py's with a stand-in kvpress, and the script's JSON with the real one.)"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kvpress_scored_once  # noqa: E402
from test_bench_e2e import parser_error  # noqa: E402


@pytest.mark.parametrize("argv,message", [
    (["--presses", "kvpress-streamingllm"], "argument --presses: takes kvpress-snapkv, kvpress-ada-snapkv"),
    (["--tasks", "niah_single_9"], "argument --tasks: takes niah_single_1"),
    (["--keep", "0.5,0"], "argument --keep: must be fractions in (0, 1], got 0 in '0.5,0'"),
    (["--modes", "later"], "argument --modes: takes aware, agnostic"),
    (["--length", "10"], "argument --length: must be an integer >= 64, got 10")])
def test_bad_arguments_are_refused_before_the_model_loads(argv, message):
    assert message in parser_error(kvpress_scored_once.main, argv)


def test_a_missing_kvpress_is_refused_with_how_to_install_it(monkeypatch):
    monkeypatch.setattr(kvpress_scored_once, "kvpress_missing", lambda: "kvpress cannot be imported (x); pip install")
    assert "error: kvpress cannot be imported (x); pip install" in parser_error(kvpress_scored_once.main, [])
