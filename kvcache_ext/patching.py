"""``kvcache_ext.patch(model, policy)``: an HF causal LM that evicts into a ragged KV cache.

Uses transformers' public extension points only: an attention function registered with
``AttentionInterface`` (and the matching mask function with ``AttentionMaskInterface``), and
``RaggedCache``, a ``Cache`` subclass that ``generate`` receives for every call.
"""
from __future__ import annotations

import inspect

import weakref

from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvcache_ext.cache import RaggedCache, enter_patched_forward, exit_patched_forward, take_pending
from kvcache_ext.layer_kv import check_page_size
from kvcache_ext.eviction import layer_forward
from kvcache_ext.policies.policy import ModelShape, Policy

SUPPORTED_MODELS = ("llama", "mistral", "qwen2", "qwen3")
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


class PatchHandle:
    """What ``patch`` returns; also a context manager that unpatches on exit."""

    def __init__(self, model, policy: Policy, original_attn: str, page_size: int = 16):
        self.model, self.policy, self.original_attn = model, policy, original_attn
        self.page_size = page_size
        self.shape = ModelShape.of(model)
        self._last_cache = None
        self._hooks = []

    @property
    def num_layers(self) -> int:
        return self.model.config.get_text_config().num_hidden_layers

    def new_cache(self, reference: bool = False) -> RaggedCache:
        """A fresh cache for this model and policy. ``reference=True``: the reference path's
        dense masked cache (``kvcache_ext.reference.masked_cache.MaskedCache``)."""
        if reference:
            from kvcache_ext.reference.masked_cache import MaskedCache
            return MaskedCache(self.policy, self.num_layers)
        return RaggedCache(self.policy, self.num_layers, page_size=self.page_size)

    @property
    def last_cache(self) -> RaggedCache | None:
        """The cache of the latest ``generate`` call, while something else still holds it."""
        return self._last_cache() if self._last_cache is not None else None

    def unpatch(self) -> None:
        unpatch(self.model)

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        if getattr(self.model, _HANDLE_ATTR, None) is self:
            unpatch(self.model)


def patch(model, policy: Policy, *, page_size: int = 16) -> PatchHandle:
    """Makes ``model`` (an HF Llama, Mistral, Qwen2 or Qwen3 causal LM) evict with ``policy``.

    ``model.generate`` then runs with a fresh ``RaggedCache`` per call; ``model(...)`` does
    too when given ``past_key_values=handle.new_cache()``. Without such a cache the model
    runs its own attention. Patching a patched model replaces its policy. ``page_size``:
    tokens per page of the caches' stores (see ``RaggedCache``).
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a kvcache_ext.policies.Policy, got {type(policy).__name__}")
    check_page_size(page_size)
    config = getattr(model, "config", None)
    model_type = getattr(config.get_text_config() if config is not None else None, "model_type", None)
    if model_type not in SUPPORTED_MODELS:
        raise ValueError(f"kvcache_ext.patch supports the model types {', '.join(SUPPORTED_MODELS)}; "
                         f"got {model_type!r} ({type(model).__name__})")
    if not hasattr(model, "generate") or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"kvcache_ext.patch needs an HF PreTrainedModel, got {type(model).__name__}")
    # Everything the engine would refuse later is refused now, before the model changes.
    policy.check(ModelShape.of(model))
    if getattr(model, _HANDLE_ATTR, None) is not None:
        unpatch(model)
    _register()
    original = config._attn_implementation
    dense = original if original in DENSE else "sdpa"
    handle = PatchHandle(model, policy, original, page_size)
    model.set_attn_implementation(f"kvcache_ext_{dense}")
    _hook_forwards(handle)

    prepare = model._prepare_cache_for_generation   # bound method of the class
    # transformers >= 5.24 calls the cache argument `cache` (`past_key_values` before).
    key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"

    def _prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs):
        if (model_kwargs.get(key) is None and generation_config.use_cache is not False
                and generation_config.cache_implementation is None):
            cache = handle.new_cache()
            model_kwargs[key] = cache
            handle._last_cache = weakref.ref(cache)
        return prepare(generation_config, model_kwargs, *args, **kwargs)

    model._prepare_cache_for_generation = _prepare_cache_for_generation
    setattr(model, _HANDLE_ATTR, handle)
    return handle


def _hook_forwards(handle: PatchHandle) -> None:
    """Hooks the model's forward (and its decoder's, which may be called alone): a RaggedCache
    given to it is checked against the model before anything runs, and the cache's layers know
    that a patched model is running (a cache that a model without the patch updates raises)."""
    shape = handle.shape

    def before(module, args, kwargs):
        enter_patched_forward()        # first: the always-called hook below undoes it on an error
        for value in list(kwargs.values()) + list(args):
            if isinstance(value, RaggedCache):
                value.check_model(shape)

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
    for hook in handle._hooks:
        hook.remove()
    handle._hooks.clear()
    delattr(model, _HANDLE_ATTR)


def is_patched(model) -> bool:
    return getattr(model, _HANDLE_ATTR, None) is not None
