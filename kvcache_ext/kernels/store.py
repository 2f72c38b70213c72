"""RaggedKVStore: the KV cache of one attention layer as one ragged segment per (batch item, KV head).

Who does what. The kernels are torch custom ops (``kvcache_ext.kernels.ops``: append, replace,
compact, top-k, attention, a decode step); this class calls them, and an eager decode step
enters the decode step op's function through one pybind call over the page allocator
(``_C.decode_step``: its host steps included). The compiled ``kvcache_ext._C.PageAllocator``
(csrc/store/page_allocator.h) is the host-side page allocator: it runs no kernel, it makes and
grows the state the ops take and keeps the pages' bookkeeping (which segment owns which page,
the free pages, the slabs, a host copy of the lengths). This class adds the defaults, the
argument checks, the padded views used by policies and tests, and selection on the store's own
layout.

The state, and who owns it. The state is three kinds of tensors on the store's device:
``pool`` (the slabs of pages), ``page_table`` and ``len``.

- The allocator makes them, and makes *new* ones (a new slab, a new page table) when it gives
  segments pages (``prepare_append``, ``reserve``) or moves every token (``repack``); its
  ``state_version`` counts those changes. Into the pages it writes only there (``repack``
  copies the live tokens into its new slab) and in ``set_scores`` (a policy's score channels).
- The ops write into them in place: the pages (append, replace, compact) and ``len`` (append,
  compact). ``finish_compact``, after the compaction op, only updates the allocator's host
  bookkeeping (host lengths, free pages): it makes no new tensor.
- This class holds the current ones (``_pool``, ``_table``, ``_len``) and passes them to every
  op. It takes them again from the allocator (``_take_state``) right after each call that may
  have made new ones: ``_refresh`` after ``prepare_append``, an eager decode step, ``reserve``,
  ``repack`` and ``shrink_to_fit`` (a plain version check in eager mode, a graph break under
  ``torch.compile``).
- Nothing else holds them: ``state()`` hands the tensors out for the ops only, and every
  accessor (``k``, ``len``, ``page_table``, ...) returns a copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext import _C, checks
from kvcache_ext.kernels.ops import STAT_NAMES, ops
from kvcache_ext.kernels.select import budget_tensor


# The statistics a channel can accumulate (one value per slot), by their index in STAT_NAMES.
_ACCUMULATED = {"mass": 0, "sum_sq": 2, "count": 3}


class DecodeCall:
    """A decode step's work on one store, checked once (``RaggedKVStore.decode_call``); calling
    it, ``call(q, k, v, pos, scale, valid=None, q_pos=None, plan=None)``, runs one step
    (``RaggedKVStore.decode_step``). What the engine's decode step of a layer hands its store at
    every step, so that the step itself checks and converts nothing of it again."""

    __slots__ = ("store", "stats", "flags", "codes", "rule", "sinks", "recent", "last_pos", "budget",
                 "budget_host")

    def __init__(self, store: "RaggedKVStore", stats, accumulate, rule, sinks, recent, last_pos, budget):
        for names, label in ((stats, "stats"), (accumulate, "accumulate")):
            if isinstance(names, str) or not isinstance(names, (tuple, list)):
                raise TypeError(f"{label} must be a tuple of statistic names from {STAT_NAMES}, got {names!r}")
            unknown = [name for name in names if name not in STAT_NAMES]
            if unknown:
                raise ValueError(f"{label} names unknown statistics {unknown}; choose from {STAT_NAMES}")
        if any(name not in _ACCUMULATED for name in accumulate):
            raise ValueError(f"accumulate names statistics of one value per slot, {tuple(_ACCUMULATED)}, got "
                             f"{tuple(accumulate)}")
        if len(accumulate) > store.score_channels:
            raise ValueError(f"accumulate names {len(accumulate)} channels but the store has "
                             f"{store.score_channels} score channels")
        self.store, self.stats = store, tuple(stats)
        self.flags = tuple(name in stats for name in STAT_NAMES)
        self.codes = [_ACCUMULATED[name] for name in accumulate]
        self.rule = rule
        self.sinks = self.recent = 0
        self.last_pos = self.budget = self.budget_host = None
        if rule is not None:
            if budget is None:
                raise ValueError("decode_step: an eviction by a rule needs budget=(k [S] on the store's device, "
                                 "k_host [S] on the host)")
            self.sinks = checks.integer(sinks, "sinks", 0)
            self.recent = checks.integer(recent, "recent", 0)
            self.last_pos = last_pos if self.recent else None
            k_device, k_host = budget
            self.budget = checks.tensor(k_device, "budget")
            self.budget_host = checks.tensor(k_host, "budget_host").reshape(-1).long()

    def __call__(self, q, k, v, pos, scale, valid=None, q_pos=None, plan=None) -> tuple[torch.Tensor, dict]:
        return self.store._decode(self, q, k, v, pos, scale, valid, q_pos, plan)


def _host(fn):
    """A host step (a call into the compiled page allocator, or a copy it makes): run by
    torch.compile as a graph break, not traced (dynamo cannot trace into pybind11)."""
    return torch.compiler.disable(fn, recursive=True)


@dataclass
class DenseView:
    """The store padded to [B, H, max_len, ...]; entries where `mask` is False are zero."""

    k: torch.Tensor       # [B, H, L, D]
    v: torch.Tensor       # [B, H, L, D]
    pos: torch.Tensor     # [B, H, L] int32
    scores: torch.Tensor  # [B, H, L, C] float32
    mask: torch.Tensor    # [B, H, L] bool, True on live slots
    lens: torch.Tensor    # [B, H] int64


class RaggedKVStore:
    """One layer's KV cache: segment s = b * heads + h holds the tokens kept for (b, h).

    Tokens live in pages of ``page_size`` tokens (K, V, the int32 absolute position and
    ``score_channels`` float32 scores that a policy owns, per token). K and V are handed in and
    read out in ``dtype``; the pages hold them in ``dtype``, or with ``kv_dtype=torch.int8``
    (``"int8"``) quantized per token and KV head, each row with one float16 scale
    (``kvcache_ext.reference.quantize``): a quarter of float32's bytes, half of bfloat16's. A segment owns a list
    of pages (``page_table``), takes a free page or a newly allocated one when it fills up,
    and gives pages back when compaction empties them: the pages a segment has never move,
    and memory held is the kept tokens rounded up to whole pages. A token's *slot* is
    ``page * page_size + row``; tensors indexed by slot (``[capacity, ...]``, like
    ``compact``'s keep mask and the attention statistics) use the "slot layout".
    """

    def __init__(self, batch: int, heads: int, head_dim: int, *, dtype: torch.dtype = torch.float16,
                 device: torch.device | str = "cpu", score_channels: int = 1, page_size: int = 16,
                 kv_dtype: torch.dtype | str | None = None):
        batch, heads, head_dim, score_channels, page_size, dtype, device = checks.store_arguments(
            batch, heads, head_dim, score_channels, page_size, dtype, device)
        kv_dtype = checks.kv_dtype(kv_dtype, "RaggedKVStore kv_dtype", dtype)
        if device.type == "cuda" and not _C.build_info()["cuda"]:
            raise ValueError("kvcache_ext was built without CUDA kernels; reinstall it with a CUDA "
                             "build of torch and nvcc available (see README.md)")
        like = torch.empty(0, dtype=dtype, device=device)
        self._adopt(_C.PageAllocator(batch, heads, head_dim, score_channels, like, page_size, kv_dtype))

    def _adopt(self, allocator) -> None:
        self._allocator = allocator
        # What every op call passes besides the state, fixed for the store's life: read here
        # once (from the allocator each would be a pybind call, which torch.compile cannot trace).
        self._page_size, self._head_dim = allocator.page_size, allocator.head_dim
        self._channels = allocator.score_channels
        self._batch, self._heads = allocator.batch, allocator.heads
        self._dtype, self._device = allocator.like.dtype, allocator.like.device
        self._page_dtype = allocator.kv_dtype   # what the pages hold: the ops' dtype argument
        self._take_state()

    def fork(self) -> "RaggedKVStore":
        """A store that continues this one's sequences: the same tokens, read from this store's
        pages in place (not copied; a segment's partly filled last page is the one page copied,
        where its next token goes), and new tokens appended in pages of its own. How a shared
        prefix is served: the prefix compressed once, each request a fork of it.

        From then on the tokens the two stores share are read-only in both: ``compact``,
        ``replace`` and score writes raise a ValueError (``shares_pages``), appends do not;
        ``repack`` gives a store pages of its own again. ``nbytes`` of the fork counts its own
        pages only."""
        store = object.__new__(type(self))
        store._adopt(self._allocator.fork())
        self._refresh()
        return store

    @property
    def shares_pages(self) -> bool:
        """Whether this store shares pages with one forked from it or the one it was forked from
        (``fork``): the shared tokens are then read-only."""
        return self._allocator.shares_pages

    # --- the state (see the module's docstring) ---------------------------------------------
    def _take_state(self) -> None:
        self._pool, self._table, self._len = self._allocator.state()
        self._state_version = self._allocator.state_version

    _take_state_untraced = _host(_take_state)

    def _refresh(self) -> None:
        """After an allocator call: takes the state again if the allocator made new tensors
        (under torch.compile always, as a graph break)."""
        if torch.compiler.is_compiling():
            self._take_state_untraced()
        elif self._allocator.state_version != self._state_version:
            self._take_state()

    def _current(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The state for an op."""
        return self._pool, self._table, self._len

    def state(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``(pool, page_table, len)``: the store's own tensors, for the ``torch.ops.kvcache_ext``
        ops (see ``kvcache_ext.kernels.ops``). Not copies: pass them to the ops only (the accessors
        ``k``, ``len``, ``page_table``, ... give copies to read). Valid until the next call
        that allocates pages or repacks."""
        pool, table, lens = self._current()
        return list(pool), table, lens

    # --- operations -----------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
               valid: torch.Tensor | None = None) -> None:
        """Appends n tokens to every segment: k, v [B, H, n, D]; pos [B, n] or [n] integers.

        With ``valid`` ([B, n] or [B, H, n] bool) only the valid tokens are stored, in order
        (left padding is never stored). A full segment takes a free page, or one allocated
        with the other segments' missing pages in one slab; no stored token moves.
        """
        k, v, pos = checks.tensor(k, "k"), checks.tensor(v, "v"), checks.as_tensor(pos, "pos")
        valid = None if valid is None else checks.tensor(valid, "valid")
        # Host half (checks, pages for the new tokens, host lengths), then the op.
        pos32, rank, counts = self._allocator.prepare_append(k, v, pos, valid)
        self._refresh()
        ops.store_append(self._pool, self._table, self._len, k, v, pos32, rank, counts,
                         self._page_size, self._channels, self._page_dtype)

    def decode_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float, *,
                    valid: torch.Tensor | None = None, q_pos: torch.Tensor | None = None,
                    plan: torch.Tensor | None = None, **work) -> tuple[torch.Tensor, dict]:
        """A decode step in one op (``store_decode_step``): appends k, v [B, H, 1, D] at ``pos``
        ([B, 1] integers; only the tokens of ``valid`` ([B, 1] or [B, H, 1] bool) when given)
        and attends with q [B, Hq, 1, D] (``q_pos`` as ``ragged_attention`` takes it), doing
        ``work`` besides (``decode_call``'s arguments: statistics returned, statistics added to
        score channels, an eviction by a slot rule). Returns ``(out [B, Hq, 1, D], {name:
        statistic})``. ``decode_call(**work)`` prepares the same once for every step.

        Eager (``plan`` None): one host call (``_C.decode_step``, csrc/ops.h: the op's work with
        the page allocator's host steps; under ``torch.compile`` the op with those steps as graph
        breaks): the new token gets its pages and the attention its plan first; the eviction runs
        only when a segment holds more than its budget, and the new lengths, min(len, k), go back
        to the allocator with the pages emptied (no sync). Nothing changes when an argument is
        refused. Captured (``plan``: a plan of the pages held, ``attention_plan_of_pages``): the
        op alone, no host step, so a CUDA graph can capture the call; the pages must hold the
        token (``has_room``), the eviction always runs (a top-k of k keeps a segment within its
        budget whole) and every page stays held; the caller notes the host lengths after each
        run (``note_appended``, ``note_kept_in_pages``)."""
        return self.decode_call(**work)(q, k, v, pos, scale, valid, q_pos, plan)

    def decode_call(self, *, stats=(), accumulate=(), rule: str | None = None, sinks: int = 0, recent: int = 0,
                    last_pos: torch.Tensor | None = None,
                    budget: tuple[torch.Tensor, torch.Tensor] | None = None) -> "DecodeCall":
        """A decode step's work, checked once, to run at every step (``DecodeCall``, the
        arguments ``decode_step`` takes besides the tokens): ``stats``, the attention statistics
        returned (names from ``STAT_NAMES``); ``accumulate``, the statistics added to score
        channels 0, 1, ... of every slot ("mass", "sum_sq", "count": one value per slot); with
        ``rule``, each segment keeps its k[s] best tokens by the rule, the protected ones first
        (as ``evict_by_rule``: ``sinks``, ``recent``, ``last_pos`` [B] on the store's device,
        read at every step), ``budget`` = (k [S] integers on the store's device, k_host [S] on
        the host)."""
        return DecodeCall(self, stats, accumulate, rule, sinks, recent, last_pos, budget)

    def _decode(self, call: "DecodeCall", q, k, v, pos, scale, valid, q_pos, plan):
        """``DecodeCall.__call__``: one decode step with ``call``'s work (see ``decode_step``)."""
        if type(scale) is not float:
            scale = checks.real(scale, "scale", what="a finite number")
        if plan is None and not torch.compiler.is_compiling():
            # The eager step in one host call: the allocator's host steps and the op's work on
            # the state view it keeps.
            out, *fields = _C.decode_step(self._allocator, q, k, v, pos, valid, q_pos, scale, *call.flags, call.codes,
                                          call.rule, call.sinks, call.recent, call.last_pos, call.budget,
                                          call.budget_host)
            self._refresh()   # the step may have added pages
        else:
            out, fields = self._decode_through_the_op(call, q, k, v, pos, scale, valid, q_pos, plan)
        return out, {name: fields[STAT_NAMES.index(name)] for name in call.stats} if call.stats else {}

    def _decode_through_the_op(self, call: "DecodeCall", q, k, v, pos, scale, valid, q_pos, plan):
        """The decode step through the ``store_decode_step`` op: with the page allocator's host
        steps around it (under ``torch.compile``, as graph breaks), or, with a ``plan`` of the
        pages held, alone (a CUDA graph's captured step)."""
        rule, k_device, kept = call.rule, call.budget, None
        if call.codes or rule is not None:
            self._allocator.check_writable("decode_step")
        captured = plan is not None
        if captured:
            pos32, rank, counts = pos, None, None
        else:
            before = self._allocator.len_host
            pos32, rank, counts = self._allocator.prepare_append(checks.tensor(k, "k"), checks.tensor(v, "v"),
                                                                 checks.as_tensor(pos, "pos"), valid)
            self._refresh()
            plan = self._allocator.attention_plan(q.shape[1] // self._heads if isinstance(q, torch.Tensor)
                                                  and q.dim() == 4 else 1)
            if rule is not None:   # the host lengths after the append: no sync
                lens = torch.tensor(self._allocator.len_host, dtype=torch.int64)
                kept = torch.minimum(lens, call.budget_host)
                if torch.equal(kept, lens):   # no segment over its budget: nothing to evict
                    rule = k_device = kept = None
        try:
            out, *fields = ops.store_decode_step(
                self._pool, self._table, self._len, q, k, v, pos32, rank, counts, plan, q_pos, scale,
                self._page_size, self._channels, *call.flags, call.codes, rule, call.sinks if rule else 0,
                call.recent if rule else 0, call.last_pos if rule else None, k_device, self._page_dtype)
        except Exception:
            if not captured:   # refused before it wrote anything: the host lengths go back
                self._allocator.cancel_append(before)
            raise
        if kept is not None:
            self._allocator.finish_compact(kept)
        return out, fields

    # --- a decode step captured in a CUDA graph (kvcache_ext.hf.decode_graph) -------------------
    def append_in_pages(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Appends k, v [B, H, n, D] at positions ``pos`` ([B, n] integers) to every segment
        through the ``store_append`` op alone, into pages the segments already hold: no host
        step, so a CUDA graph can capture it and replay it. The caller checks the room first
        (``has_room``) and advances the host lengths after each run (``note_appended``)."""
        ops.store_append(*self._current(), k, v, pos, None, None, self._page_size, self._channels,
                         self._page_dtype)

    def evict_by_rule(self, k: torch.Tensor, *, rule: str, sinks: int = 0, recent: int = 0,
                      last_pos: torch.Tensor | None = None, kept: torch.Tensor | None = None) -> None:
        """Keeps the k[s] best tokens of every segment by ``rule`` (``select(k, rule=...)``) and
        compacts them unordered (``compact(stable=False)``), through the store_topk and
        store_compact ops. k: [S] integers on the store's device. ``kept`` ([B, H] integers on
        the host): the lengths this leaves, min(len, k), given back to the page allocator with
        the pages emptied (no sync). Without it no host step runs, so a CUDA graph can capture
        the call: every page stays held, and the caller notes the new host lengths after each
        run (``note_kept_in_pages``)."""
        self._allocator.check_writable("evict_by_rule")
        state = self._current()
        keep, _ = ops.store_topk(*state, None, k, 1, self._page_size, self._head_dim, self._channels,
                                 self._page_dtype, rule, sinks, recent, last_pos)
        ops.store_compact(*state, keep, self._page_size, self._head_dim, self._channels, self._page_dtype, False)
        if kept is not None:
            self._allocator.finish_compact(kept.reshape(-1))

    def note_kept_in_pages(self, k_host: torch.Tensor) -> None:
        """The host lengths after ``evict_by_rule`` of k_host ([S] integers on the host) without
        ``kept``: min(len, k)."""
        self._allocator.note_kept_in_pages(k_host)

    def has_room(self, n: int) -> bool:
        """Whether every segment's pages hold ``n`` more tokens (host bookkeeping, no sync)."""
        return self._allocator.has_room(n)

    def note_appended(self, n: int) -> None:
        """The host lengths after ``append_in_pages`` of ``n`` tokens (raises, changing nothing,
        when a segment's pages lack room for them)."""
        self._allocator.note_appended(n)

    @_host
    def attention_plan_of_pages(self, rows: int = 1) -> torch.Tensor:
        """The attention plan of the lengths the segments' pages hold: a stale plan of a store
        gives the same result, so it serves every step until the pages fill (what a captured
        decode step attends with)."""
        return self._allocator.attention_plan_of_pages(int(rows))

    @_host
    def page_addresses(self) -> torch.Tensor:
        """The page addresses the ops read on the current stream (cached by the ops per pool
        and stream): a graph captured over the ops holds it for its life."""
        pool, table, lens = self._current()
        return _C.page_addresses(pool, table, lens, self._page_size, self._head_dim, self._channels,
                                 self._page_dtype)

    @property
    def state_version(self) -> int:
        """Counts the calls that made new state tensors (pages added, a repack): the ops'
        arguments are the same tensors while it stays."""
        return self._allocator.state_version

    def replace(self, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                check_bounds: bool = True) -> None:
        """Overwrites slot[b, h] (0 <= slot < len) of every segment with the token k, v [B, H, 1, D]
        at position pos [B]; its scores restart at zero. A slot given on the host (always, on a CPU
        store) is bounds-checked for free; ``check_bounds`` checks one on a CUDA device (a host sync)."""
        self._allocator.check_writable("replace")
        ops.store_replace(*self._current(), checks.as_tensor(slot, "slot"),
                          checks.tensor(k, "k"), checks.tensor(v, "v"), checks.as_tensor(pos, "pos"),
                          self._page_size, self._head_dim, self._channels, self._page_dtype,
                          checks.boolean(check_bounds, "check_bounds"))

    def compact(self, keep: torch.Tensor, lens: torch.Tensor | None = None, *, stable: bool = True) -> None:
        """Keeps the live slots whose flag in ``keep`` ([capacity] bool) is set: in their order
        (``stable``), or, with ``stable=False``, the kept tokens among a segment's first
        new-length ones where they lie and the kept ones past them in the evicted places, in
        token order (one token moves per place filled, not every token after the first
        evicted one: per-step eviction's compaction; the tokens' positions say their order).
        On CUDA this reads the new lengths back: the one host sync of an eviction. ``lens``
        ([B, H] integers on the host), when the caller knows them (``select``'s k per segment
        keeps ``min(len, k)``), are taken instead: no sync. A CPU store checks them against
        what was kept; a CUDA store trusts them (checking is the sync they save)."""
        keep = checks.tensor(keep, "keep")
        self._allocator.check_writable("compact")
        if lens is not None:
            lens = checks.tensor(lens, "lens")
            if (lens.device.type != "cpu" or lens.shape != (self.batch, self.heads)
                    or lens.is_floating_point() or lens.dtype == torch.bool):
                raise ValueError(f"lens must be the [B, H] = [{self.batch}, {self.heads}] integer "
                                 f"lengths on the host, got a {lens.dtype} tensor of shape "
                                 f"{list(lens.shape)} on {lens.device}")
            held = self._allocator.len_host     # host lists: no tensor op per eviction
            if any(not 0 <= n <= h for n, h in zip(lens.reshape(-1).tolist(), held)):
                raise ValueError(f"lens must be between 0 and each segment's length "
                                 f"{self.lens.tolist()}, got {lens.tolist()}")
        ops.store_compact(*self._current(), keep, self._page_size, self._head_dim, self._channels,
                          self._page_dtype, checks.boolean(stable, "stable"))
        self._allocator.finish_compact(None if lens is None else lens.reshape(-1))

    @_host
    def slot_rows(self) -> torch.Tensor:
        """[capacity] int64 on the store's device: the batch row of the segment that holds each
        slot (a slot no segment holds gets row 0; nothing should read it). The allocator keeps
        it and uploads it again only when a page changed hands (never in per-step eviction,
        where a head takes back the page it freed): not a copy, do not write to it."""
        return self._allocator.slot_rows()

    def validate(self) -> None:
        """Raises ValueError when ``len`` and ``page_table`` are inconsistent with the pool.

        The store's own operations keep them consistent (the page allocator writes both); this
        checks state handed to the ops by other code. The ops check it themselves on a CPU
        store; on CUDA they trust it (reading it costs a host sync): this costs that one sync.
        """
        codes = ops.store_check(*self._current(), self._page_size, self._head_dim, self._channels,
                                self._page_dtype).cpu()
        bad = codes.nonzero().flatten().tolist()
        if bad:
            s = bad[0]
            raise ValueError(f"the store's state is inconsistent: segment {s} (batch {s // self.heads}, "
                             f"head {s % self.heads}): {_C.STORE_CHECK_FAULTS[int(codes[s])]}"
                             f" ({len(bad)} bad segments)")

    def reserve(self, extra: int) -> None:
        """Gives every segment pages for ``extra`` more tokens (new pages only where missing)."""
        self._allocator.reserve(checks.integer(extra, "reserve extra", 0))
        self._refresh()

    def repack(self, extra: int = 0) -> None:
        """Moves the live tokens into one new allocation with pages for ``extra`` more tokens
        per segment, and releases every other page (the only operation that moves them all)."""
        self._allocator.repack(checks.integer(extra, "repack extra", 0))
        self._refresh()

    def shrink_to_fit(self) -> None:
        """Releases every page that holds no live token (``repack(0)``)."""
        self._allocator.shrink_to_fit()
        self._refresh()

    def set_scores(self, scores: torch.Tensor) -> None:
        """Writes the score channels of every slot from a [capacity, C] float32 tensor."""
        self._allocator.set_scores(checks.tensor(scores, "scores"))

    def select(self, k, scores: torch.Tensor | None = None, *, grouped: bool = False, rule: str | None = None,
               sinks: int = 0, recent: int = 0, last_pos: torch.Tensor | None = None):
        """Keep mask ([capacity] bool) of the k best live slots by ``scores`` (default: channel 0).

        ``scores``: [capacity] in slot layout, or [B, H, max_len] padded as ``to_dense`` gives
        (what the eviction engine has). ``grouped=False``: k per segment (an int, or [B, H]).
        ``grouped=True``: Ada-KV's allocation, k per batch item (an int, or [B]) shared by its
        heads; returns ``(keep, counts [B, H])``. Ties go to the lower position (then to the
        earlier head of a group), NaN is evicted first. A negative budget is refused when it is
        on the CPU; a CUDA budget tensor is not read back (no host sync): there a negative
        budget keeps nothing and one past the live tokens keeps them all.

        ``rule`` (no ``scores`` then) scores each token from its record, as the compiled decode
        step of H2O and StreamingLLM does (csrc/select/slot_rule.h): ``"mass"`` channel 0,
        ``"position"`` its position; a protected token scores +inf (position < ``sinks``, or,
        with ``recent`` > 0, position > last_pos[b] - ``recent``: ``last_pos`` [B] integers on
        the store's device, each row's newest position).
        """
        if scores is not None and not isinstance(scores, torch.Tensor):
            raise TypeError(f"scores must be None or a float tensor, got {type(scores).__name__}")
        per = (self.batch,) if grouped else (self.batch, self.heads)
        k = budget_tensor(k, per, self.device)           # [prod(per)], checked
        # A CPU store's op refuses a negative budget itself; a host budget for a CUDA store is
        # checked here (free: it is on the host, and the CUDA op does not read it back).
        if self.device.type != "cpu" and k.device.type == "cpu" and k.numel() and bool((k < 0).any()):
            raise ValueError(f"k (the budget) must be >= 0, got {k.tolist()}")
        # One op on either device: the store selects through its own pages, reading the scores
        # where they lie (no packing, no copy of the scores). On CUDA it reads nothing back
        # (no host sync): a negative budget on the device keeps nothing.
        if scores is not None:
            scores = scores.float().contiguous()  # no copy when it is already so
        keep, counts = ops.store_topk(*self._current(), scores, k, self.heads if grouped else 1,
                                      self._page_size, self._head_dim, self._channels, self._page_dtype,
                                      rule, sinks, recent, last_pos)
        return (keep, counts.view(self.batch, self.heads)) if grouped else keep

    def add_to_scores(self, channel: int, values: torch.Tensor) -> None:
        """Score channel ``channel`` of every slot += values ([capacity] float32, slot layout),
        in place in the pages, through the store_add_scores op (a CUDA graph can capture it)."""
        self._allocator.check_writable("add_to_scores")
        ops.store_add_scores(*self._current(), checks.tensor(values, "values"),
                             checks.integer(channel, "channel", 0), self._page_size, self._head_dim,
                             self._channels, self._page_dtype)

    @_host
    def attention_plan(self, rows: int = 1) -> torch.Tensor:
        """The host step of the attention (``kvcache_ext.kernels.ops``): the work partition over the
        current lengths for ``rows`` query rows per segment (G * n), on the store's device.
        Valid until the next append or compaction."""
        return self._allocator.attention_plan(int(rows))

    # --- layout helpers ---------------------------------------------------------------------
    def slot_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [B, H, L], mask [B, H, L])``: the slot of each live token, L = max len."""
        lens = self.len.long()
        max_len = max(self._allocator.len_host, default=0)
        offsets = torch.arange(max_len, device=self.device)
        mask = offsets < lens[:, None]
        size = self.page_size
        # The device's table: entries past a segment's pages may be stale there, and are
        # masked (reading it costs no host-to-device copy, unlike the page_table copy).
        table = self._current()[1].long()                   # [S, width]
        page = table.gather(1, (offsets // size).expand(table.shape[0], -1)) if max_len else \
            table[:, :0]
        index = (page * size + offsets % size).masked_fill(~mask, 0)
        shape = (self.batch, self.heads, max_len)
        return index.view(shape), mask.view(shape)

    def to_padded(self, slots: torch.Tensor, fill=0, *, index=None) -> torch.Tensor:
        """A [capacity, ...] slot-layout tensor as [B, H, L, ...] (``fill`` beyond each len).
        ``index``: the ``(index, mask)`` to lay the tokens out by (default ``slot_index()``)."""
        index, mask = self.slot_index() if index is None else index
        out = slots[index]
        return out.masked_fill(~mask.view(mask.shape + (1,) * (out.dim() - 3)), fill)

    def from_padded(self, padded: torch.Tensor, fill=0, *, index=None) -> torch.Tensor:
        """A [B, H, L, ...] tensor (L = max len) in slot layout [capacity, ...]. ``index``: the
        ``(index, mask)`` it is laid out by (default ``slot_index()``)."""
        index, mask = self.slot_index() if index is None else index
        rest = tuple(padded.shape[3:])
        out = padded.new_full((self.capacity + 1,) + rest, fill)
        # Entries past a segment's length go to a spare row past the end (no host sync).
        target = index.reshape(-1).masked_fill(~mask.reshape(-1), self.capacity)
        out.index_copy_(0, target, padded[:, :, :index.shape[-1]].reshape((target.numel(),) + rest))
        return out[:self.capacity]

    def to_dense(self) -> DenseView:
        """The live contents padded to the longest segment, for debugging and tests."""
        _, mask = self.slot_index()
        return DenseView(k=self.to_padded(self.k), v=self.to_padded(self.v),
                         pos=self.to_padded(self.pos), scores=self.to_padded(self.scores),
                         mask=mask, lens=self.lens.to(self.device))

    # --- state ------------------------------------------------------------------------------
    # k, v, pos and scores are copies in slot layout: writing to them does not change the store.
    @property
    @_host
    def k(self) -> torch.Tensor:
        """[capacity, D] K of every slot (a copy; slots without a live token are undefined)."""
        return self._allocator.k

    @property
    @_host
    def v(self) -> torch.Tensor:
        """[capacity, D] V of every slot (a copy)."""
        return self._allocator.v

    @property
    @_host
    def pos(self) -> torch.Tensor:
        """[capacity] int32 position of every slot (a copy)."""
        return self._allocator.pos

    @property
    @_host
    def scores(self) -> torch.Tensor:
        """[capacity, C] float32 score channels of every slot (a copy; see ``set_scores``)."""
        return self._allocator.scores

    @property
    def len(self) -> torch.Tensor:
        """[S] int32 live tokens of each segment, on the store's device (a copy)."""
        return self._current()[2].clone()

    @property
    @_host
    def page_table(self) -> torch.Tensor:
        """[S, width] int32 pages of each segment in token order, -1 past its last (a copy)."""
        return self._allocator.page_table

    @property
    def page_size(self) -> int:
        """Tokens per page: the unit by which a segment grows."""
        return self._page_size

    @property
    def num_pages(self) -> int:
        """Pages held, owned by a segment or free."""
        return self._allocator.num_pages

    @property
    def free_pages(self) -> int:
        """Pages held that no segment owns (reused before any new allocation)."""
        return self._allocator.free_pages

    @property
    def slab_allocations(self) -> int:
        """Allocations of pages since the store was made (one per growth, whatever its size)."""
        return self._allocator.slab_allocations

    @property
    def repacks(self) -> int:
        """How many times every live token was moved (``repack``/``shrink_to_fit`` only)."""
        return self._allocator.repacks

    @property
    def lens(self) -> torch.Tensor:
        """[B, H] int64 live tokens per segment, from the host copy (no device sync)."""
        return torch.tensor(self._allocator.len_host, dtype=torch.int64).view(self.batch, self.heads)

    @property
    def caps(self) -> torch.Tensor:
        """[B, H] int64 tokens each segment's pages hold, from the host copy (no device sync)."""
        pages = torch.tensor(self._allocator.pages_host, dtype=torch.int64)
        return (pages * self.page_size).view(self.batch, self.heads)

    @property
    def capacity(self) -> int:
        """Slots of the slot layout: every page held, times ``page_size``."""
        return self._allocator.capacity

    @property
    def num_tokens(self) -> int:
        """Live slots over all segments."""
        return self._allocator.num_tokens

    @property
    def nbytes(self) -> int:
        """Bytes held by the store: its pages (K, V, pos, scores) and its page tables; a fork
        does not count the pages it reads from the store it was forked from."""
        return self._allocator.nbytes

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def heads(self) -> int:
        return self._heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def score_channels(self) -> int:
        return self._channels

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of K and V as they are handed in and read out (``k``, ``to_dense``)."""
        return self._dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the pages hold: ``dtype``, or torch.int8 (quantized pages)."""
        return self._page_dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def __repr__(self) -> str:
        return (f"RaggedKVStore(batch={self.batch}, heads={self.heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, kv_dtype={self.kv_dtype}, device={self.device}, tokens={self.num_tokens}, "
                f"pages={self.num_pages} of {self.page_size}, nbytes={self.nbytes})")
