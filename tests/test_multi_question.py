"""The multi-question task: prompt layout, turns of one chat, and the eval CLI on the default model."""
import json

import pytest

from kvcache_ext import cli
from kvcache_ext.tasks import FACTS
from kvcache_ext.tasks.multi_question import DEPTHS, make_multi_question_prompt


def test_prompt_holds_each_fact_at_its_depth_and_asks_each_once(default_model):
    _, tokenizer = default_model
    p = make_multi_question_prompt(tokenizer, 900, seed=3)
    assert 800 <= p.length <= 900
    text = tokenizer.decode(p.context)
    facts = {f.answer: f for f in FACTS}
    assert sorted(p.answers) == sorted(set(p.answers)) and len(p.answers) == len(DEPTHS)
    for answer, depth in zip(p.answers, p.depths):
        at = text.index(facts[answer].needle) / len(text)
        assert abs(at - depth) < 0.1, (answer, at, depth)
        assert facts[answer].question not in text          # the questions come after compression
    turns = [tokenizer.decode(t) for t in p.turns]
    for turn, answer in zip(turns, p.answers):
        assert turn.rstrip().endswith(facts[answer].answer_prefix) and facts[answer].question in turn
    assert turns[1].startswith("<|im_end|>")                 # later turns close the previous answer
    assert make_multi_question_prompt(tokenizer, 900, seed=3).answers == p.answers
    with pytest.raises(ValueError, match="n_tokens"):
        make_multi_question_prompt(tokenizer, 60)


def test_eval_multi_runs_on_the_default_model(default_model, monkeypatch, tmp_path):
    monkeypatch.setattr("kvcache_ext.hf.models.load_model", lambda *a, **k: default_model)
    out = tmp_path / "multi.json"
    assert cli.main(["eval", "--task", "multi", "--policy", "full,kvzip-global", "--keep", "0.5",
                     "--lengths", "500", "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    rows = {r["policy"]: r for r in doc["rows"]}
    # One record per question; the full cache answers most (the small model misses some).
    assert rows["full"]["n"] == 3 and rows["full"]["correct"] >= 2
    assert rows["kvzip-global"]["n"] == 3 and rows["kvzip-global"]["kv_fraction"] < 0.7
    records = doc["records"]
    assert {r["mode"] for r in records} == {"agnostic"} and all(r["output"] for r in records)
    assert len({r["answer"] for r in records}) == 3
