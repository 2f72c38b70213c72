"""bench/agnostic.py refuses bad arguments at its parser, before it loads a model, with the
library's own list types (kvcache_ext.cli.args); ``--kvpress-keep ''`` asks for no kvpress run."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import agnostic  # noqa: E402
from test_bench_e2e import parser_error  # noqa: E402


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "passkey,haystack"], "argument --tasks: takes passkey, needle (comma-separated)"),
    (["--lengths", "1024,-5"], "argument --lengths: must be positive integers, got -5 in '1024,-5'"),
    (["--depths", "0.1,x"], "argument --depths: expected comma-separated depths in [0, 1], got 'x'"),
    (["--keep", "0.25,2"], "argument --keep: must be fractions in (0, 1], got 2 in '0.25,2'"),
    (["--kvpress-keep", "0"], "argument --kvpress-keep: must be fractions in (0, 1], got 0 in '0'"),
    (["--seeds", "0"], "argument --seeds: must be an integer >= 1, got 0")])
def test_bad_arguments_are_refused_before_the_model_loads(argv, message):
    assert message in parser_error(agnostic.main, argv)


def test_an_empty_kvpress_keep_asks_for_no_kvpress_run():
    assert agnostic._fractions_or_none("") == [] and agnostic._fractions_or_none(" ") == []
    assert agnostic._fractions_or_none("0.25,0.1") == [0.25, 0.1]
