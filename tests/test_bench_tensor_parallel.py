"""bench/tensor_parallel.py refuses bad arguments at its parser with the argument and the value:
budgets that leave no room beyond SnapKV's protected tokens, no timed repeats or one rank before
it loads the model, a rank count that does not split the default model's heads after."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import tensor_parallel  # noqa: E402
from test_bench_e2e import parser_error  # noqa: E402


@pytest.mark.parametrize("argv,message", [
    (["--budgets", "64,16"], "--budgets 16: Policy budget 16 leaves no room beyond the 32 protected tokens"),
    (["--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    (["--ranks", "1"], "argument --ranks: must be an integer >= 2, got 1"),
    (["--lengths", "1024,-5"], "argument --lengths: must be positive integers, got -5 in '1024,-5'")])
def test_bad_arguments_are_refused_before_the_model_loads(argv, message):
    assert message in parser_error(tensor_parallel.main, argv)


def test_ranks_that_do_not_split_the_heads_are_refused(default_model, monkeypatch):
    import kvcache_ext.hf.models as models
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: default_model)
    message = parser_error(tensor_parallel.main, ["--ranks", "2"])
    assert "--ranks 2: the default model's 3 KV heads and 9 query heads must split evenly over the ranks" \
        in message


def test_the_policies_are_snapkv_and_both_ada_kv_splits():
    exact, per_rank = (tensor_parallel.make_policy(n, 64).allocation for n in tensor_parallel.POLICIES[1:])
    assert (exact.across_ranks, per_rank.across_ranks) == ("exact", "per_rank")
    assert tensor_parallel.make_policy("snapkv", 64).budget == 64

