"""A patched model's decode step in a CUDA graph: captured once per cache, replayed for every
later step (``kvcache_ext.patch(model, policy, cuda_graph=True)``).

Why. An eager decode step of an HF model is as long as the host's time to issue it, several
times its device work for a large model on a fast GPU (docs/gpu.md). A replay issues the whole
step at once.

What a step may be. The graph replays exactly the device work it captured, with the same
memory and every host value frozen, so it serves only steps that need no host decision: one
new token per row, with no sliding-window layer and no prompt held for reconstruction passes
(a policy that reads token ids has them noted by the patched model's hook, which runs at
every call, outside the step), over a cache whose every layer's decode step is its storage
call alone (``engine.decode.DecodeWork.in_storage``): a policy that never evicts while
decoding (one-shot SnapKV, Ada-SnapKV, KVzip, spans, ...), or one that evicts by a slot rule
under equal head budgets (H2O, StreamingLLM), whose eviction the storage runs every head at
once, over budget or not (a head within its budget keeps all), so that the step is the same
whatever the lengths and the host lengths after it are known: min(len + 1, budget). A policy
that evicts every few steps has two graphs, one per kind of step (``evicts_now``).

The layers run these steps through the engine's one decode path (``engine.decode.decode``),
handed the plan this graph made of their pages, the rows' positions taken from a buffer of the
graph's. Every other call runs eagerly, as without the option.

Around every run (``DecodeGraph.run_step``), on the host: the room for the new token is
checked in every layer (pages are never added inside a graph; generate's cache reserves them
for every new token up front, ``patch(reserve_new_tokens=True)``, and an evicting cache holds
pages for the tokens between two evictions; else ``reserve_ahead`` reserves more when they run
out), then the host side of the step (``GraphStorage.note_graph_step``), tokens seen and decode
steps advance. A graph is captured for one state of the storages (``GraphStorage.graph_key``;
the rows' newest positions and budget tensors the layers read) and batch; when that changes
(pages added, another batch) it is dropped, and the next steps warm up and capture again. The
first eligible step of a graph runs eagerly on the graph's stream (it fills the caches that
capture must find filled), the second is captured and replayed.

The graph's backend is the device's (``BACKENDS``): CUDA graphs on a CUDA device; a device
without one (the CPU) runs every step eagerly. tests/graph_emulator.py plays a backend on the
CPU with CUDA graphs' semantics (replays run the recorded ops on the same memory, host values
frozen), so that the CPU tests check what a replay would do.
"""
from __future__ import annotations

import functools
import inspect
import warnings
import weakref

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from kvcache_ext.engine.decode import work_of

# The room reserved, in tokens per (row, KV head), when a step finds none (a cache made
# without the sequence's length): every reservation makes new state, hence a new capture.
RESERVE_AHEAD = 256
# The keywords a decode step of generate passes besides its tokens, cache and mask, with the
# values a graph serves (anything else runs eagerly).
SERVED = {"use_cache": (True, None), "return_dict": (True, None), "output_attentions": (False, None),
          "output_hidden_states": (False, None), "logits_to_keep": (0, 1, None)}


def graph_forward(forward, cache_key: str):
    """``forward`` (a patched model's) that runs the decode steps a graph serves through the
    graph of their cache (``DecodeGraph``), every other call as it is. ``cache_key``: the
    keyword the model takes its cache under. It keeps ``forward``'s signature, which generate
    reads (to pass position_ids and the attention mask)."""
    first = next(iter(inspect.signature(forward).parameters), None)

    @functools.wraps(forward)
    def forward_in_graph(*args, **kwargs):
        cache = kwargs.get(cache_key, kwargs.get("past_key_values"))
        decode_graph = getattr(cache, "decode_graph", None)
        if decode_graph is None or kwargs.get("inputs_embeds") is not None:
            return forward(*args, **kwargs)
        if args:   # the tokens by position, as model(ids, ...) passes them
            if len(args) > 1 or first != "input_ids" or "input_ids" in kwargs:
                return forward(*args, **kwargs)
            kwargs = dict(kwargs, input_ids=args[0])
            args = ()
        rest = {name: value for name, value in kwargs.items()
                if name not in (cache_key, "past_key_values", "input_ids", "attention_mask", "position_ids",
                                "cache_position", "inputs_embeds")}
        logits = decode_graph().step(forward, cache_key, kwargs["input_ids"], kwargs.get("attention_mask"),
                                     kwargs.get("position_ids"), rest)
        if logits is None:
            return forward(*args, **kwargs)
        return CausalLMOutputWithPast(logits=logits, **{cache_key: cache})
    return forward_in_graph


class CudaGraphs:
    """Capture and replay with ``torch.cuda.CUDAGraph`` on a stream of the graph's own."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def warmup(self, step):
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = step()
        current.wait_stream(self.stream)
        out.record_stream(current)   # read there next: its memory is not the side stream's to reuse before
        return out

    def capture(self, step, hold):
        """Captures ``step`` (returns its output tensor); ``hold()`` runs on the capture stream
        right after, and what it returns lives as long as the graph. Returns ``replay()``,
        which runs the graph and returns the output tensor (the same tensor every time)."""
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.graph(graph, stream=self.stream):
            out = step()
        with torch.cuda.stream(self.stream):
            held = hold()
        return CapturedGraph(graph, out, held)


class CapturedGraph:
    """A captured step: calling it replays the graph and returns its output tensor."""

    def __init__(self, graph, out: torch.Tensor, held):
        self.graph, self.out, self.held = graph, out, held

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


BACKENDS = {"cuda": CudaGraphs}


class GraphInputs:
    """The buffers a captured step reads: the new tokens [B, 1] and their positions [B, 1]."""

    def __init__(self, input_ids: torch.Tensor):
        self.input_ids = torch.empty_like(input_ids)
        self.position_ids = torch.empty(input_ids.shape, dtype=torch.long, device=input_ids.device)

    def fill(self, input_ids: torch.Tensor, position_ids, seen: int) -> None:
        self.input_ids.copy_(input_ids)
        if position_ids is None:   # the model's own default: the cache's length onwards
            self.position_ids.fill_(seen)
        else:
            self.position_ids.copy_(position_ids.expand(self.position_ids.shape))


class DecodeGraph:
    """The decode step of one ``RaggedCache`` in a CUDA graph (the cache owns it:
    ``RaggedCache.decode_graph()``). ``warmups``, ``captures`` and ``replays`` count the steps
    it ran, ``eager_steps`` the calls it left to the eager forward (the prompt's included);
    ``declined`` says why the latest of those was not a graph step, ``failed`` why capture
    failed (then every later step is eager). ``evicts_now``: whether the step running now is
    one of the policy's eviction steps (each kind of step has a graph of its own)."""

    def __init__(self, cache):
        self._cache = weakref.ref(cache)   # the cache owns this graph (no cycle to wait on the collector)
        self.captures = self.replays = self.warmups = self.eager_steps = 0
        self.declined = None
        self.failed = None     # why capture failed on this cache (then every step runs eagerly)
        self._drop()

    def _drop(self) -> None:
        self._key = None       # what the graphs were captured for
        self._pinned = None    # the tensors whose ids the key holds (alive: no id reused)
        self._backend = None
        self._inputs = None
        self._plans = {}
        self._replays = {}     # kind of step (evicts_now) -> its captured graph
        self._warm = set()     # kinds of step warmed up
        self.evicts_now = False

    # --- the layers' view ---------------------------------------------------------------
    def plan(self, layer_idx: int) -> torch.Tensor:
        """The attention plan a layer's captured step attends with."""
        return self._plans[layer_idx]

    # --- which calls ------------------------------------------------------------------------
    def why_not(self, input_ids, attention_mask, kwargs) -> str | None:
        """None when this call is a step the graph serves, else why not (host checks, and one
        read of the newest mask column when a mask is given)."""
        if self.failed is not None:
            return self.failed
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] != 1:
            return "not one new token per row"
        backend = BACKENDS.get(input_ids.device.type)
        if backend is None:
            return f"no graphs on {input_ids.device.type}"
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor) or value not in SERVED.get(name, (None,)):
                return f"the argument {name}"
        layers = self._cache().layers
        every = layers[0].state.policy.schedule.decode_every   # the cache's policy, every layer's
        for layer in layers:
            state = layer.state
            if state.kv is None or not state.kv.graph_ready:
                return "a layer without its paged storage (before the prompt, or the reference's)"
            if state.window is not None or state.context is not None:
                return "a sliding-window layer, or a prompt held for reconstruction passes"
            if state.lookahead is not None:
                return "a prompt held whole until its deferred compression (Schedule lookahead)"
            if state.tokens[0] != input_ids.shape[0] or state.tokens[2] != input_ids.device:
                return "another batch or device than the cache's"
            for kind in (False, True) if every is not None else (False,):
                work = work_of(state, kind)
                if work.update_view:
                    return f"the policy {state.policy} updates its scorer's channels from a padded view"
                if work.evicts:
                    return (f"the policy {state.policy} evicts on a padded view (a scorer without a slot rule, "
                            "budgets split by the scores as Ada-KV's, a fractional budget)")
        if attention_mask is not None and not bool(attention_mask[:, -1].all()):
            return "a padding token among the new ones"
        return None

    # --- a step -------------------------------------------------------------------------------
    def step(self, forward, cache_key: str, input_ids, attention_mask, position_ids, kwargs):
        """A call of the patched model's ``forward``: the logits of a decode step the graph
        served, or None for the caller to run the call eagerly (counted in ``eager_steps``,
        why in ``declined``)."""
        self.declined = self.why_not(input_ids, attention_mask, kwargs)
        logits = None
        if self.declined is None:
            logits = self.run_step(forward, cache_key, input_ids, position_ids, kwargs)
        if logits is None:
            self.eager_steps += 1
        return logits

    def run_step(self, forward, cache_key: str, input_ids, position_ids, kwargs):
        """One decode step through the graph: warmed up, captured or replayed. Returns the
        logits [B, 1, V] (a tensor of the caller's)."""
        cache = self._cache()
        layers = [layer.state for layer in cache.layers]
        if not all(state.kv.has_room(1) for state in layers):
            extra = reserve_ahead(layers)
            for state in layers:
                state.kv.reserve(extra)
        key = (tuple(input_ids.shape), input_ids.device, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])),
               # the storages' state (the stores themselves held: an id could be reused by a later
               # store), and the tensors a captured step reads by address (pinned while the key lives)
               tuple((state.kv.graph_key(), id(state.last_pos), id(state.decode_budget)) for state in layers))
        if key != self._key:
            self._drop()
            self._key = key
            self._pinned = [(state.last_pos, state.decode_budget) for state in layers]
            self._backend = BACKENDS[input_ids.device.type](input_ids.device)
            self._inputs = GraphInputs(input_ids)
            self._plans = {state.layer_idx: state.kv.graph_plan(state.groups) for state in layers}
        every = layers[0].policy.schedule.decode_every
        kind = self.evicts_now = every is not None and (layers[0].decode_steps + 1) % every == 0
        self._inputs.fill(input_ids, position_ids, layers[0].seen)

        shared = layers[0].shared

        def forward_step():
            shared.enter_graph_step(self)
            try:
                arguments = dict(kwargs, input_ids=self._inputs.input_ids, position_ids=self._inputs.position_ids)
                arguments[cache_key] = cache
                return forward(**arguments).logits
            finally:
                shared.exit_graph_step()

        replay = self._replays.get(kind)
        if replay is not None:
            logits = replay()
            self.replays += 1
        elif kind not in self._warm:
            logits = self._backend.warmup(forward_step)
            self._warm.add(kind)
            self.warmups += 1
        else:
            try:
                replay = self._backend.capture(forward_step, hold=lambda: [s.kv.hold_for_graph() for s in layers])
            except Exception as error:   # noqa: BLE001  (the step then runs eagerly, as without graphs)
                self.failed = f"capture failed: {type(error).__name__}: {error}"
                warnings.warn(f"kvcache_ext: this cache's decode steps run without a CUDA graph ({self.failed})",
                              RuntimeWarning, stacklevel=3)
                self._drop()
                return None
            self._replays[kind] = replay
            self.captures += 1
            logits = replay()
        for state in layers:
            state.kv.note_graph_step(1, work_of(state, kind).step.evict)
            state.finish_decode_step()
        return logits.clone()


def reserve_ahead(layers) -> int:
    """The tokens per segment to reserve when a step finds no room: ``RESERVE_AHEAD`` for a
    cache that grows while decoding; for one that evicts every few steps, the steps between
    two evictions plus what the shortest head may still grow to its budget (at most
    ``RESERVE_AHEAD`` more), so that a cache held at its budget reserves no more than eager
    decoding holds (``release_prefill_slack``)."""
    every = layers[0].policy.schedule.decode_every
    if every is None:
        return RESERVE_AHEAD
    growth = max(int(state.decode_budget_host.max()) - int(state.kv.lens.min()) for state in layers)
    return every + min(max(growth, 0), RESERVE_AHEAD)
