"""bench/kept_by_layer.py: the answer's positions are found across token boundaries; per layer
it counts what each KV head holds (the whole context at keep 1, each head's budget under a
uniform split, the layer's budget over its heads under Ada-KV's); the answer's reading heads
hold it all at keep 1; bad arguments are refused at its parser, before a model loads."""
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from tiny_models import VOCAB, tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kept_by_layer  # noqa: E402
from test_bench_e2e import parser_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

N, QUESTION = 160, 6   # a quarter of the context outgrows SnapKV's window of 32
HEADS, KV_HEADS, LAYERS = 4, 2, 3
TOKENIZER = SimpleNamespace(eos_token_id=None, encode=lambda text, add_special_tokens=False: [],
                            decode=lambda ids, skip_special_tokens=True: "".join(f"<{i}>" for i in ids))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", heads=HEADS, kv_heads=KV_HEADS, layers=LAYERS, attn="eager")


def _prompt(seed: int, answer_at: int = 17):
    ids = torch.randint(0, VOCAB, (N,), generator=torch.Generator().manual_seed(seed))
    answer = f"{ids[answer_at]}><{ids[answer_at + 1]}"   # starts and ends inside two tokens' texts
    return SimpleNamespace(task="niah_single_1", seed=seed, length=N, input_ids=ids, haystack_end=N - QUESTION,
                           answers=[answer], score=lambda text: float(answer in text))


def test_answer_positions_cover_every_token_an_occurrence_touches():
    tok = SimpleNamespace(decode=lambda ids: {1: "ab", 2: "c12", 3: "34d", 4: " ", 5: "1234"}[ids[0]])
    assert kept_by_layer.answer_positions(tok, [1, 2, 3, 4, 5, 1], ["1234"]) == [1, 2, 4]
    assert kept_by_layer.answer_positions(tok, [1, 2, 3], ["bc", "zz"]) == [0, 1]
    assert kept_by_layer.answer_positions(tok, [1, 2, 3], ["x"]) == []


@pytest.mark.parametrize("mode", ["aware", "agnostic"])
def test_keep_one_holds_the_whole_context_and_the_answer_in_its_reading_heads(model, mode):
    prompt = _prompt(3)
    result = kept_by_layer.kept_by_layer(model, TOKENIZER, prompt, mode, ["snapkv", "ada-snapkv"], 1.0,
                                         max_new_tokens=4, reading_heads=3)
    n = N if mode == "aware" else N - QUESTION
    assert result["compressed"] == n and result["answer_positions"] == [17, 18]
    assert len(result["reading_heads"]) == 3
    shares = [r["share"] for r in result["reading_heads"]]
    assert shares == sorted(shares, reverse=True) and all(0.0 < s <= 1.0 for s in shares)
    for run in result["policies"]:
        assert run["tokens_per_head"] == [[n] * KV_HEADS] * LAYERS, run["policy"]
        assert run["answer_held_in_reading_heads"] == [1.0] * 3
        assert run["output"] == result["full"]["output"]


def test_a_small_keep_holds_each_heads_budget_or_the_layers_split(model):
    result = kept_by_layer.kept_by_layer(model, TOKENIZER, _prompt(5), "agnostic", ["snapkv", "ada-snapkv"], 0.25,
                                         max_new_tokens=4)
    budget = -(-(N - QUESTION) * 25 // 100)   # a quarter of the context, rounded up
    by = {run["policy"]: run for run in result["policies"]}
    assert by["snapkv"]["budget_tokens"] == by["ada-snapkv"]["budget_tokens"] == budget
    assert by["snapkv"]["tokens_per_head"] == [[budget] * KV_HEADS] * LAYERS
    assert [sum(layer) for layer in by["ada-snapkv"]["tokens_per_head"]] == [budget * KV_HEADS] * LAYERS
    held = by["snapkv"]["answer_held_in_reading_heads"]
    assert len(held) == LAYERS * KV_HEADS and all(x in (0.0, 0.5, 1.0) for x in held)   # two answer tokens
    assert "tokens per head by layer (least/mean/most)" in kept_by_layer.table(result)


@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required: --task"),
    (["--task", "niah_single_9"], "argument --task: invalid choice: 'niah_single_9'"),
    (["--task", "vt", "--keep", "0"], "argument --keep:"),
    (["--task", "vt", "--policies", "full"], "argument --policies: takes "),
    (["--task", "vt", "--mode", "later"], "argument --mode: invalid choice: 'later'"),
    (["--task", "vt", "--out", "/no/such/folder/x.json"], "argument --out:")])
def test_bad_arguments_are_refused_before_the_model_loads(argv, message):
    assert message in parser_error(kept_by_layer.main, argv)
