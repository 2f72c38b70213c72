"""bench/kvzip_prefix.py's readings of the chat prefix, on a tiny model with token-id
instructions: ``rebuild`` is the library's KVzip with ``skip_prefix=None``, as it is; ``drop`` and ``hold`` rebuild only
the text after the prefix and give the prefix's tokens score 0 or an infinite one; the library
is itself again after each block, and a prompt without the prefix is refused."""
import os
import sys

import pytest
import torch

import kvcache_ext
import kvcache_ext.engine.reconstruction as reconstruction
from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill
from kvcache_ext.policies import KVzip, Policy
from test_bench_e2e import parser_error
from test_kvzip import kvzip
from test_patch import inputs
from tiny_models import tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kvzip_prefix  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PREFIX = 6


def library():
    return KVzip.passes, reconstruction.finish


@pytest.mark.parametrize("name", kvzip_prefix.READINGS)
def test_each_reading_rebuilds_and_scores_the_prefix_as_its_source_does(name):
    model = tiny_model("llama", heads=6, kv_heads=2, layers=3)
    ids, _ = inputs(batch=1, length=40, seed=4)
    policy = Policy(kvzip(chunk=16), budget=12)
    recorded = record_prefill(model, ids)
    plain = library()
    with kvcache_ext.patch(model, policy) as handle:
        with kvzip_prefix.reading(name, ids[0, :PREFIX].tolist()):
            passes = policy.scorer.passes(ids, torch.ones_like(ids, dtype=torch.bool), handle.tokens)
            scores = handle.score_prompt(compressed_cache(policy, recorded), ids)
    assert library() == plain
    start = 0 if name == "rebuild" else PREFIX
    assert [(lo, hi) for *_, lo, hi in passes] == [(start + lo, min(start + lo + 16, 40))
                                                   for lo in range(0, 40 - start, 16)]
    first_inputs = passes[0][0][0]
    assert first_inputs[-16:].tolist() == ids[0, start:start + 16].tolist()   # the first chunk's text
    for layer_scores in scores:
        head = layer_scores[..., :PREFIX]
        if name == "rebuild":
            assert bool((head > 0).all())
        else:
            assert bool((head == (0.0 if name == "drop" else float("inf"))).all())
        assert bool((layer_scores[..., PREFIX:] > 0).all())


def test_a_prompt_without_the_prefix_is_refused():
    ids, _ = inputs(batch=1, length=40, seed=4)
    other = [(t + 1) % 50 for t in ids[0, :PREFIX].tolist()]
    with kvzip_prefix.reading("drop", other), pytest.raises(ValueError, match="template's prefix"):
        kvzip().passes(ids, torch.ones_like(ids, dtype=torch.bool), lambda text: [])
    assert library()[0] is KVzip.passes


@pytest.mark.parametrize("argv,message", [
    (["--readings", "rebuild,skip"], "argument --readings: takes rebuild, drop, hold (comma-separated)"),
    (["--lengths", "0"], "argument --lengths: must be positive integers, got 0 in '0'"),
    (["--depths", "-0.1"], "argument --depths: must be depths in [0, 1], got -0.1"),
    (["--keep", "0.25,0"], "argument --keep: must be fractions in (0, 1], got 0 in '0.25,0'")])
def test_bad_arguments_are_refused_before_the_model_loads(argv, message):
    assert message in parser_error(kvzip_prefix.main, argv)
