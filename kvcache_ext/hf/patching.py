"""``kvcache_ext.patch(model, policy)``: an HF causal LM that evicts into a ragged KV cache.

Uses transformers' public extension points only: an attention function registered with
``AttentionInterface`` (and the matching mask function with ``AttentionMaskInterface``), and
``RaggedCache``, a ``Cache`` subclass that ``generate`` receives for every call.
"""
from __future__ import annotations

import functools
import inspect
import os
import warnings
import weakref

import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvcache_ext.kernels.attention import check_head_dim
from kvcache_ext.hf.cache import (MaskedCache, RaggedCache, enter_patched_forward, exit_patched_forward,
                                  take_pending)
from kvcache_ext.cache_argument import cache_argument
from kvcache_ext.hf import batching
from kvcache_ext.hf.decode_graph import graph_forward
from kvcache_ext.hf.call_token_ids import note_call_token_ids
from kvcache_ext.hf.tensor_parallel import model_shape, ranks_of
from kvcache_ext.hf.shared_prefix import SharedPrefix, SharedPrefixes, compress_prefix, prefix_ids
from kvcache_ext import checks
from kvcache_ext.checks import boolean, check_page_size
from kvcache_ext.engine.forward import layer_forward
from kvcache_ext.engine.state import LayerState
from kvcache_ext.policies.policy import Policy
from kvcache_ext.policies.token_kinds import TokenKinds
from kvcache_ext.policies.views import ModelParts
from kvcache_ext.hf.reconstruction import PromptTokens, check_tokenizer, score_after_forward, score_prompt

SUPPORTED_MODELS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text",
                    # attention as one of the above (tests/test_more_models.py)
                    "gemma", "granite", "ministral", "mixtral", "olmo", "olmo2", "qwen2_moe", "qwen3_moe",
                    "starcoder2")
# The model's own dense attention runs the prefill; each gets its own registered name so that
# HF builds the mask that attention expects (bool for SDPA, additive float for eager).
DENSE = ("sdpa", "eager")
_HANDLE_ATTR = "_kvcache_ext_handle"


def _eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """HF's eager attention (each model file has the same one; this is Llama's)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward
    return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                   dropout=dropout, **kwargs)


def _dense_function(name: str):
    return _eager if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]


def _make_attention(dense_name: str):
    # SDPA's argument order (dropout before scaling): HF passes both by name, but wrappers
    # that other libraries put around every attention function (kvpress's) pass dropout by
    # position.
    def kvcache_ext_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        dense = _dense_function(dense_name)
        state = take_pending(key)
        if state is None:   # no cache, or a cache that is not ours: the model's own attention
            return dense(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        if not isinstance(state, LayerState):   # a continuous-batching step's layer: every request's tokens
            return state.attend(dense, module, query, key, value, scaling, kwargs.get("sliding_window")), None
        position_ids = kwargs.pop("position_ids", None)
        out = layer_forward(state, dense, module, query, key, value, attention_mask, scaling,
                            position_ids, **kwargs)
        return out, None
    return kvcache_ext_attention


def _register() -> None:
    for dense in DENSE:
        name = f"kvcache_ext_{dense}"
        if name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(name, _make_attention(dense))
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[dense])


def model_parts(model, tokenizer=None) -> ModelParts:
    """What a patched HF causal LM hands its scorers: its rotary embedding (``rotary_emb``), its
    tokenizer's token kinds when given the tokenizer (for spans), and the tensor-parallel ranks
    its heads are split over (``hf.tensor_parallel``; None in one process)."""
    return ModelParts(rotary=getattr(getattr(model, "model", None), "rotary_emb", None),
                      token_kinds=TokenKinds.of(tokenizer) if tokenizer is not None else None,
                      ranks=ranks_of(model))


class PatchHandle:
    """What ``patch`` returns; also a context manager that unpatches on exit."""

    def __init__(self, model, policy: Policy, original_attn: str, page_size: int = 16, tokenizer=None,
                 reserve_new_tokens: bool = True, cuda_graph: bool = False, kv_dtype: torch.dtype | None = None):
        self.model, self.policy, self.original_attn = model, policy, original_attn
        self.page_size, self.tokenizer, self.kv_dtype = page_size, tokenizer, kv_dtype
        self.reserve_new_tokens, self.cuda_graph = reserve_new_tokens, cuda_graph
        # what the caches hand the scorers (the token kinds only to a policy that reads token ids)
        self.model_parts = model_parts(model, tokenizer if policy.scorer.capabilities.needs_token_ids else None)
        self.tokens = PromptTokens(tokenizer)    # tokens(text): a ReconstructionScorer's instructions
        self.shape = model_shape(model)   # this rank's heads under tensor parallelism
        self._last_cache = None
        self._last_batching = None
        self._hooks = []
        self.prefixes = SharedPrefixes()         # share_prefix's: read by the serving engine

    def score_prompt(self, cache: RaggedCache, input_ids, attention_mask=None, scores=None):
        """Runs the reconstruction passes of a scorer that needs them (KVzip) on a cache that
        holds the dense prompt ``input_ids`` and compresses it; returns the scores per layer
        (None when the cache awaits nothing). ``scores``: the scores of an earlier run on this
        prompt, used instead of running the passes again. The patched model runs them itself
        after a prompt (``kvcache_ext.hf.reconstruction.score_prompt``)."""
        forward = getattr(self.model, "_kvcache_ext_forward", self.model.forward)
        return score_prompt(forward, cache, input_ids, attention_mask, self.tokens, scores)

    def share_prefix(self, token_ids) -> SharedPrefix:
        """Compresses ``token_ids`` (a list or 1-D tensor of token ids) once with this policy
        and shares it: the serving engine (``generate_batch``, ``kvcache-ext serve``) serves
        every later request whose prompt starts with these tokens and goes on past them over
        this compressed prefix, read in place, as if the request had its own copy; for
        ``generate``, pass ``prefix.fork()`` as its cache (``kvcache_ext.with_cache``) with the
        whole prompt (``kvcache_ext.hf.shared_prefix``). The policy must have a one-shot schedule.
        Returns the ``SharedPrefix``; ``unshare_prefix`` stops sharing it."""
        self.prefixes.check_new(prefix_ids(token_ids))
        prefix = compress_prefix(self, token_ids)
        self.prefixes.add(prefix)
        return prefix

    def unshare_prefix(self, prefix: SharedPrefix) -> None:
        """No later request is served over ``prefix``; requests reading it go on."""
        self.prefixes.remove(prefix)

    @property
    def num_layers(self) -> int:
        return self.model.config.get_text_config().num_hidden_layers

    def new_cache(self, reference: bool = False, max_cache_len: int | None = None) -> RaggedCache:
        """A fresh cache for this model and policy. ``reference=True``: the reference path's
        dense masked cache (``kvcache_ext.hf.cache.MaskedCache``).
        ``max_cache_len``: the longest sequence it will see, prompt included (see ``RaggedCache``)."""
        if reference:
            return MaskedCache(self.policy, self.num_layers, model=self.model_parts, max_cache_len=max_cache_len,
                               kv_dtype=self.kv_dtype)
        return RaggedCache(self.policy, self.num_layers, page_size=self.page_size, model=self.model_parts,
                           max_cache_len=max_cache_len, kv_dtype=self.kv_dtype)

    @property
    def last_cache(self) -> RaggedCache | None:
        """The cache of the latest ``generate`` call, while something else still holds it."""
        return self._last_cache() if self._last_cache is not None else None

    def remember_cache(self, cache: RaggedCache) -> None:
        """``last_cache`` is now ``cache`` (held weakly)."""
        self._last_cache = weakref.ref(cache)

    @property
    def last_batching(self):
        """The continuous batching manager that ``init_continuous_batching`` made last
        (``kvcache_ext.serving.RaggedBatchingManager``), while something else still holds it."""
        return self._last_batching() if self._last_batching is not None else None

    def remember_batching(self, manager) -> None:
        """``last_batching`` is now ``manager`` (held weakly)."""
        self._last_batching = weakref.ref(manager)

    def unpatch(self) -> None:
        unpatch(self.model)

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        if getattr(self.model, _HANDLE_ATTR, None) is self:
            unpatch(self.model)


def patch(model, policy: Policy, *, page_size: int = 16, tokenizer=None,
          reserve_new_tokens: bool = True, cuda_graph: bool = False, kv_dtype: torch.dtype | str | None = None
          ) -> PatchHandle:
    """Makes ``model`` (an HF causal LM of a type in ``SUPPORTED_MODELS``: Llama, Mistral, Qwen2,
    Qwen3, Phi-3, Gemma 3, ...) evict with ``policy``.

    ``model.generate`` then runs with a fresh ``RaggedCache`` per call; ``model(...)`` does
    too when given ``past_key_values=handle.new_cache()``. Without such a cache the model
    runs its own attention. Patching a patched model replaces its policy. ``page_size``:
    tokens per page of the caches' stores (see ``RaggedCache``). ``tokenizer``: the model's,
    for a scorer that prompts the model itself (KVzip's instructions given as text).
    ``reserve_new_tokens``: ``generate``'s cache keeps pages for every token that
    ``max_new_tokens`` (or ``max_length``) allows as soon as the prompt is compressed, so that
    decoding allocates nothing (a cache that evicts while decoding keeps pages for the tokens
    between two evictions either way); False: pages are added as they fill up, and a
    generation that stops early holds less. ``cuda_graph``: on a CUDA device, the decode steps
    of a policy that never evicts while decoding (one-shot SnapKV, Ada-SnapKV, ...) are
    captured in a CUDA graph once per cache and replayed, so that a step costs the host almost
    nothing (``kvcache_ext.hf.decode_graph``: which steps, and what falls back to eager); every
    other call, and every call on the CPU, runs as without it. ``kv_dtype``: what the caches'
    pages hold, None (the model's dtype) or ``"int8"`` (``torch.int8``: K and V quantized
    per token and KV head, one float16 scale each: a quarter of float32's bytes, half of
    bfloat16's; ``RaggedKVStore``).
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a kvcache_ext.policies.Policy, got {type(policy).__name__}")
    check_page_size(page_size)
    reserve_new_tokens = boolean(reserve_new_tokens, "patch reserve_new_tokens")
    kv_dtype = checks.kv_dtype(kv_dtype, "patch kv_dtype")
    cuda_graph = boolean(cuda_graph, "patch cuda_graph")
    if tokenizer is not None and not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"patch tokenizer must be the model's tokenizer (with an encode method), "
                        f"got {type(tokenizer).__name__}")
    check_tokenizer(policy.scorer, tokenizer)
    if policy.scorer.capabilities.needs_token_ids and tokenizer is None:
        raise ValueError(f"patch tokenizer: None, but the policy's scorer {type(policy.scorer).__name__} keeps "
                         "whole spans (words, numbers: Spans), found from the tokens' text; pass the model's "
                         "tokenizer (patch(model, policy, tokenizer=...))")
    config = getattr(model, "config", None)
    model_type = getattr(config.get_text_config() if config is not None else None, "model_type", None)
    if model_type not in SUPPORTED_MODELS:
        raise ValueError(f"kvcache_ext.patch supports the model types {', '.join(SUPPORTED_MODELS)}; "
                         f"got {model_type!r} ({type(model).__name__})")
    if not hasattr(model, "generate") or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"kvcache_ext.patch needs an HF causal LM with generate (such as LlamaForCausalLM), "
                        f"got {type(model).__name__}")
    _check_cuda_head_dim(model)
    _check_architecture(model, policy)
    # Everything the engine would refuse later is refused now, before the model changes.
    policy.check(model_shape(model))
    if getattr(model, _HANDLE_ATTR, None) is not None:
        unpatch(model)
    _register()
    original = config._attn_implementation
    dense = original if original in DENSE else "sdpa"
    handle = PatchHandle(model, policy, original, page_size, tokenizer, reserve_new_tokens, cuda_graph, kv_dtype)
    model.set_attn_implementation(f"kvcache_ext_{dense}")
    _hook_forwards(handle)

    prepare = model._prepare_cache_for_generation   # bound method of the class
    key = cache_argument(type(model).forward)

    prepare_signature = inspect.signature(prepare)

    def _prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs):
        given, implementation = model_kwargs.get(key), generation_config.cache_implementation
        # Another cache runs the model's own attention over everything: say so, since the user
        # patched the model to evict (HF tutorials pass cache_implementation="static").
        other = None
        if given is not None and not isinstance(given, RaggedCache):
            other = f"a {type(given).__name__}"
        elif given is None and implementation is not None:
            other = f"cache_implementation={implementation!r}"
        if other is not None and generation_config.use_cache is not False:
            warnings.warn(f"kvcache_ext: this generate call was given {other}, so it keeps every token (the "
                          "patched model evicts only into a RaggedCache: leave the cache to generate, or pass "
                          "handle.new_cache())", UserWarning, stacklevel=_user_stacklevel())
        if given is None and implementation is None and generation_config.use_cache is not False:
            length = None
            if handle.reserve_new_tokens:   # generate's own bound on the sequence, prompt included
                length = prepare_signature.bind(generation_config, model_kwargs, *args, **kwargs) \
                    .arguments.get("max_cache_length")
            cache = handle.new_cache(max_cache_len=length or None)
            model_kwargs[key] = cache
            handle.remember_cache(cache)
        return prepare(generation_config, model_kwargs, *args, **kwargs)

    model._prepare_cache_for_generation = _prepare_cache_for_generation
    # Continuous batching (generate_batch, transformers serve): each request in a ragged cache.
    model.init_continuous_batching = functools.partial(_init_continuous_batching, model, handle)
    if policy.scorer.capabilities.reconstructs or cuda_graph:
        original = model.forward
        forward = original
        if policy.scorer.capabilities.reconstructs:   # its passes run when the prefilling forward returns
            forward = score_after_forward(forward, key, handle.tokens)
        if cuda_graph:   # decode steps through their cache's graph
            forward = graph_forward(forward, key)
        model._kvcache_ext_forward, model.forward = original, forward
    setattr(model, _HANDLE_ATTR, handle)
    return handle


def _init_continuous_batching(model, handle, *args, **kwargs):
    """A patched model's ``init_continuous_batching``: kvcache_ext.serving's manager (``hf.batching``)."""
    if handle.shape.ranks > 1:
        # The engine's admission counts the pages of every head, and its steps are one
        # process's: not yet across tensor-parallel ranks.
        raise NotImplementedError(f"kvcache_ext: continuous batching (generate_batch, serve) of a model whose "
                                  f"heads are split over {handle.shape.ranks} tensor-parallel ranks is not "
                                  "supported; use generate")
    if handle.policy.schedule.lookahead:
        # Its requests' steps run packed, outside the layer calls that hold the prompt's queries.
        raise NotImplementedError(f"kvcache_ext: continuous batching (generate_batch, serve) of a policy whose "
                                  f"compression waits for {handle.policy.schedule.lookahead} decode steps "
                                  "(Schedule lookahead) is not supported; use generate")
    manager = batching.manager(model, handle, *args, **kwargs)
    handle.remember_batching(manager)
    return manager


def _user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn``, called from the caller of this function, that
    points at the first frame outside transformers, torch and this package (the user's
    ``generate`` call): how many frames lie between differs between transformers versions."""
    inside = tuple(os.path.dirname(module.__file__) + os.sep for module in (transformers, torch))
    inside += (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
    frame, level = inspect.currentframe().f_back, 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _check_cuda_head_dim(model) -> None:
    """A model on CUDA must have a head_dim the CUDA attention kernel has: refused here rather
    than at its first decoding step."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    check_head_dim(head_dim, param.device)


def _check_architecture(model, policy: Policy) -> None:
    """What a supported model type may configure that the engine does not run: refused by name."""
    config = model.config
    text = config.get_text_config()
    if text.model_type == "gemma3_text" and config.model_type != "gemma3_text":
        raise ValueError(f"kvcache_ext.patch supports Gemma 3 as a text model (Gemma3ForCausalLM), got "
                         f"{type(model).__name__} (model_type {config.model_type!r}), whose image tokens "
                         "attend to each other both ways")
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError(f"kvcache_ext.patch needs causal attention; this {text.model_type} model's config "
                         "has use_bidirectional_attention=True")
    if text.model_type == "qwen2_moe" and "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        # Its sliding layers mask by window but do not tell the attention function their
        # window, which the engine needs to drop what falls out of it.
        raise ValueError("kvcache_ext.patch: this qwen2_moe model has sliding-window layers "
                         "(use_sliding_window=True), whose window its attention does not pass on; "
                         "supported with use_sliding_window=False")


def _hook_forwards(handle: PatchHandle) -> None:
    """Hooks the model's forward (and its decoder's, which may be called alone): a RaggedCache
    given to it is checked against the model before anything runs, and the cache's layers know
    that a patched model is running (a cache that a model without the patch updates raises)."""
    shape = handle.shape

    def before(module, args, kwargs):
        enter_patched_forward()        # first: the always-called hook below undoes it on an error
        for name, value in kwargs.items():
            if isinstance(value, RaggedCache):
                value.check_model(shape, name)      # named as the caller named it
        for value in args:
            if isinstance(value, RaggedCache):
                value.check_model(shape)
        if handle.policy.scorer.capabilities.needs_token_ids:   # the ids of the tokens to come, by position (Spanned)
            note_call_token_ids(module, args, kwargs)

    def after(module, args, kwargs, output):
        exit_patched_forward()

    modules = [handle.model]
    get_decoder = getattr(handle.model, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else None
    except Exception:   # noqa: BLE001  (a model without a separate decoder)
        decoder = None
    if decoder is not None and decoder is not handle.model:
        modules.append(decoder)
    for module in modules:
        handle._hooks.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handle._hooks.append(module.register_forward_hook(after, with_kwargs=True, always_call=True))


def unpatch(model) -> None:
    """Restores a patched model exactly: its attention implementation and ``generate``."""
    handle = getattr(model, _HANDLE_ATTR, None)
    if handle is None:
        raise ValueError("this model is not patched by kvcache_ext")
    model.set_attn_implementation(handle.original_attn)
    del model._prepare_cache_for_generation
    vars(model).pop("init_continuous_batching", None)
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if cached is not None and getattr(cached, "handle", None) is handle:
        model.destroy_cached_continuous_batching_manager()
    if "_kvcache_ext_forward" in vars(model):
        del model.forward, model._kvcache_ext_forward
    for hook in handle._hooks:
        hook.remove()
    handle._hooks.clear()
    delattr(model, _HANDLE_ATTR)


def is_patched(model) -> bool:
    return getattr(model, _HANDLE_ATTR, None) is not None


def handle_of(model) -> PatchHandle | None:
    """The PatchHandle of a patched model (None when it is not patched)."""
    return getattr(model, _HANDLE_ATTR, None)
