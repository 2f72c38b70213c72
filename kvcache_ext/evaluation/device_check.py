"""``kvcache-ext check``: every kernel on one device against the plain-PyTorch reference
(``kvcache_ext.reference``), and a patched tiny model's ragged path against its reference path,
on tiny shapes of every dtype the store holds.

Each row compares one op (or the model) in one dtype; its parts (K, V, positions, outputs,
statistics, ...) are compared with a tolerance each, and the row shows the part nearest its
tolerance. The error of a part is max |got - want| / (1 + |want|): within ``tol`` exactly when
``torch.testing.assert_close(got, want, atol=tol, rtol=tol)`` passes. A part of different shape,
or NaN where the other is not, has an infinite error. Tolerance 0: the values are equal.
"""
from __future__ import annotations

import math
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvcache_ext import reference
from kvcache_ext.cache_argument import with_cache
from kvcache_ext.engine.ragged_storage import RaggedLayerKV
from kvcache_ext.engine.storage import DecodeStep, EvictByRule
from kvcache_ext.hf.patching import patch
from kvcache_ext.kernels.attention import ragged_attention
from kvcache_ext.kernels.ops import STAT_NAMES, ops
from kvcache_ext.kernels.select import grouped_topk, segmented_topk
from kvcache_ext.kernels.store import RaggedKVStore
from kvcache_ext.policies import H2O, AdaKV, EveryStep, Policy, SnapKV, StreamingLLM
from kvcache_ext.reference.masked_cache import MaskedLayerKV

# The dtypes of the pages: the three K and V dtypes, and int8 pages (K and V handed in as float32).
DTYPES = ("float32", "float16", "bfloat16", "int8")
INT8_INPUT = torch.float32
# int8 pages under a bfloat16 model (K, V and q in bfloat16): the attention rows only, the calls
# the CUDA tensor-core kernels take on int8 pages.
INT8_BF16 = "int8/bfloat16"

# Attention outputs against the float64 reference: the kernels accumulate in float32; a half
# type adds one rounding of the output. int8 pages: the reference attends over the values the
# pages give back (exact in float32), so float32's bound holds.
OUT_TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2, "int8": 1e-5, INT8_BF16: 1.6e-2}
STAT_TOL = 1e-5      # the statistics are float32 on both sides
STEP_TOL = 1e-4      # statistics and channels after several decode steps: float32 sums of a few terms
# Logits of the patched tiny model, ragged path against reference path (both in the model's dtype).
MODEL_TOL = {"float32": 2e-4, "float16": 2e-2, "bfloat16": 5e-2, "int8": 2e-4}
EXACT = 0.0

# Tiny shapes: GQA with 2 query heads per KV head, head_dim 64 (the CUDA kernels' smallest), pages of
# 4 tokens so that segments span several, and ragged segments, empty and single-token ones among them.
BATCH, HEADS, GROUP, HEAD_DIM, PAGE = 2, 2, 2, 64, 4
LENS = ((13, 0), (1, 9))
SEGMENTS = BATCH * HEADS


@dataclass
class Part:
    name: str
    error: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tol

    @property
    def ratio(self) -> float:
        """How near its tolerance the part is (over 1: out of it)."""
        if self.tol > 0:
            return self.error / self.tol
        return 0.0 if self.error == 0 else math.inf


@dataclass
class Row:
    """One op in one dtype: its compared parts, or why it was not run (``not_served``), or the
    error it raised."""

    op: str
    dtype: str
    parts: list[Part] = field(default_factory=list)
    not_served: str | None = None
    raised: str | None = None

    @property
    def worst(self) -> Part | None:
        return max(self.parts, key=lambda p: p.ratio, default=None)

    @property
    def status(self) -> str:
        if self.not_served is not None:
            return "not served"
        return "pass" if self.raised is None and self.parts and all(p.ok for p in self.parts) else "FAIL"

    def why(self) -> str:
        """What failed, in words."""
        if self.raised is not None:
            return f"raised {self.raised}"
        bad = [p for p in self.parts if not p.ok]
        return "; ".join(f"{p.name}: max error {p.error:.3g} > tolerance {p.tol:g}" for p in bad) or "nothing compared"


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (1 + |want|) (module docstring); bool and integer tensors as numbers."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if got.shape != want.shape:
        return math.inf
    if got.numel() == 0:
        return 0.0
    both_nan = got.isnan() & want.isnan()
    diff = ((got - want).abs() / (1 + want.abs())).masked_fill(both_nan, 0.0)
    same_inf = (got == want) & got.isinf()
    return float(diff.masked_fill(same_inf, 0.0).nan_to_num(nan=math.inf).max())


def compare(name: str, got, want, tol: float) -> Part:
    return Part(name, error(torch.as_tensor(got), torch.as_tensor(want)), tol)


# --- stores ----------------------------------------------------------------------------------
def _page_dtypes(dtype: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(the dtype of K and V handed in, the pages' kv_dtype)."""
    if dtype == INT8_BF16:
        return torch.bfloat16, torch.int8
    return (INT8_INPUT, torch.int8) if dtype == "int8" else (getattr(torch, dtype), None)


def _tokens(gen, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))


def _stores(device, dtype: str, gen, channels: int = 2, lens=LENS):
    """A store on ``device`` and its reference, filled by ``store_append`` with the ragged ``lens``
    (a valid mask per segment), then a block of 3 tokens appended to every segment."""
    kv, pages = _page_dtypes(dtype)
    store = RaggedKVStore(BATCH, HEADS, HEAD_DIM, dtype=kv, device=device, score_channels=channels,
                          page_size=PAGE, kv_dtype=pages)
    # int8 pages: the reference holds the values the pages give back in float32, where they are
    # exact (K and V in bfloat16 quantize as their float32 widening does).
    held = torch.float32 if pages is not None else kv
    ref = reference.ReferenceStore(BATCH, HEADS, HEAD_DIM, dtype=held, score_channels=channels, kv_dtype=pages)
    longest = max(map(max, lens))
    valid = torch.arange(longest) < torch.tensor(lens)[..., None]
    k, v = _tokens(gen, longest, kv)
    store.append(k.to(device), v.to(device), torch.arange(longest).to(device), valid.to(device))
    ref.append(k.to(held), v.to(held), torch.arange(longest).expand(BATCH, longest), valid)
    k, v = _tokens(gen, 3, kv)
    pos = torch.arange(longest, longest + 3)
    store.append(k.to(device), v.to(device), pos.to(device))
    ref.append(k.to(held), v.to(held), pos.expand(BATCH, 3))
    return store, ref


def _same_store(store, ref) -> list[Part]:
    """Every live token's K, V, position and scores, and the lengths, exactly."""
    dense = store.to_dense()
    return [compare("lengths", store.len.view(BATCH, HEADS), ref.lens, EXACT)] + [
        compare(name, getattr(dense, name), getattr(ref, name), EXACT) for name in ("k", "v", "pos", "scores")]


def check_append(device, dtype, gen):
    store, ref = _stores(device, dtype, gen)
    return _same_store(store, ref)


def check_replace(device, dtype, gen):
    store, ref = _stores(device, dtype, gen, lens=((13, 1), (2, 9)))   # every segment has a slot to replace
    slot = (torch.rand(BATCH, HEADS, generator=gen) * ref.lens).long()
    k, v = _tokens(gen, 1, store.dtype)
    pos = torch.tensor([40, 41])
    store.replace(slot.to(device), k.to(device), v.to(device), pos.to(device))
    ref.replace(slot, k, v, pos)
    return _same_store(store, ref)


def check_add_scores(device, dtype, gen):
    store, ref = _stores(device, dtype, gen)
    values = torch.randn(store.capacity, generator=gen)
    store.add_to_scores(1, values.to(device))
    ref.scores[..., 1] += store.to_padded(values.to(device)).cpu()
    return _same_store(store, ref)


def check_compact(device, dtype, gen, stable: bool):
    store, ref = _stores(device, dtype, gen)
    keep = torch.rand(ref.mask.shape, generator=gen) < 0.5
    store.compact(store.from_padded(keep.to(device), False), stable=stable)
    (ref.compact if stable else ref.compact_unordered)(keep)
    return _same_store(store, ref)


def _tied_scores(gen, shape) -> torch.Tensor:
    """Scores with many ties, a NaN and infinities: what a top-k's order rules decide."""
    scores = torch.randint(-3, 4, shape, generator=gen).float()
    flat = scores.view(-1)
    flat[torch.randint(0, flat.numel(), (3,), generator=gen)] = torch.tensor([math.nan, math.inf, -math.inf])
    return scores


def check_store_topk(device, dtype, gen):
    """Per segment and grouped (Ada-KV) by given scores, and by a slot rule with protected tokens."""
    store, ref = _stores(device, dtype, gen)
    scores = _tied_scores(gen, ref.mask.shape).masked_fill(~ref.mask, 0)
    flat = (scores.view(SEGMENTS, -1), ref.pos.view(SEGMENTS, -1), ref.lens.view(SEGMENTS))
    k = torch.tensor([[5, 0], [1, 20]])
    keep = store.select(k.to(device), store.from_padded(scores.to(device), 0.0))
    want = reference.segmented_topk(*flat, k.view(-1)).view(ref.mask.shape)
    parts = [compare("keep", store.to_padded(keep, False), want, EXACT)]
    k_rows = torch.tensor([9, 4])
    keep, counts = store.select(k_rows.to(device), store.from_padded(scores.to(device), 0.0), grouped=True)
    want, want_counts = reference.grouped_topk(*flat, HEADS, k_rows)
    parts += [compare("grouped keep", store.to_padded(keep, False), want.view(ref.mask.shape), EXACT),
              compare("grouped counts", counts, want_counts.view(BATCH, HEADS), EXACT)]
    # The slot rules: channel 0 ("mass") or the position, +inf for the sinks and the recent tokens.
    channel = _tied_scores(gen, ref.mask.shape).masked_fill(~ref.mask, 0)
    store.set_scores(store.from_padded(torch.stack([channel, channel], -1).to(device), 0.0))
    last_pos = ref.pos.amax(dim=(1, 2)).long()
    for rule, rule_scores in (("mass", channel), ("position", ref.pos.float())):
        protected = (ref.pos < 1) | (ref.pos > last_pos[:, None, None] - 2)
        rule_scores = rule_scores.masked_fill(protected, math.inf)
        keep = store.select(k.to(device), rule=rule, sinks=1, recent=2, last_pos=last_pos.to(device))
        want = reference.segmented_topk(rule_scores.view(SEGMENTS, -1), *flat[1:], k.view(-1))
        parts.append(compare(f"keep by {rule}", store.to_padded(keep, False), want.view(ref.mask.shape), EXACT))
    return parts


def check_store_check(device, dtype, gen):
    """A consistent store has no fault; a length past a segment's pages is that segment's fault."""
    store, _ = _stores(device, dtype, gen)
    pool, table, lens = store.state()
    args = (store.page_size, store.head_dim, store.score_channels, store.kv_dtype)
    faults = ops.store_check(pool, table, lens, *args) != 0
    bad = lens.clone()
    bad[3] = int(store.caps.view(-1)[3]) + 1
    bad_faults = ops.store_check(pool, table, bad, *args) != 0
    return [compare("faults of a consistent store", faults, torch.zeros(SEGMENTS, dtype=torch.bool), EXACT),
            compare("faults of a length past its pages", bad_faults, torch.arange(SEGMENTS) == 3, EXACT)]


def check_attention(device, dtype, gen, compared: tuple[str, ...]):
    """A decode query and a causal block of 8 (16 query rows per KV head: what the CUDA
    tensor-core prefill takes) over a compacted ragged store, against the float64 reference:
    the ``compared`` ones of the outputs ("out") and the statistics ("statistics")."""
    store, ref = _stores(device, dtype, gen)
    keep = torch.rand(ref.mask.shape, generator=gen) < 0.7
    store.compact(store.from_padded(keep.to(device), False))
    ref.compact(keep)
    parts = []
    newest = int(ref.pos.max())
    for n, q_pos in ((1, None), (8, torch.arange(newest - 7, newest + 1))):
        q = torch.randn(BATCH, HEADS * GROUP, n, HEAD_DIM, generator=gen).to(store.dtype)
        out, got = ragged_attention(q.to(device), store, 0.125, q_pos=None if q_pos is None else q_pos.to(device),
                                    stats="statistics" in compared)
        want_out, want = reference.ragged_attention(q, ref.k, ref.v, ref.pos, ref.mask, 0.125, q_pos)
        label = "decode" if n == 1 else "causal block"
        if "out" in compared:
            parts.append(compare(f"{label} out", out.float(), want_out.float(), OUT_TOL[dtype]))
        if "statistics" in compared:
            parts += [compare(f"{label} {name}", store.to_padded(getattr(got, name)), want[name], STAT_TOL)
                      for name in STAT_NAMES]
    return parts


def _kept(view: dict) -> torch.Tensor:
    """The positions a layer storage's padded view keeps per head, -1 past them."""
    return view["pos"].masked_fill(~view["mask"], -1)


def check_decode_steps(device, dtype, gen, captured: bool):
    """Six decode steps of a layer storage (append, attend, add the mass to channel 0, evict by a
    slot rule from the third on) on the ragged store against the reference's masked cache. Eager:
    ``_C.decode_step``, a padded row on every other step. Captured: the ``store_decode_step`` op
    alone, with the plan of the pages held, as a CUDA graph replays it."""
    kv, pages = _page_dtypes(dtype)
    device = torch.device(device)
    ragged = RaggedLayerKV(BATCH, HEADS, HEAD_DIM, kv, device, 1, page_size=PAGE, kv_dtype=pages)
    masked = MaskedLayerKV(BATCH, HEADS, HEAD_DIM, kv, device, 1, kv_dtype=pages)
    L = max(map(max, LENS))
    k, v = _tokens(gen, L, kv)
    keep = (torch.arange(L) < torch.tensor(LENS)[..., None]).to(device)
    for storage in (ragged, masked):
        storage.append(k.to(device), v.to(device), torch.arange(L, device=device).expand(BATCH, L), keep)
    # In half types the float rounding of the mass differs from the reference's: the position
    # decides there, so that no near tie does.
    rule = "mass" if kv == torch.float32 else "position"
    budget = torch.tensor([3, 5], device=device)
    last_pos = torch.full((BATCH,), -1, dtype=torch.long, device=device)
    parts = []
    for step in range(6):
        k, v = (x.to(device) for x in _tokens(gen, 1, kv))
        q = torch.randn(BATCH, HEADS * GROUP, 1, HEAD_DIM, generator=gen).to(kv).to(device)
        pos = torch.full((BATCH, 1), L + step, dtype=torch.long, device=device)
        valid = None if captured or step % 2 == 0 else (torch.arange(BATCH) != step % 3).to(device)
        last_pos.copy_(torch.maximum(last_pos, pos[:, 0] if valid is None else pos[:, 0].masked_fill(~valid, -1)))
        evict = EvictByRule(rule, 1, 2, budget, budget.cpu()) if step >= 2 else None
        work = DecodeStep(stats=("mass", "last"), accumulate=("mass",), evict=evict, last_pos=last_pos)
        plan = None
        if captured:
            if not ragged.has_room(1):
                ragged.reserve(PAGE)
            plan = ragged.graph_plan(GROUP)
        got, got_stats = ragged.decode_step(k, v, pos, q, 0.25, work, valid, plan)
        if captured:
            ragged.note_graph_step(1, evict)
        want, want_stats = masked.decode_step(k, v, pos, q, 0.25, work, valid)
        parts.append(compare(f"step {step} out", got.float(), want.float(), OUT_TOL[dtype]))
        if evict is None:   # the statistics are of the tokens before an eviction
            for name in ("mass", "last"):
                parts.append(compare(f"step {step} {name}", ragged.view({name: got_stats[name]}, False)["stats"][name],
                                     masked.view({name: want_stats[name]}, False)["stats"][name], STEP_TOL))
        a, b = ragged.view(None, True), masked.view(None, True)
        parts += [compare(f"step {step} kept positions", _kept(a), _kept(b), EXACT),
                  compare(f"step {step} channels", a["channels"], b["channels"], STEP_TOL)]
        parts += [compare(f"step {step} {name}", a[name][a["mask"]], b[name][b["mask"]], EXACT) for name in ("k", "v")]
    return parts


# --- top-k over a flat slot layout (the scores are float32 whatever the pages hold) ---------
def _layout(gen):
    """Ragged segments with slack slots between them: scores, positions (repeated ones too),
    start, len, and the same padded for the reference."""
    lens = torch.tensor([7, 0, 1, 12, 5, 9])
    caps = lens + torch.tensor([2, 1, 0, 3, 0, 1])
    start = torch.cumsum(caps, 0) - caps
    scores = _tied_scores(gen, (int(caps.sum()),))
    pos = torch.randint(0, 20, scores.shape, generator=gen, dtype=torch.int32)
    index = (start[:, None] + torch.arange(int(lens.max()))).clamp(max=scores.numel() - 1)
    mask = torch.arange(int(lens.max())) < lens[:, None]
    return (scores, pos, start, lens.int()), (scores[index], pos[index], lens), index, mask


def _padded_keep(keep, index, mask):
    return keep.cpu()[index] & mask


def check_segmented_topk(device, dtype, gen):
    flat, padded, index, mask = _layout(gen)
    k = torch.tensor([3, 1, 0, 5, 9, 2])
    keep = segmented_topk(*(t.to(device) for t in flat), k.to(device))
    return [compare("keep", _padded_keep(keep, index, mask), reference.segmented_topk(*padded, k), EXACT),
            compare("slots kept outside the segments", int(keep.sum()), int((keep.cpu()[index] & mask).sum()), EXACT)]


def check_grouped_topk(device, dtype, gen):
    flat, padded, index, mask = _layout(gen)
    k = torch.tensor([4, 10, 0])
    keep, counts = grouped_topk(*(t.to(device) for t in flat), 2, k.to(device))
    want, want_counts = reference.grouped_topk(*padded, 2, k)
    return [compare("keep", _padded_keep(keep, index, mask), want, EXACT),
            compare("counts", counts, want_counts, EXACT)]


# --- a patched tiny model ----------------------------------------------------------------------
VOCAB = 101


def tiny_llama(dtype: torch.dtype, device) -> torch.nn.Module:
    """A 2-layer Llama with random weights (GQA, head_dim 64); larger query and key weights than
    the init give peaky attention, so that scores are far from ties."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                         max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return model.to(dtype=dtype, device=device).eval()


def teacher_forced_logits(model, cache, ids, mask, fed) -> torch.Tensor:
    """The logits of the prompt's last token and of each fed token, one step at a time: [B, steps + 1, V]."""
    pos = (mask.cumsum(dim=1) - 1).clamp_min(0)   # as generate: left padding shifts no position
    logits = []
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **with_cache(model, cache))
        logits.append(out.logits[:, -1])
        for t in range(fed.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(fed[:, t:t + 1], attention_mask=mask, position_ids=pos[:, -1:] + t + 1,
                        use_cache=True, **with_cache(model, cache))
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


def check_model(device, dtype, gen, policy) -> list[Part]:
    """The patched model's logits and kept positions, ragged path against reference path, on a
    left-padded batch of 2 (40 tokens, then 6 fed ones)."""
    kv, pages = _page_dtypes(dtype)
    model = tiny_llama(kv, device)
    ids = torch.randint(0, VOCAB, (BATCH, 40), generator=gen).to(device)
    mask = torch.ones(BATCH, 40, dtype=torch.long)
    mask[0, :3] = 0
    mask = mask.to(device)
    fed = torch.randint(0, VOCAB, (BATCH, 6), generator=gen).to(device)
    with patch(model, policy, kv_dtype=pages) as handle:
        ragged, masked = handle.new_cache(), handle.new_cache(reference=True)
        got = teacher_forced_logits(model, ragged, ids, mask, fed)
        want = teacher_forced_logits(model, masked, ids, mask, fed)
    parts = [compare("logits", got.float(), want.float(), MODEL_TOL[dtype])]
    for layer in range(len(model.model.layers)):
        a, b = ragged.layer_kv(layer).view(None, False), masked.layer_kv(layer).view(None, False)
        parts.append(compare(f"layer {layer} kept positions", _kept(a), _kept(b), EXACT))
    kept, seen = int(ragged.kept_tokens()[0].sum()), BATCH * 2 * (40 + 6)
    parts.append(compare("some tokens evicted", kept < seen, True, EXACT))
    return parts


# (op as the table names it, its check, the dtypes it runs in: None for every dtype, the
# environment variable that picks the CUDA kernel and its value: None for the default kernels).
SCORE_DTYPE = "float32 scores"
HALF = ("float16", "bfloat16", INT8_BF16)
BOTH = ("out", "statistics")
CHECKS: tuple[tuple[str, Callable, tuple[str, ...] | None, tuple[str, str] | None], ...] = (
    ("store_append", check_append, None, None),
    ("store_replace", check_replace, None, None),
    ("store_add_scores", check_add_scores, None, None),
    ("store_compact", partial(check_compact, stable=True), None, None),
    ("store_compact unordered", partial(check_compact, stable=False), None, None),
    ("store_topk", check_store_topk, None, None),
    ("store_check", check_store_check, None, None),
    ("attention_run", partial(check_attention, compared=("out",)), DTYPES + (INT8_BF16,), None),
    ("attention_run statistics", partial(check_attention, compared=("statistics",)), DTYPES + (INT8_BF16,), None),
    ("attention_run, scalar prefill (KVCACHE_EXT_TC_PREFILL=0)", partial(check_attention, compared=BOTH), HALF,
     ("KVCACHE_EXT_TC_PREFILL", "0")),
    ("attention_run, tensor-core decode (KVCACHE_EXT_TC_DECODE=1)", partial(check_attention, compared=BOTH), HALF,
     ("KVCACHE_EXT_TC_DECODE", "1")),
    ("store_decode_step (eager)", partial(check_decode_steps, captured=False), None, None),
    ("store_decode_step (captured)", partial(check_decode_steps, captured=True), None, None),
    ("segmented_topk", check_segmented_topk, (SCORE_DTYPE,), None),
    ("grouped_topk", check_grouped_topk, (SCORE_DTYPE,), None),
    # The tokens a score-based policy keeps can flip on a rounding in half types: those run the
    # position-based StreamingLLM only.
    ("patched model: Ada-SnapKV", partial(check_model, policy=Policy(SnapKV(window=4, kernel=3), budget=16,
                                                                     allocation=AdaKV())), ("float32", "int8"), None),
    ("patched model: H2O every step", partial(check_model, policy=Policy(H2O(recent=2), budget=16,
                                                                         schedule=EveryStep(prefill_block=16))),
     ("float32", "int8"), None),
    ("patched model: StreamingLLM every step",
     partial(check_model, policy=Policy(StreamingLLM(sinks=2), budget=12, schedule=EveryStep())), None, None),
)


def not_served(device: torch.device, switch: tuple[str, str] | None) -> str | None:
    """Why ``device`` does not serve the kernel ``switch`` picks, or None (every device serves
    every dtype's pages)."""
    if switch is not None and device.type != "cuda":
        return f"{switch[0]} picks a CUDA kernel"
    return None


def planned() -> list[tuple[str, str, Callable, tuple[str, str] | None]]:
    """(op, dtype, check, kernel switch) of every row, in the table's order."""
    return [(op, dtype, check, switch) for op, check, dtypes, switch in CHECKS for dtype in (dtypes or DTYPES)]


def _switched(check: Callable, switch: tuple[str, str] | None, *args) -> list[Part]:
    """``check(*args)`` with the kernel switch's environment variable set (restored after)."""
    if switch is None:
        return check(*args)
    name, value = switch
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        return check(*args)
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def run(device: torch.device, on_row: Callable[[Row], None] | None = None, seed: int = 0) -> list[Row]:
    """Every row of the check on ``device``; ``on_row`` is called with each as it completes."""
    rows = []
    for op, dtype, check, switch in planned():
        rows.append(_run_row(device, op, dtype, check, switch, seed))
        if on_row is not None:
            on_row(rows[-1])
    return rows


def _run_row(device: torch.device, op: str, dtype: str, check: Callable, switch, seed: int) -> Row:
    """One row. A check that raises is a failed row (its exception's last line), and the others
    still run; on CUDA the row waits for its kernels, so that a fault they raise is its own."""
    reason = not_served(device, switch)
    if reason is not None:
        return Row(op, dtype, not_served=reason)
    try:
        parts = _switched(check, switch, device, dtype, torch.Generator().manual_seed(seed))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:   # any exception is the kernel's failure to report, not the check's end
        return Row(op, dtype, raised=traceback.format_exception_only(exc)[-1].strip())
    return Row(op, dtype, parts)


HEADER = ("| op | dtype | max error | tolerance | pass |", "| --- | --- | --- | --- | --- |")


def table_line(row: Row) -> str:
    """One row of the table: the part nearest its tolerance (all parts of a failed row are in ``Row.why``)."""
    worst = row.worst
    if row.not_served is not None:
        cells = ("—", "—", f"not served: {row.not_served}")
    elif row.raised is not None or worst is None:
        cells = ("—", "—", "FAIL (raised)")
    else:
        cells = (f"{worst.error:.2g}", f"{worst.tol:g}" if worst.tol else "0 (equal)", row.status)
    return f"| {row.op} | {row.dtype} | " + " | ".join(cells) + " |"


def failures(rows: list[Row]) -> list[str]:
    """One line per failed row, naming the kernel, the dtype and what differed."""
    return [f"FAILED: {row.op} ({row.dtype}): {row.why()}" for row in rows if row.status == "FAIL"]
