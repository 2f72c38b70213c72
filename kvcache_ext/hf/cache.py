"""RaggedCache: a transformers ``Cache`` whose layers keep only what the policy keeps."""
from __future__ import annotations

import contextlib
import functools

import threading

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcache_ext.cache_argument import EITHER_NAME
from kvcache_ext import checks
from kvcache_ext.checks import check_page_size, integer
from kvcache_ext.engine.forward import new_positions, new_token_validity
from kvcache_ext.engine.ragged_storage import RaggedLayerKV
from kvcache_ext.engine.state import LayerState, SharedByLayers
from kvcache_ext.policies.policy import ModelShape, Policy
from kvcache_ext.policies.token_ids import TokenIds
from kvcache_ext.policies.views import ModelParts
from kvcache_ext.reference.masked_cache import MaskedLayerKV

# The attention function finds its layer's state through the cache's update() that HF calls
# just before it (same thread, same key tensor): HF does not pass the cache to attention.
_pending = threading.local()
# How many forwards of patched models run in this thread (``patch`` hooks the model): a cache
# updated outside one belongs to a model whose attention would ignore it.
_forward = threading.local()

NOT_PATCHED = (f"{EITHER_NAME} is a kvcache_ext RaggedCache, but the model that uses it is not patched "
               "by kvcache_ext (never patched, or unpatched since): its own attention would ignore the "
               "cache and every token would be lost. Patch the model (kvcache_ext.patch(model, policy)) "
               "or give it a transformers cache")


def enter_patched_forward() -> None:
    _forward.depth = getattr(_forward, "depth", 0) + 1


def exit_patched_forward() -> None:
    _forward.depth = max(getattr(_forward, "depth", 0) - 1, 0)


@contextlib.contextmanager
def patched_forward():
    """Calls made by hand in the place of a patched model's forward (``cache.update`` then the
    patched attention function, as bench/memory.py replays them) count as one."""
    enter_patched_forward()
    try:
        yield
    finally:
        exit_patched_forward()


def set_pending(state, key: torch.Tensor) -> None:
    """What the attention function called next with ``key`` takes (``take_pending``): a layer's
    state, or any object with ``attend(dense, module, query, key, value, scaling, window)``
    returning the attention output (a continuous-batching step's layer: serving's
    ``PackedLayer``, whose attention splits the packed batch by request)."""
    _pending.entry = (state, key)


def take_pending(key: torch.Tensor):
    """The layer state (or packed layer) whose update() returned ``key``, or None (not our cache)."""
    entry = getattr(_pending, "entry", None)
    _pending.entry = None
    if entry is not None and entry[1] is key:
        return entry[0]
    return None


class RaggedLayer(CacheLayerMixin):
    """One layer of a RaggedCache. ``update`` stores nothing itself: the attention function
    appends the new tokens, attends over the store and evicts (``kvcache_ext.engine.forward``)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, state: LayerState):
        super().__init__()
        self.state = state

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def continue_from(self, layer: "RaggedLayer", shared: SharedByLayers, max_cache_len: int | None) -> None:
        """Takes ``layer``'s sequence on a fork of its storage (``RaggedCache.fork``)."""
        self.state = layer.state.fork(shared, max_cache_len)
        if layer.is_initialized:
            self.dtype, self.device, self.is_initialized = layer.dtype, layer.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        if not getattr(_forward, "depth", 0):
            raise RuntimeError(NOT_PATCHED)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        set_pending(self.state, key_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # transformers < 5.3 passes the new tokens' cache_position tensor instead of their count.
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.state.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens seen (padding included), not tokens kept: positions go on after eviction."""
        return self.state.seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:   # transformers < 5.3 asks for it (abstract there)
        return -1

    def reset(self) -> None:
        self.state.reset()

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("kvcache_ext's RaggedCache does not support beam search; "
                                  "use greedy or sampling generation")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state.seen:
            raise NotImplementedError("RaggedCache cannot expand a batch once tokens are cached")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("RaggedCache does not support selecting batch rows")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("RaggedCache cannot be cropped (assisted decoding is not supported)")


class RaggedCache(Cache):
    """The KV cache of a patched model: per layer, one ragged segment per (batch item, KV head)
    on that layer's device, holding only the tokens its policy keeps.

    ``generate`` on a patched model makes one for every call; build one yourself with
    ``handle.new_cache()`` (or ``RaggedCache(policy, num_layers)``) to run the model step by step.
    ``page_size``: tokens per page of the store (a power of two up to 1024), the unit by which
    a head's cache grows; a head holds its kept tokens rounded up to whole pages.
    ``max_cache_len``: the longest sequence this cache will see, its prompt and padding
    included (what ``generate`` computes as ``max_length - 1``; None: not known). With it, a
    cache that grows while decoding (a schedule without ``decode_every``) keeps pages for every
    token still to come as soon as its prompt is compressed, so decoding allocates nothing;
    tokens beyond it still fit (pages are added as they fill up). ``shrink_to_fit`` gives back
    what an early stop left unused. ``model``: the parts of the model its scorer may need
    (``kvcache_ext.policies.views.ModelParts``: the rotary embedding, for ExpectedAttention),
    which ``handle.new_cache()`` passes. ``kv_dtype``: what the pages hold, None (the model's
    dtype) or ``"int8"`` (``torch.int8``: K and V quantized per token and KV head with one
    float16 scale each, ``kvcache_ext.reference.quantize``).
    """

    storage = RaggedLayerKV

    def __init__(self, policy: Policy, num_layers: int, *, page_size: int = 16, model: ModelParts | None = None,
                 max_cache_len: int | None = None, kv_dtype: torch.dtype | str | None = None):
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a kvcache_ext.policies.Policy, got {type(policy).__name__}")
        num_layers = integer(num_layers, "RaggedCache num_layers", 1)
        if max_cache_len is not None:
            max_cache_len = integer(max_cache_len, "RaggedCache max_cache_len", 1)
        self.policy, self.page_size = policy, check_page_size(page_size)
        self.kv_dtype = checks.kv_dtype(kv_dtype, f"{type(self).__name__} kv_dtype")
        self._checked_for = None     # the ModelShape the policy was last checked against
        if model is not None and not isinstance(model, ModelParts):
            raise TypeError(f"RaggedCache model must be a kvcache_ext.policies.views.ModelParts (what "
                            f"handle.new_cache() passes), got {type(model).__name__}")
        shared = SharedByLayers()   # what the layers share: the scorer's cross-layer state, the engine's memo
        super().__init__(layers=[RaggedLayer(LayerState(i, num_layers, policy, self.storage_factory(), model=model,
                                                        max_cache_len=max_cache_len, shared=shared))
                                 for i in range(num_layers)])
        self._decode_graph = None   # made at the first decode step of a model patched with cuda_graph=True

    def decode_graph(self):
        """The CUDA graph of this cache's decode step (``kvcache_ext.hf.decode_graph.DecodeGraph``),
        made at first use: what a model patched with ``cuda_graph=True`` runs its decode steps
        through; its counts (``captures``, ``replays``, ``eager_steps``) say what they did."""
        if self._decode_graph is None:
            from kvcache_ext.hf.decode_graph import DecodeGraph
            self._decode_graph = DecodeGraph(self)
        return self._decode_graph

    def storage_factory(self):
        """What builds one layer's storage: ``factory(batch, heads, head_dim, dtype, device, channels)``."""
        return functools.partial(self.storage, page_size=self.page_size, kv_dtype=self.kv_dtype)

    def check_model(self, model: ModelShape, argument: str = EITHER_NAME) -> None:
        """Raises ValueError, before anything changes, when this cache cannot serve a model of
        this shape: another layer count, or (once it holds tokens) another KV head count, head
        dimension or number of query heads per KV head; or a policy the model cannot run. The
        patched model calls it at every forward that is given the cache, with the keyword the
        cache came under as ``argument``."""
        if len(self.layers) != model.num_layers:
            raise ValueError(f"{argument}: this {type(self).__name__} has {len(self.layers)} layers but "
                             f"the model has {model.num_layers}; make the cache for this model "
                             f"(handle.new_cache(), or {type(self).__name__}(policy, {model.num_layers}))")
        allocation = self.policy.allocation
        crosses = allocation.heads_across_ranks or allocation.layers_across_ranks
        if model.ranks > 1 and crosses and self.layers[0].state.model.ranks is None:
            # It would split each rank's budget over that rank's heads alone, silently.
            raise ValueError(f"{argument}: this {type(self).__name__} was made without the model's parts, but the "
                             f"model's heads are split over {model.ranks} tensor-parallel ranks and its allocation "
                             f"{allocation} splits over every rank's heads, which the cache must know: make it with "
                             "handle.new_cache()")
        want = (model.kv_heads, model.head_dim, model.groups)
        for layer in self.layers:
            state = layer.state
            if state.kv is not None and state.layout != want:
                H, D, G = state.layout
                raise ValueError(
                    f"{argument}: this {type(self).__name__} holds tokens of a model with {H} KV heads "
                    f"of dimension {D} and {G} query heads per KV head, but this model has "
                    f"{model.kv_heads} KV heads of dimension {model.head_dim} and {model.groups} query "
                    f"heads per KV head; use a fresh cache (handle.new_cache())")
        if self._checked_for != model:
            self.policy.check(model)
            self._checked_for = model

    def fork(self, max_cache_len: int | None = None) -> "RaggedCache":
        """A cache that continues this one's sequence without copying it: each layer reads the
        tokens this cache holds where they lie and keeps the tokens that come next in pages of
        its own (``RaggedKVStore.fork``; a head's partly filled last page is the one page
        copied). How requests share a compressed prefix (``kvcache_ext.serving``): the prefix
        compressed once, each request on a fork of it, as if it had its own copy.

        The tokens held now become read-only in both caches, so the policy must never write
        them again: a schedule that evicts over the cache (block-wise prefill, eviction while
        decoding) is refused, and so is a cache still holding a prompt for reconstruction
        passes. ``max_cache_len``: the longest sequence the fork will see (None: not known)."""
        if self.policy.schedule.evicts_over_cache:
            raise ValueError(f"RaggedCache.fork: the policy {self.policy} evicts over the cache (its schedule "
                             f"{self.policy.schedule}), which would write the tokens the two caches share; a "
                             "shared prefix needs a one-shot schedule (the prompt compressed once, then appended to)")
        other = type(self)(self.policy, len(self.layers), page_size=self.page_size,
                           model=self.layers[0].state.model, max_cache_len=max_cache_len, kv_dtype=self.kv_dtype)
        shared = self.layers[0].state.shared.fork()
        for layer, mine in zip(other.layers, self.layers):
            layer.continue_from(mine, shared, max_cache_len)
        return other

    def layer_kv(self, layer_idx: int):
        """The storage of one layer (``None`` before its first token)."""
        return self.layers[layer_idx].state.kv

    def kept_tokens(self) -> list[torch.Tensor]:
        """Per layer, [B, H] tokens held per (batch item, KV head)."""
        return [layer.state.kv.lens if layer.state.kv is not None else torch.zeros(0, dtype=torch.long)
                for layer in self.layers]

    @property
    def token_ids(self) -> TokenIds:
        """The token ids of this cache's rows by position (``TokenIds``), noted when its
        policy reads them (``note_token_ids``); emptied by ``reset()``."""
        return self.layers[0].state.shared.token_ids

    def note_token_ids(self, input_ids: torch.Tensor, attention_mask=None, position_ids=None) -> None:
        """Notes the ids of the tokens a call is about to add (``input_ids`` [B, n]) at the
        positions the engine will give them: ``position_ids`` when given, else this cache's
        length onwards; the tokens that ``attention_mask`` (2-D [B, seen + n], or HF's 4-D)
        marks as padding are not noted. The patched model calls it before each call when its
        policy reads token ids (``kvcache_ext.hf.call_token_ids``)."""
        if self.layers[0].state.shared.graph_step is not None:
            # A call inside a decode graph's step (its decoder's hook): the patched model's own
            # hook noted these ids before the step, outside it; a replay runs no Python.
            return
        B, n = input_ids.shape
        seen = self.get_seq_length()
        pos = new_positions(position_ids, seen, n, B, input_ids.device)
        last = seen + n - 1 if position_ids is None else int(pos.max()) if n else -1
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.shape[-1] >= n:
            valid = attention_mask[:, -n:].to(input_ids.device) != 0
        else:
            valid = new_token_validity(attention_mask, seen, n, B, input_ids.device)
        if n:
            self.token_ids.note(input_ids, pos, valid, last)

    @property
    def scorer_state(self) -> dict:
        """What its scorer keeps across the layers of this cache, for inspection (K-VEC's
        coverage counts: ``cache.scorer_state["kvec"]``); emptied by ``reset()``."""
        return self.layers[0].state.shared.scorer_state

    def shrink_to_fit(self) -> None:
        """Gives back every page that holds no token (free pages, and the pages reserved for
        the tokens to come); moves every token once. For when no more tokens will come."""
        for layer in self.layers:
            if layer.state.kv is not None:
                layer.state.kv.shrink_to_fit()

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's storage (K, V, positions, score channels, tables)."""
        return sum(layer.state.kv.nbytes for layer in self.layers if layer.state.kv is not None)

    def __repr__(self) -> str:
        kept = sum(int(t.sum()) for t in self.kept_tokens())
        return (f"{type(self).__name__}(layers={len(self.layers)}, seen={self.get_seq_length()}, "
                f"kept_tokens={kept}, nbytes={self.nbytes}, policy={self.policy})")


class MaskedCache(RaggedCache):
    """The reference path's cache: full-size dense K/V per layer, evicted tokens masked
    (``kvcache_ext.reference.masked_cache.MaskedLayerKV``). ``handle.new_cache(reference=True)``
    builds one; the tests compare the ragged path's logits with its."""

    storage = MaskedLayerKV

    def storage_factory(self):
        # A dense cache has no pages; with int8 it holds K and V as int8 pages give them back.
        return functools.partial(self.storage, kv_dtype=self.kv_dtype)
