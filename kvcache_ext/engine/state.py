"""What one layer of an engine cache knows besides its tokens (``LayerState``), and what the
layers of one cache share (``SharedByLayers``).

Each field is declared here and written only by these classes' methods, which the engine
(``eviction``, ``prompt``, ``reconstruction``) calls; the cache (``hf.cache.RaggedCache``) makes
one state per layer and hands them the model's parts and the sequence length it knows of. A
scorer sees none of this: it gets views (``policies.views``) with its own two places for state.
"""
from __future__ import annotations

import torch

from kvcache_ext.cache_argument import EITHER_NAME
from kvcache_ext.policies.policy import Policy
from kvcache_ext.policies.token_ids import TokenIds
from kvcache_ext.policies.views import ModelParts


class StepValidity:
    """Which new tokens of a decode step are real, read once per step for every layer: HF hands
    every layer of a step the same mask, so the first layer's answer serves the others (one host
    sync per step, not one per layer). The engine's own memo: scorers never see it."""

    __slots__ = ("_mask", "_key", "_answer")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self._mask = self._key = self._answer = None

    def get(self, mask: torch.Tensor, seen: int, device) -> tuple[torch.Tensor, bool] | None:
        """The answer for this mask at this step (``seen`` tokens before it, on ``device``), or None."""
        if self._mask is mask and self._key == (seen, device):
            return self._answer
        return None

    def put(self, mask: torch.Tensor, seen: int, device, valid: torch.Tensor, all_valid: bool) -> None:
        """Keeps one decode step's answer (a prompt's mask is large: it is not kept alive)."""
        self._mask, self._key, self._answer = mask, (seen, device), (valid, all_valid)


class SharedByLayers:
    """What the layers of one cache share; the cache makes one and hands it to every layer."""

    __slots__ = ("scorer_state", "step_validity", "token_ids", "graph_step")

    def __init__(self, token_ids: TokenIds | None = None):
        self.scorer_state: dict = {}               # the scorer's cross-layer state (views' cache_state)
        self.step_validity = StepValidity()        # the engine's per-step memo
        # the rows' token ids by position, noted by the patched model (a scorer's needs_token_ids)
        self.token_ids = TokenIds() if token_ids is None else token_ids
        # the decode graph whose step runs now (kvcache_ext.hf.decode_graph.DecodeGraph: each
        # layer's plan); None outside one. Set and cleared by that graph's run_step only.
        self.graph_step = None

    def enter_graph_step(self, graph) -> None:
        """The layers' next calls are the decode step ``graph`` captures or runs (``engine.decode``,
        handed the graph's plan)."""
        self.graph_step = graph

    def exit_graph_step(self) -> None:
        self.graph_step = None

    def clear(self) -> None:
        self.scorer_state.clear()
        self.step_validity.clear()
        self.token_ids.clear()

    def fork(self) -> "SharedByLayers":
        """What the layers of a fork of the cache share: the scorer's state and the token ids
        as they are now."""
        other = SharedByLayers(self.token_ids.copy())
        other.scorer_state.update(self.scorer_state)
        return other


class LayerState:
    """One layer of an engine cache: its storage, the tokens it has seen, its budgets, and
    what its policy's scorer keeps between calls.

    Constructed by the cache: ``policy``; ``storage``, what builds the layer's storage
    (``storage(batch, heads, head_dim, dtype, device, channels)``, a ``LayerStorage``); ``model``,
    the parts of the model its scorer may need (``ModelParts``); ``max_cache_len``, the longest
    sequence the cache will see (None: not known); ``shared``, what the cache's layers share.
    """

    __slots__ = (
        # fixed at construction
        "layer_idx", "num_layers", "policy", "storage", "model", "max_cache_len", "shared",
        # one sequence's, cleared by reset()
        "window",               # the layer's sliding window (HF's sliding_window; None: none)
        "kv",                   # the storage, made at the first call
        "layout",               # (KV heads, head dim, query heads per KV head) of the tokens it holds
        "tokens",               # (batch, dtype, device) of the tokens it holds
        "seen",                 # tokens seen, padding included: HF's sequence length
        "last_pos",             # [B] newest position of every row
        "budget",               # [B] this layer's per-head budget (prefill, block eviction)
        "decode_budget",        # [B] per-head budget of decode-time eviction
        "budget_host",          # host copies of the two: checked at every step without a sync
        "decode_budget_host",
        "decode_steps",         # decode steps seen
        "decode_works",         # what its decode steps do, by kind (engine.decode.DecodeWork), made once
        "context",              # a prompt held for reconstruction passes (reconstruction.Context)
        "lookahead",            # the queries of a compression deferred by lookahead (lookahead.Held)
        "scorer_state",         # the scorer's own state of this layer (views' layer_state)
    )

    def __init__(self, layer_idx: int, num_layers: int, policy: Policy, storage, *,
                 model: ModelParts | None = None, max_cache_len: int | None = None,
                 shared: SharedByLayers | None = None):
        self.layer_idx, self.num_layers = layer_idx, num_layers
        self.policy, self.storage = policy, storage
        self.model = ModelParts() if model is None else model
        self.max_cache_len = max_cache_len
        self.shared = SharedByLayers() if shared is None else shared
        self.scorer_state: dict = {}
        self.reset()

    def reset(self) -> None:
        """Forgets the sequence: the next call starts a fresh one (the layer 0 of a cache also
        empties what the layers share)."""
        self.kv = None
        self.window = None
        self.layout = self.tokens = None
        self.seen = 0
        self.last_pos = None
        self.budget = self.decode_budget = None
        self.budget_host = self.decode_budget_host = None
        self.decode_steps = 0
        self.decode_works = {}
        self.context = None
        self.lookahead = None
        self.scorer_state.clear()
        if self.layer_idx == 0:
            self.shared.clear()

    def fork(self, shared: SharedByLayers, max_cache_len: int | None) -> "LayerState":
        """A state that continues this layer's sequence on a fork of its storage (a shared
        prefix, ``RaggedCache.fork``): the tokens seen, budgets and scorer state as they are
        now, for a sequence whose longest length is ``max_cache_len``."""
        if self.context is not None:
            raise RuntimeError(f"layer {self.layer_idx} holds a prompt for reconstruction passes: score it "
                               "(handle.score_prompt) before forking the cache")
        if self.lookahead is not None:
            raise RuntimeError(f"layer {self.layer_idx} holds a whole prompt until its deferred compression "
                               "(Schedule lookahead): decode its lookahead steps before forking the cache")
        other = LayerState(self.layer_idx, self.num_layers, self.policy, self.storage, model=self.model,
                           max_cache_len=max_cache_len, shared=shared)
        other.note_window(self.window)
        other._continue(self)
        if other.kv is not None and max_cache_len:   # as after a prompt: pages for every token to come
            other.kv.trim(max(0, max_cache_len - other.seen))
        return other

    def _continue(self, source: "LayerState") -> None:
        """``fork``'s half on the new state: ``source``'s sequence, on a fork of its storage."""
        clone = lambda t: None if t is None else t.clone()   # noqa: E731
        self.kv = None if source.kv is None else source.kv.fork()
        self.layout, self.tokens, self.seen = source.layout, source.tokens, source.seen
        self.decode_steps = source.decode_steps
        self.last_pos, self.budget, self.decode_budget = clone(source.last_pos), clone(source.budget), \
            clone(source.decode_budget)
        self.budget_host, self.decode_budget_host = clone(source.budget_host), clone(source.decode_budget_host)
        self.scorer_state.update(source.scorer_state)

    @property
    def groups(self) -> int:
        """Query heads per KV head (G) of the tokens held."""
        return self.layout[2]

    # --- the sliding window ---------------------------------------------------------------
    def note_window(self, window) -> None:
        """The layer's sliding window as the model gives it at every call (HF's
        ``sliding_window``; None: the layer attends to every earlier token). A layer's window is
        its model's: fixed once noted."""
        if window is None or window == self.window:
            return
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"layer {self.layer_idx}: sliding_window must be a positive integer or None, "
                             f"got {window!r}")
        if self.window is not None:
            raise ValueError(f"layer {self.layer_idx}: sliding_window is {window}, but this cache's layer "
                             f"has a window of {self.window}: a cache serves one model; use a fresh one")
        self.window = window

    def window_start(self, newest: torch.Tensor) -> torch.Tensor:
        """[B] the oldest position that a query at position ``newest`` [B] sees in this layer:
        HF's sliding mask lets it see the keys at ``newest - window < position <= newest``."""
        return newest - self.window + 1

    # --- tokens ---------------------------------------------------------------------------
    def ensure_storage(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Makes the storage at the first call; checks later calls' tokens against it (before
        anything changes: a cache cannot take another model's or another batch's tokens)."""
        B, H, _, D = k.shape
        if self.kv is None:
            self.layout = (H, D, q.shape[1] // H)
            self.tokens = (B, k.dtype, k.device)
            self.kv = self.storage(B, H, D, k.dtype, k.device, self.policy.scorer.capabilities.channels)
            self.last_pos = torch.full((B,), -1, dtype=torch.long, device=k.device)
        elif (H, D, q.shape[1] // H) != self.layout or (B, k.dtype, k.device) != self.tokens:
            self.check_tokens(q, k)

    def check_tokens(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Raises ValueError naming what differs between new tokens and the ones held."""
        B, H, _, D = k.shape
        have_H, have_D, have_G = self.layout
        have_B, dtype, device = self.tokens
        if (H, D, q.shape[1] // H) != self.layout:
            raise ValueError(f"{EITHER_NAME}: layer {self.layer_idx} of this cache holds {have_H} KV heads of "
                             f"dimension {have_D} ({have_G} query heads each); the model gives {H} of dimension "
                             f"{D} ({q.shape[1] // H} each): a cache serves one model; use a fresh one")
        if B != have_B:
            raise ValueError(f"{EITHER_NAME}: layer {self.layer_idx} of this cache holds a batch of {have_B}; "
                             f"the input has a batch of {B} (a cache serves one batch; use a fresh one)")
        if (k.dtype, k.device) != (dtype, device):
            raise ValueError(f"{EITHER_NAME}: layer {self.layer_idx} of this cache holds {dtype} tokens on "
                             f"{device}; the model gives {k.dtype} on {k.device}: use a fresh cache")

    def check_positions(self, n: int) -> None:
        """Positions go on after eviction; the kernels hold them as int32."""
        if self.seen + n > 2**31 - 1:
            raise ValueError(f"layer {self.layer_idx}: the cache has seen {self.seen} tokens; {n} more "
                             "would take positions past 2^31 - 1, which the store cannot hold")

    def advance(self, n: int) -> None:
        """``n`` more tokens seen (padding included)."""
        self.seen += n

    def note_newest(self, newest: torch.Tensor) -> None:
        """[B] the newest position of each row among tokens just seen (-1: none), into the
        tensor the layer holds for its life (a captured decode step writes only tensors that
        outlive it, and a graph reads this one by address)."""
        torch.maximum(self.last_pos, newest, out=self.last_pos)

    def finish_decode_step(self) -> None:
        """A decode step ran: one more token seen, one more decode step."""
        self.seen += 1
        self.decode_steps += 1

    # --- the work of its decode steps -------------------------------------------------------
    def keep_decode_work(self, evict_now: bool, work):
        """Keeps what this layer's decode steps of a kind do (``engine.decode.DecodeWork``,
        made from the budgets: dropped when they change); returns it."""
        self.decode_works[evict_now] = work
        return work

    # --- budgets --------------------------------------------------------------------------
    def ensure_budget(self, prompt_len: torch.Tensor) -> None:
        """Fixes the layer's budgets from the first prompt's length [B]."""
        if self.budget is not None:
            return
        p = self.policy
        reserved = p.protection.size
        layer = lambda base, length: p.allocation.layer_budget(base, self.layer_idx, self.num_layers,   # noqa: E731
                                                               length, reserved)
        base = p.budget_for(prompt_len)
        budget = layer(base, prompt_len)
        # Decoding grows the cache past a short prompt: its budgets are not capped by the prompt.
        target = torch.full_like(prompt_len, p.schedule.decode_target) if p.schedule.decode_target else base
        decode_budget = layer(target, torch.maximum(prompt_len, 2 * target))
        self.set_budget(budget, decode_budget)

    def set_budget(self, budget: torch.Tensor, decode_budget: torch.Tensor | None = None) -> None:
        """The layer's per-head budget [B] (and decode-time budget, if given). Host copies (one
        sync, at prefill): "is every head within its budget?" is then asked of the store's host
        lengths at every step without touching the device."""
        self.budget, self.budget_host = budget, budget.cpu()
        if decode_budget is not None:
            self.decode_budget, self.decode_budget_host = decode_budget, decode_budget.cpu()
        self.decode_works = {}   # made again from these budgets

    def new_storage(self) -> None:
        """Replaces the storage by an empty one for the same tokens (a deferred compression,
        ``engine.lookahead``, stores its choice anew)."""
        B, dtype, device = self.tokens
        H, D, _ = self.layout
        self.kv = self.storage(B, H, D, dtype, device, self.policy.scorer.capabilities.channels)

    # --- the queries of a deferred compression ---------------------------------------------
    def hold_queries(self, held) -> None:
        """Keeps the queries of a compression deferred by lookahead (``lookahead.Held``)."""
        self.lookahead = held

    def release_queries(self):
        """The held queries, no longer held."""
        held, self.lookahead = self.lookahead, None
        return held

    # --- a prompt held for reconstruction passes ------------------------------------------
    def hold(self, context) -> None:
        """Keeps a prompt aside instead of compressing it (``reconstruction.Context``)."""
        self.context = context

    def release_context(self):
        """The held prompt, no longer held."""
        context, self.context = self.context, None
        return context
