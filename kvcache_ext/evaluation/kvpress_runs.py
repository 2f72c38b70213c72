"""kvpress's presses in the eval harness, on the same token sequences as ours.

A name ``kvpress-<press>`` runs kvpress's press around the dense prefill of the compressed part
(the whole prompt in aware mode, the context in agnostic mode) on HF's ``DynamicCache``, then
the question (agnostic) and the same greedy decode, with the positions given (kvpress's cache
drops the pruned tokens, so HF would number the next token from the kept count; kvpress's own
pipeline passes them too). Its KV bytes are what its cache holds after the press (the pruned
cache, or the full-size cache an Ada-KV press masks, with its masks), and its prefill time
includes the press's own work (KVzip's reconstruction passes). ``run_press`` is kvpress's
pipeline at one budget; ``run_press_budgets``, what the harness runs, gives the same at every
budget of a prompt from one prefill (and one set of KVzip's passes). On Gemma 3 both leave the
sliding-window layers whole, as kvpress does for its Gemma 3 model class.

kvpress (``pip install ".[bench]"``: kvpress 0.5.5, which needs transformers < 5.3) is imported
only when such a name runs. Importing it wraps every transformers attention function of the
process (a no-op for a module without kvpress's mask).
"""
from __future__ import annotations

import contextlib
import copy
import time
import types

import torch

KVPRESS_POLICIES = ("kvpress-snapkv", "kvpress-ada-snapkv", "kvpress-expected-attention",
                    "kvpress-ada-expected-attention", "kvpress-kvzip", "kvpress-tova", "kvpress-streamingllm",
                    "kvpress-knorm")
# The presses whose scores do not depend on their ratio: ``run_press_budgets`` scores them once
# for every budget (StreamingLLM's scores are its ratio's window, so it runs once per budget).
SCORED_ONCE = ("kvpress-snapkv", "kvpress-ada-snapkv", "kvpress-expected-attention",
               "kvpress-ada-expected-attention", "kvpress-kvzip", "kvpress-tova", "kvpress-knorm")
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
    None) and greedy decoding: kvpress's own pipeline, press and prefill together. Returns (new
    token ids, decode s/token, KV bytes, prefill s)."""
    from transformers import DynamicCache

    from kvcache_ext.cache_argument import with_cache
    n = context.shape[1]
    press = make_press(name, compression_ratio(budget, n))
    cache = DynamicCache(config=model.config)
    try:
        start = time.perf_counter()
        with _tokenizer_for(name, tokenizer), _sliding_layers_whole(press), press(model):
            logits = model(context, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]
        prefill_s = time.perf_counter() - start
        return (*_answer(model, tokenizer, cache, logits, n, question, max_new_tokens), prefill_s)
    finally:
        unmask(model)


@torch.no_grad()
def run_press_budgets(model, tokenizer, name: str, budgets, context: torch.Tensor,
                      question: torch.Tensor | None, max_new_tokens: int) -> list[tuple]:
    """``run_press`` at every budget of ``budgets`` from one prefill (and, for KVzip, one set of
    reconstruction passes): one tuple per budget, in order. A press of ``SCORED_ONCE`` only;
    another runs ``run_press`` per budget.

    A press's scores do not depend on its ratio, and kvpress compresses a layer's cache only
    after that layer's attention ran, so its prefill computes what a dense prefill does. The
    prefill runs once with the press's scoring only: a scorer press (and Ada-KV over one) keeps
    each layer's scores and leaves the cache whole; KVzip keeps its scores of every layer
    instead of pruning. Then, per budget, a copy of the whole cache is compressed by the press's
    own code at that ratio (a scorer press's ``compress`` on the kept scores, KVzip's
    ``compress_post``), and the question and the decode run over it. Each tuple's prefill time
    is the shared prefill's."""
    from transformers import DynamicCache

    from kvcache_ext.cache_argument import with_cache
    if name not in SCORED_ONCE:
        return [run_press(model, tokenizer, name, b, context, question, max_new_tokens) for b in budgets]
    n = context.shape[1]
    ratios = [compression_ratio(b, n) for b in budgets]
    # Built at any ratio above 0: kvpress skips the scoring at 0 (KVzip its passes); each
    # budget's own ratio is set before its compression.
    press = make_press(name, 0.5)
    replay = _KVzipReplay(press) if name == "kvpress-kvzip" else _ScorerReplay(press)
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    with _tokenizer_for(name, tokenizer), replay.scoring(), _sliding_layers_whole(press), press(model):
        logits = model(context, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]
    prefill_s = time.perf_counter() - start
    out = []
    for ratio in ratios:
        pressed = copy.deepcopy(cache)
        try:
            replay.compress(model, pressed, ratio)
            out.append((*_answer(model, tokenizer, pressed, logits, n, question, max_new_tokens), prefill_s))
        finally:
            unmask(model)
    return out


class _ScorerReplay:
    """A scorer press (or ``AdaKVPress`` over one) scored once, compressed at any ratio."""

    def __init__(self, press):
        self.press = press
        self.scorer = getattr(press, "press", press)   # AdaKVPress scores with the press it wraps
        self.scores = {}                                # layer index -> [1, H, n]

    def scoring(self):
        """Inside: the press's hook keeps each layer's scores and returns its cache whole."""
        def keep_scores(module, hidden_states, keys, values, attentions, kwargs):
            self.scores[module.layer_idx] = self.scorer.score(module, hidden_states, keys, values, attentions, kwargs)
            return keys, values
        return _instead(self.press, "compress", keep_scores)

    def compress(self, model, cache, ratio: float) -> None:
        """Compresses ``cache`` as the press's hook does at ``ratio``, from the kept scores."""
        self.press.compression_ratio = ratio
        for layer in model.model.layers:
            module = layer.self_attn
            if _sliding(module):
                continue
            scores = self.scores[module.layer_idx]
            kept = cache.layers[module.layer_idx]
            # A copy each time: Ada-KV's compress writes into the scores.
            with _instead(self.scorer, "score", lambda *args, scores=scores: scores.clone()):
                kept.keys, kept.values = self.press.compress(module, None, kept.keys, kept.values, None, {})


class _KVzipReplay:
    """kvpress's KVzip: its passes run once, its selection (``compress_post``) once per ratio."""

    def __init__(self, press):
        self.press = press
        self.scores = None   # [L, 1, H, n]: KVzip's scores after the passes

    def scoring(self):
        """Inside: KVzip's passes keep their scores instead of masking the layers."""
        def keep_scores(model):
            self.scores = self.press.score_val.clone()
        return _instead(self.press, "compress_post", keep_scores)

    def compress(self, model, cache, ratio: float) -> None:
        """Masks the layers as KVzip does at ``ratio`` (its masks cover ``cache``'s context)."""
        self.press.compression_ratio = ratio
        self.press.score_val = self.scores.clone()
        type(self.press).compress_post(self.press, model)


@contextlib.contextmanager
def _instead(obj, name: str, value):
    """Inside: ``obj.name`` is ``value``, an attribute of the instance over its class's method."""
    setattr(obj, name, value)
    try:
        yield
    finally:
        delattr(obj, name)


def _sliding(module) -> bool:
    """Whether ``module`` attends over a sliding window (Gemma 3's local layers)."""
    return bool(getattr(module, "is_sliding", False))


def _sliding_layers_whole(press):
    """Inside: the press's hook leaves the sliding-window layers' caches as they are. kvpress
    compresses only the global layers of Gemma 3, but tests for that on
    ``Gemma3ForConditionalGeneration`` alone; on ``Gemma3ForCausalLM`` its hook prunes a
    sliding layer's window too, and the next forward's mask no longer fits that layer. (A press
    without a layer hook is left as it is: kvpress's KVzip refuses Gemma 3 itself.)"""
    hook = getattr(press, "forward_hook", None)
    if hook is None:
        return contextlib.nullcontext()

    def global_layers_only(module, args, kwargs, output):
        return output if _sliding(module) else hook(module, args, kwargs, output)
    return _instead(press, "forward_hook", global_layers_only)


def _tokenizer_for(name: str, tokenizer):
    return kvzip_tokenizer(tokenizer) if name == "kvpress-kvzip" else contextlib.nullcontext()


def _answer(model, tokenizer, cache, logits, seen: int, question, max_new_tokens: int):
    """(new token ids, decode s/token, KV bytes) after a press: ``question`` (or None) over
    ``cache``, then greedy decoding, with the positions given (the pruned cache no longer
    counts the pruned tokens)."""
    from kvcache_ext.cache_argument import with_cache
    from kvcache_ext.evaluation.decoding import cache_bytes
    if question is not None:
        positions = torch.arange(seen, seen + question.shape[1], device=question.device)[None]
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
    return new, decode_s, cache_bytes(cache) + mask_bytes(model)
