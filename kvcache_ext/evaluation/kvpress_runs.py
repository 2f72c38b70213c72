"""kvpress's presses in the eval harness, on the same token sequences as ours.

A name ``kvpress-<press>`` runs kvpress's press around the dense prefill of the compressed part
(the whole prompt in aware mode, the context in agnostic mode) on HF's ``DynamicCache``, then
the question (agnostic) and the same greedy decode, with the positions given (kvpress's cache
drops the pruned tokens, so HF would number the next token from the kept count; kvpress's own
pipeline passes them too). Its KV bytes are what its cache holds after the press (the pruned
cache, or the full-size cache an Ada-KV press masks, with its masks), and its prefill time
includes the press's own work (KVzip's reconstruction passes).

kvpress (``pip install ".[bench]"``: kvpress 0.5.5, which needs transformers < 5.3) is imported
only when such a name runs. Importing it wraps every transformers attention function of the
process (a no-op for a module without kvpress's mask).
"""
from __future__ import annotations

import contextlib
import time
import types

import torch

KVPRESS_POLICIES = ("kvpress-snapkv", "kvpress-ada-snapkv", "kvpress-expected-attention",
                    "kvpress-ada-expected-attention", "kvpress-kvzip", "kvpress-tova", "kvpress-streamingllm",
                    "kvpress-knorm")
INSTALL_KVPRESS = 'pip install ".[bench]" (kvpress 0.5.5, which needs transformers<5.3)'


def kvpress_missing() -> str | None:
    """Why kvpress's presses cannot run in this process (None: they can): kvpress does not import,
    or the transformers here is outside the range its package declares (kvpress 0.5.5 imports
    with transformers 5.24 but its hooks fail there on the first forward)."""
    try:
        import kvpress  # noqa: F401
    except Exception as err:   # not installed, or not importable with this transformers
        return f"kvpress cannot be imported ({type(err).__name__}: {err}); {INSTALL_KVPRESS}"
    unmet = _unmet_transformers_requirement()
    return f"{unmet}; {INSTALL_KVPRESS}" if unmet else None


def _unmet_transformers_requirement() -> str | None:
    """kvpress's declared transformers requirement when the installed transformers misses it."""
    from importlib import metadata
    try:
        requires = metadata.requires("kvpress") or []
        from packaging.requirements import Requirement
    except (metadata.PackageNotFoundError, ImportError):   # a kvpress without metadata: nothing declared
        return None
    installed = metadata.version("transformers")
    for line in requires:
        req = Requirement(line)
        if req.name == "transformers" and (req.marker is None or req.marker.evaluate({"extra": ""})) \
                and not req.specifier.contains(installed, prereleases=True):
            return (f"kvpress {metadata.version('kvpress')} requires transformers{req.specifier}, "
                    f"but transformers {installed} is installed")
    return None


def make_press(name: str, ratio: float):
    """kvpress's press ``name`` (one of ``KVPRESS_POLICIES``) at ``compression_ratio=ratio``."""
    import kvpress as kp
    presses = {
        "kvpress-snapkv": lambda: kp.SnapKVPress(compression_ratio=ratio),
        "kvpress-ada-snapkv": lambda: kp.AdaKVPress(kp.SnapKVPress(compression_ratio=ratio)),
        "kvpress-expected-attention": lambda: kp.ExpectedAttentionPress(compression_ratio=ratio),
        "kvpress-ada-expected-attention": lambda: kp.AdaKVPress(kp.ExpectedAttentionPress(compression_ratio=ratio)),
        "kvpress-kvzip": lambda: kp.KVzipPress(compression_ratio=ratio),
        "kvpress-tova": lambda: kp.TOVAPress(compression_ratio=ratio),
        "kvpress-streamingllm": lambda: kp.StreamingLLMPress(compression_ratio=ratio),
        "kvpress-knorm": lambda: kp.KnormPress(compression_ratio=ratio),
    }
    if name not in presses:
        raise ValueError(f"unknown kvpress policy {name!r}; known: {', '.join(KVPRESS_POLICIES)}")
    return presses[name]()


@contextlib.contextmanager
def kvzip_tokenizer(tokenizer):
    """KVzipPress loads the tokenizer by the model's name, which a GGUF model does not have:
    inside this block, its module's ``AutoTokenizer`` hands it ``tokenizer`` instead."""
    from kvpress.presses import kvzip_press
    loader = kvzip_press.AutoTokenizer
    kvzip_press.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *args, **kwargs: tokenizer)
    try:
        yield
    finally:
        kvzip_press.AutoTokenizer = loader


def compression_ratio(budget: int | float, length: int) -> float:
    """kvpress's ``compression_ratio`` keeping a fraction (float) of ``length`` tokens, or
    ``budget`` tokens (int). kvpress keeps ``int(length * (1 - ratio))``: for a token count,
    ``int(B + 0.5)`` is ``B``, where ``1 - B / length`` would often give ``B - 1`` by float error."""
    if isinstance(budget, float):
        return 1.0 - budget
    return max(0.0, 1.0 - (budget + 0.5) / length)


def unmask(model) -> None:
    """AdaKVPress leaves its mask on the attention modules; the next run must not see it."""
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "masked_key_indices"):
            layer.self_attn.masked_key_indices = None


def mask_bytes(model) -> int:
    """Bytes of an Ada-KV press's masks: the (row, head, position) indices of the pruned keys."""
    return sum(t.nbytes for layer in model.model.layers
               for t in getattr(layer.self_attn, "masked_key_indices", None) or ())


@torch.no_grad()
def run_press(model, tokenizer, name: str, budget: int | float, context: torch.Tensor,
              question: torch.Tensor | None, max_new_tokens: int):
    """Press ``name`` keeping ``budget`` of ``context`` [1, n]; then ``question`` [1, m] (or
    None) and greedy decoding. Returns (new token ids, decode s/token, KV bytes, prefill s)."""
    from transformers import DynamicCache

    from kvcache_ext.evaluation.decoding import cache_bytes
    from kvcache_ext.cache_argument import with_cache
    n = context.shape[1]
    press = make_press(name, compression_ratio(budget, n))
    cache = DynamicCache(config=model.config)
    try:
        start = time.perf_counter()
        tokenizer_given = kvzip_tokenizer(tokenizer) if name == "kvpress-kvzip" else contextlib.nullcontext()
        with tokenizer_given, press(model):
            logits = model(context, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]
        prefill_s = time.perf_counter() - start
        seen = n
        if question is not None:
            positions = torch.arange(seen, seen + question.shape[1], device=context.device)[None]
            logits = model(question, **with_cache(model, cache), use_cache=True, position_ids=positions).logits[:, -1]
            seen += question.shape[1]
        token = logits.argmax(dim=-1, keepdim=True)
        new = [int(token)]
        eos = tokenizer.eos_token_id
        start = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            if eos is not None and new[-1] == eos:
                break
            position = torch.full_like(token, seen)
            token = model(token, **with_cache(model, cache), use_cache=True,
                          position_ids=position).logits[:, -1].argmax(dim=-1, keepdim=True)
            seen += 1
            new.append(int(token))
        decode_s = (time.perf_counter() - start) / max(len(new) - 1, 1)
        held = cache_bytes(cache) + mask_bytes(model)
    finally:
        unmask(model)
    return new, decode_s, held, prefill_s
