"""bench/kvzip_vs_kvpress.py on the default model and a short prompt: our side holds exactly
the budget of every head of every layer (kvzip-global's one top-k) and reads the chat prefix
two ways; where kvpress imports (``pip install ".[bench]"``), kvpress's scores equal ours under
its reading of the prefix, and the kept entries differ only where the budgets differ."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kvzip_vs_kvpress  # noqa: E402
import kvcache_ext  # noqa: E402
from kvcache_ext.evaluation.named_policies import make_policy  # noqa: E402
from kvcache_ext.evaluation.retrieval import budget_tokens  # noqa: E402
from kvcache_ext.tasks import make_passkey_prompt  # noqa: E402

KEEP = 0.1


@pytest.fixture(scope="module")
def context(default_model):
    _, tokenizer = default_model
    prompt = make_passkey_prompt(tokenizer, 256, 0.5, seed=1)
    return prompt.input_ids[None, :prompt.haystack_end]


@pytest.fixture(scope="module")
def ours(default_model, context):
    model, tokenizer = default_model
    with torch.no_grad():
        return {name: kvzip_vs_kvpress.our_scores(model, tokenizer, context, KEEP, name)
                for name in ("rebuild", "drop")}


def test_ours_holds_the_budget_of_the_whole_model_exactly(default_model, context, ours):
    model, _ = default_model
    heads = model.config.num_hidden_layers * model.config.num_key_value_heads
    for scores, kept in ours.values():
        assert scores.shape == kept.shape == (model.config.num_hidden_layers, model.config.num_key_value_heads,
                                              context.shape[1])
        assert int(kept.sum()) == budget_tokens(KEEP, context.shape[1]) * heads
        assert bool(kept[..., :4].all())                                   # the sinks, in every head
    # The two readings score the prefix differently, so they score differently.
    assert not torch.allclose(ours["rebuild"][0], ours["drop"][0])


def test_the_default_skip_prefix_is_the_benchs_drop_reading(default_model, context, ours):
    """kvzip-global (KVzip(), whose skip_prefix is "chat") scores and keeps as the bench's wrapper
    of kvpress's reading does; the prompt opens with the patched model's "chat_prefix" tokens
    (24 on SmolLM2), so the default really skips them."""
    model, tokenizer = default_model
    with kvcache_ext.patch(model, make_policy("kvzip-global", 8), tokenizer=tokenizer) as handle:
        prefix = handle.tokens("chat_prefix")
    assert len(prefix) == 24 and context[0, :24].tolist() == prefix
    with torch.no_grad():
        scores, kept = kvzip_vs_kvpress.our_scores(model, tokenizer, context, KEEP, "rebuild", "kvzip-global")
    torch.testing.assert_close(scores, ours["drop"][0], atol=1e-6, rtol=1e-5)
    assert torch.equal(kept, ours["drop"][1])


def test_kvpress_scores_equal_ours_under_its_reading(default_model, context, ours):
    from kvcache_ext.evaluation.kvpress_runs import kvpress_missing
    if why := kvpress_missing():
        pytest.skip(why)
    model, tokenizer = default_model
    with torch.no_grad():
        theirs, theirs_kept = kvzip_vs_kvpress.kvpress_scores(model, tokenizer, context, KEEP)
    prefix = len(kvzip_vs_kvpress.chat_prefix(tokenizer))
    scores, kept = ours["drop"]
    torch.testing.assert_close(scores[..., prefix:], theirs[..., prefix:], atol=1e-4, rtol=1e-3)
    # kvpress keeps numel - int(0.95 numel) entries, ours budget x heads: only that many differ.
    assert int((kept ^ theirs_kept).sum()) <= abs(int(kept.sum()) - int(theirs_kept.sum())) + 4


def test_keep_outside_zero_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        kvzip_vs_kvpress.main(["--keep", "1.5"])
    assert "--keep must be in (0, 1), got 1.5" in capsys.readouterr().err
