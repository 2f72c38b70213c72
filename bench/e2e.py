"""End to end: prefill, decode speed and memory of a whole model, full cache against eviction.

    python bench/e2e.py                        # GPU: Llama-3.1-8B's architecture with random bf16
                                               # weights, contexts 8K/32K/128K, batch 1/4/16
    python bench/e2e.py                        # CPU: the default model, contexts 2K/8K, batch 1/4,
                                               # keeping 12.5 % of each prompt
    python bench/e2e.py --model tiny --quick   # a tiny random Llama, a few seconds (the smoke test)
    python bench/e2e.py --model host --device cpu --contexts 1024 --batches 1 --budgets 128 \
        --methods full,snapkv,h2o-step         # the host work per layer: 8B's layers, tiny widths

Every (context, batch) runs these methods side by side in one process, on the same prompt:

- ``full``: the unpatched model with transformers' ``DynamicCache`` and SDPA.
- ``masked-ada-snapkv``: head-wise eviction by masking a full-size cache, the way kvpress runs
  Ada-KV: the full ``DynamicCache`` stays in memory, and every decode step attends over all of
  it with a per-head mask of Ada-SnapKV's kept tokens (the same tokens ``ada-snapkv`` keeps, taken
  from its run). Attention packs the G query heads of a KV head, so K/V are not repeated: the
  fastest masked decode we know through SDPA. Its prefill is the full one; the scoring is not
  counted, which flatters it.
- ``snapkv`` and ``ada-snapkv``: ours, compressed once after the prefill (one-shot); the cache
  then grows by one token per decode step. Its cache is told the run's length (prompt +
  warmup + steps, as the patched ``generate`` tells it ``max_length - 1``), so it holds pages
  for every decode token once the prompt is compressed, and decoding allocates nothing.
- ``snapkv-graph``, ``ada-snapkv-graph`` and ``h2o-step-graph``: the same, with
  ``patch(..., cuda_graph=True)``: each decode step after the first two is a replay of a CUDA
  graph captured once (``kvcache_ext.hf.decode_graph``; its counts are in the record's
  ``graph``); H2O's graph evicts too. On a CPU the steps run eagerly, as the plain methods'.
- ``h2o-step`` and ``caote-step``: ours, per-step decode eviction holding the cache at its
  budget. The prefill is block-wise (blocks of 128, evicting after each, the H2O and CAOTE
  papers' protocol), so the prompt's cache never exceeds the budget plus a block.
- ``kvpress-snapkv`` and ``kvpress-ada-snapkv``: kvpress itself, ``SnapKVPress`` and
  ``AdaKVPress(SnapKVPress)`` on HF's ``DynamicCache``, run when ``import kvpress`` works
  (``pip install ".[bench]"``; kvpress 0.5.5 needs transformers < 5.3): ``with press(model):``
  around the prefill, then the same greedy decode, given the positions (kvpress's cache drops the
  pruned tokens, so HF would number the next token from the kept count; kvpress's own pipeline
  passes them too). The same kept count: kvpress keeps ``int(context * (1 - compression_ratio))``
  tokens per KV head, its window included, as our B includes ours; the ratio is set half a token
  below ``1 - B / context`` so that this is exactly B (0, no compression, when B >= context).
  SnapKVPress gets our SnapKV's window (32 queries; its default is 64) and kernel (7; its
  default 5); its pooling is an average (ours: max), and both average the G query heads.
  AdaKVPress keeps its own safeguard (``alpha_safeguard=0.2``: every head keeps at least 20 %
  of B; ours, ``AdaKV(alpha=0.5)``, about half) and masks a full-size cache: every decode step
  overwrites the pruned keys with a key whose attention underflows to zero. It holds every
  token; its mask is three int64 index tensors per layer (24 bytes per pruned token and head).
  Importing kvpress wraps every transformers attention function of the process (a no-op for a
  module without kvpress's mask), so in that process the other methods run through it too.

Timing: every method runs ``--repeats`` times per (context, batch), the runs interleaved (one
run of each method per round, each round starting one method later); a run decodes ``--warmup``
untimed steps, then ``--steps`` timed ones; the table reports the median run.

Reported per method: prefill seconds, decode tokens/s (batch x steps / decode seconds), peak GPU
memory (``torch.cuda.max_memory_allocated``, of the prefill and of the decode apart, the peak
column being the larger; not measured on CPU),
the model's bytes, the KV bytes at the end (``DynamicCache`` K+V; ``RaggedCache.nbytes``: K, V,
positions, score channels and the free slots the store reserves; for the masked cache, K+V plus
one bool per token and head; for ``kvpress-ada-snapkv``, K+V plus its index tensors), the tokens
held (over layers, rows and KV heads; the masked caches hold them all), and the decode
workspace: decode peak - model - KV at the end.

On CUDA every MLP runs over at most ``--mlp-chunk`` tokens at a time (default 8192): the
prefill of 16 x 32K tokens would otherwise need 45 GB for one MLP's intermediate activations.
A run that does not fit is recorded as out of memory, and the next methods go on.

Derived, from runs of one process only:
- ``x full``: decode tokens/s over the full cache's at the same context and batch.
- ``eviction share`` of ``h2o-step`` and ``caote-step``: 1 - decode time of ``snapkv`` at the
  same budget / theirs (of ``h2o-step-graph``: against ``snapkv-graph``'s; 1 - the share is
  the ratio of per-step eviction's tokens/s to one-shot SnapKV's). SnapKV's decode does no scoring, selection or compaction (its cache
  grows), so the difference is the eviction work (an estimate: SnapKV's cache is up to
  ``--steps`` tokens per head longer).
- ``x_eager`` and ``tokens_as_eager`` of a ``-graph`` method: its decode tokens/s over the
  same policy's eager run, and whether their greedy tokens agree (in bf16 they may differ
  without a bug: the two attend with other splits of the same tokens).
- the largest batch x context of the grid that each method ran without running out of memory.
- per (context, batch, B), in a second table: ours SnapKV's KV bytes / kvpress SnapKV's, ours
  Ada-SnapKV's / ours SnapKV's, and ours SnapKV's decode tokens/s / kvpress SnapKV's.

``--keep`` gives the budget as a fraction of each context (B = round(keep x context) tokens per
KV head) instead of ``--budgets``; on CPU it is the default, 0.125.

Results go to bench/results/e2e-<device>-<date>.json (not with --quick unless --out is given),
and with --plot to a PNG of decode throughput and peak memory against context.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, git_commit, run_metadata, sync, write_results  # noqa: E402

from kvcache_ext.cache_argument import with_cache  # noqa: E402
from kvcache_ext.cli.args import fraction_list, int_list  # noqa: E402
from kvcache_ext.evaluation.decoding import cache_bytes  # noqa: E402
from kvcache_ext.evaluation.kvpress_runs import compression_ratio, kvpress_missing  # noqa: E402
from kvcache_ext.evaluation.kvpress_runs import mask_bytes as kvpress_mask_bytes  # noqa: E402
from kvcache_ext.evaluation.kvpress_runs import unmask as kvpress_unmask  # noqa: E402
from kvcache_ext.kernels.attention import CUDA_HEAD_DIMS  # noqa: E402
from kvcache_ext.policies import CAOTE, H2O, AdaKV, Policy, Schedule, SnapKV  # noqa: E402

# Llama-3.1-8B's architecture (its config.json), built with random weights: no download.
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
# Llama-3.1-8B's layers and heads (32 layers, 32 query and 8 KV heads) at tiny widths: the
# arithmetic of a step is negligible, so what a method adds to the full cache's step time is
# the host work it does per layer (the Python, the ops' dispatch, the page allocator). On CUDA
# its head_dim is 64 (model_config).
HOST = dict(TINY, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)
MODELS = {"llama8b": LLAMA_8B, "tiny": TINY, "host": HOST}


def model_config(name: str, device: str) -> dict:
    """MODELS[name], except that on CUDA a head_dim the CUDA attention kernel does not take (the
    tiny widths' 16) is raised to the next size it takes (64), every other width kept. On the
    CPU the config is unchanged, so that CPU numbers stay comparable across runs."""
    config = MODELS[name]
    if device.startswith("cuda") and config["head_dim"] not in CUDA_HEAD_DIMS:
        config = dict(config, head_dim=min(d for d in CUDA_HEAD_DIMS if d >= config["head_dim"]))
    return config

STEP_BLOCK = 128   # the block-wise prefill of the per-step eviction methods
POLICIES = {       # name -> Policy at budget b
    "snapkv": lambda b: Policy(SnapKV(), budget=b),
    "ada-snapkv": lambda b: Policy(SnapKV(), budget=b, allocation=AdaKV()),
    "h2o-step": lambda b: Policy(H2O(recent=b // 2), budget=b,
                                 schedule=Schedule(prefill_block=STEP_BLOCK, decode_every=1)),
    "caote-step": lambda b: Policy(CAOTE(H2O(recent=b // 2), output_after_eviction=False), budget=b,
                                   schedule=Schedule(prefill_block=STEP_BLOCK, decode_every=1)),
}
# The same policies with their decode steps in a CUDA graph (patch(..., cuda_graph=True)); on
# a CPU they run eagerly, as their plain names.
GRAPHED = {"snapkv-graph": "snapkv", "ada-snapkv-graph": "ada-snapkv", "h2o-step-graph": "h2o-step"}
# Per-step eviction, each against the one-shot SnapKV decoding as it does (eager or graphed).
PER_STEP = {"h2o-step": "snapkv", "caote-step": "snapkv", "h2o-step-graph": "snapkv-graph"}
KVPRESS = ("kvpress-snapkv", "kvpress-ada-snapkv")   # kvpress's presses, when it is installed
METHODS = ("full", "masked-ada-snapkv") + tuple(POLICIES) + tuple(GRAPHED) + KVPRESS
MASKED = "kvcache_bench_masked"   # the masked method's registered attention function


# --- the model and the prompt -----------------------------------------------------------------
def build_model(name: str, device: str, dtype: torch.dtype):
    """(model, tokenizer or None): random weights from a config, or the default model."""
    if name == "smollm2":
        from kvcache_ext.hf.models import load_model
        return load_model(None, dtype=dtype, device=device)
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**model_config(name, device))
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)        # built in its dtype, on its device: no fp32 copy of 8B
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.set_attn_implementation("sdpa")
    return model.eval(), None


def chunk_mlps(model, tokens: int) -> None:
    """Runs every decoder layer's MLP over at most ``tokens`` tokens at a time. An MLP acts on
    each token alone, so the output is the same; the prefill's largest transient (3 x tokens x
    the intermediate size: 45 GB for Llama-3.1-8B at 16 x 32K) shrinks to a chunk's. Every
    method gets the same prefill, so the comparison is unchanged."""
    for layer in model.model.layers:
        def chunked(x, forward=layer.mlp.forward):
            flat = x.reshape(-1, x.shape[-1])
            if flat.shape[0] <= tokens:
                return forward(x)
            out = torch.empty_like(flat)
            for start in range(0, flat.shape[0], tokens):
                out[start:start + tokens] = forward(flat[start:start + tokens])
            return out.view(x.shape)
        layer.mlp.forward = chunked


def prompt_ids(model, tokenizer, context: int, batch: int, device: str) -> torch.Tensor:
    """[batch, context]: corpus prose for a real model (row b from seed b), else seeded random ids."""
    if tokenizer is not None:
        from kvcache_ext.tasks.prose import prose_ids
        return torch.stack([prose_ids(tokenizer, context, seed=b) for b in range(batch)]).to(device)
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (batch, context), generator=gen).to(device)


# --- the masked method ------------------------------------------------------------------------
class HeadMasks:
    """Per layer, keep [B, H, n] bool over the prompt; decode tokens are always visible."""

    def __init__(self, keep: list[torch.Tensor], steps: int, device: str):
        B, H, n = keep[0].shape
        # Allocated once with room for every decode token, so a step only slices.
        self.visible = [torch.cat([k, k.new_ones(B, H, steps + 1)], dim=2)[:, :, None, :].to(device)
                        for k in keep]
        self.nbytes = sum(k.numel() for k in keep)   # one byte per bool


_active_masks: HeadMasks | None = None


def masked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA with a per-head mask at decode (one query token); the model's SDPA otherwise."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if _active_masks is None or query.shape[2] != 1:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask,
                                              scaling=scaling, dropout=dropout, **kwargs)
    B, Hq, _, D = query.shape
    H, L = key.shape[1], key.shape[2]
    mask = _active_masks.visible[module.layer_idx][..., :L]               # [B, H, 1, L]
    packed = query.reshape(B, H, Hq // H, D)                              # G queries per KV head
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask,
                                                           scale=scaling)
    return out.reshape(B, Hq, 1, D).transpose(1, 2), None


def register_masked() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    AttentionInterface.register(MASKED, masked_attention)
    AttentionMaskInterface.register(MASKED, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def kept_masks(cache, prompt_len: int) -> list[torch.Tensor]:
    """Per layer, [B, H, prompt_len] bool: the prompt positions a RaggedCache holds per head."""
    masks = []
    for i in range(len(cache.layers)):
        view = cache.layer_kv(i).store.to_dense()
        hits = torch.zeros(view.mask.shape[:2] + (prompt_len,), dtype=torch.int32, device=view.mask.device)
        hits.scatter_add_(2, view.pos.long().clamp(0, prompt_len - 1), view.mask.int())
        masks.append((hits > 0).cpu())
    return masks


# --- kvpress ----------------------------------------------------------------------------------
def kvpress_press(method: str, budget: int, context: int):
    """kvpress's press keeping ``budget`` tokens per KV head of a ``context``-token prompt, with
    our SnapKV's window and kernel."""
    from kvpress import AdaKVPress, SnapKVPress
    ours = SnapKV()
    snap = SnapKVPress(compression_ratio=compression_ratio(budget, context), window_size=ours.window,
                       kernel_size=ours.kernel)
    return AdaKVPress(snap) if method == "kvpress-ada-snapkv" else snap


# --- one run ----------------------------------------------------------------------------------
def kv_tokens(cache) -> int:
    """Tokens held, summed over layers, batch rows and KV heads."""
    if hasattr(cache, "kept_tokens"):
        return sum(int(t.sum()) for t in cache.kept_tokens())
    return sum(layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2] for layer in cache.layers)


# Warmup decode steps that also measure the host's share of a step (run_one).
HOST_PROBES = 3


@torch.no_grad()
def run_one(model, ids, method: str, budget: int | None, steps: int, device: str,
            masks: list[torch.Tensor] | None = None, on_prefill=None, warmup: int = 0) -> dict:
    """Prefill ``ids`` and decode ``warmup`` + ``steps`` greedy tokens with one method, timing
    the last ``steps`` (the first decode steps of a run pay one-time costs: lazy imports,
    allocator growth, the store's first pages); the record. Up to HOST_PROBES warmup steps after
    the first are also timed alone: ``host_s_per_step`` (until the step's last launch has
    returned; on a GPU, the host's own work) and ``synced_step_s`` (until the device is done)."""
    global _active_masks
    import kvcache_ext
    from transformers import DynamicCache
    cuda = device.startswith("cuda")
    record = dict(method=method, budget=budget, context=ids.shape[1], batch=ids.shape[0], steps=steps,
                  warmup_steps=warmup)
    handle = None
    cache = None
    press = None
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if method in POLICIES or method in GRAPHED:
            handle = kvcache_ext.patch(model, POLICIES[GRAPHED.get(method, method)](budget),
                                       cuda_graph=method in GRAPHED)
            # What the patched generate gives its cache: the sequence's length to come, so
            # that a growing cache holds pages for the decode steps up front.
            cache = handle.new_cache(max_cache_len=ids.shape[1] + warmup + steps)
        else:
            cache = DynamicCache(config=model.config)
            if method.startswith("masked"):
                model.set_attn_implementation(MASKED)
            elif method in KVPRESS:
                press = kvpress_press(method, budget, ids.shape[1])
        sync(device)
        t0 = time.perf_counter()
        with press(model) if press is not None else contextlib.nullcontext():
            out = model(ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        sync(device)
        record["prefill_s"] = time.perf_counter() - t0
        del out
        if cuda:   # the decode phase's own peak, apart from the prefill's transients
            record["prefill_peak_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if on_prefill is not None:
            on_prefill(cache)
        if method.startswith("masked"):
            _active_masks = HeadMasks(masks, warmup + steps, device)
        tokens = [token]
        host, whole = [], []
        for step in range(warmup + steps):   # positions given: kvpress's cache does not count the pruned tokens
            if step == warmup:
                sync(device)
                t0 = time.perf_counter()
            # The last HOST_PROBES warmup steps (never the first step) run alone, synced before
            # and after: the time until the host has issued the step against the step's.
            probe = max(1, warmup - HOST_PROBES) <= step < warmup
            if probe:
                sync(device)
                h0 = time.perf_counter()
            position = torch.full_like(token, ids.shape[1] + step)
            out = model(tokens[-1], **with_cache(model, cache), use_cache=True, position_ids=position)
            tokens.append(out.logits[:, -1].argmax(dim=-1, keepdim=True))
            if probe:
                host.append(time.perf_counter() - h0)
                sync(device)
                whole.append(time.perf_counter() - h0)
        sync(device)
        record["decode_s"] = time.perf_counter() - t0
        if host:
            record["host_s_per_step"] = statistics.median(host)
            record["synced_step_s"] = statistics.median(whole)
        # The greedy tokens: methods that keep the same tokens must agree (checked by the tests).
        record["tokens"] = torch.cat(tokens, dim=1).tolist()
        if steps:
            record["decode_tokens_per_s"] = ids.shape[0] * steps / record["decode_s"]
        mask_bytes = (_active_masks.nbytes if _active_masks is not None else
                      kvpress_mask_bytes(model) if press is not None else 0)
        if method in GRAPHED:   # what the steps did: a capture that failed leaves them eager
            graph = cache.decode_graph()
            record["graph"] = dict(warmups=graph.warmups, captures=graph.captures, replays=graph.replays,
                                   eager_steps=graph.eager_steps, failed=graph.failed)
        record["kv_bytes"] = cache_bytes(cache) + mask_bytes
        record["kv_tokens"] = kv_tokens(cache)
        if cuda:
            record["decode_peak_bytes"] = torch.cuda.max_memory_allocated()
            record["peak_bytes"] = max(record["prefill_peak_bytes"], record["decode_peak_bytes"])
        record["status"] = "ok"
    except torch.OutOfMemoryError:
        record["status"] = "out of memory"
    finally:
        _active_masks = None
        if handle is not None:
            handle.unpatch()
        elif method.startswith("masked"):
            model.set_attn_implementation("sdpa")
        elif press is not None:
            kvpress_unmask(model)
        del cache
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return record


def median_record(runs: list[dict]) -> dict:
    """One method's repeats as one record: the first run's, with the median prefill and decode
    seconds (decode tokens/s from that median) and every run's seconds; the first failure
    when a run failed."""
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        return failed[0]
    record = dict(runs[0])
    for key in ("prefill_s", "decode_s"):
        record[key + "_runs"] = [r[key] for r in runs]
        record[key] = statistics.median(record[key + "_runs"])
    for key in ("host_s_per_step", "synced_step_s"):
        if all(key in r for r in runs):
            record[key] = statistics.median(r[key] for r in runs)
    if record["steps"]:
        record["decode_tokens_per_s"] = record["batch"] * record["steps"] / record["decode_s"]
    return record


def budgets_of(args, context: int) -> list[int]:
    """Tokens per KV head at this context: --budgets, or --keep's fractions of the context."""
    return args.budgets or [round(keep * context) for keep in args.keep]


def run_grid(model, tokenizer, args, device: str, progress: bool, checkpoint=None) -> list[dict]:
    """Every run of the grid; ``checkpoint(rows)``, when given, gets the rows so far (runs of the
    current context and batch as single-run records) after every run, so that a run stopped by a
    time limit leaves what it measured (bench/tools/gpu_verify.sh)."""
    from tqdm.auto import tqdm
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    budget_methods = [m for m in args.methods if m != "full"]
    levels = len(args.budgets or args.keep)
    total = (len(args.contexts) * len(args.batches) * (("full" in args.methods) + len(budget_methods) * levels)
             * args.repeats)
    bar = tqdm(total=total, desc="e2e", disable=not progress)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            ids = prompt_ids(model, tokenizer, context, batch, device)
            runs = [("full", None)] if "full" in args.methods else []
            runs += [(m, b) for b in budgets_of(args, context) for m in budget_methods]
            # The masked method needs Ada-SnapKV's kept tokens of its budget: it runs after it.
            runs.sort(key=lambda r: r[0].startswith("masked"))
            masks = {}   # budget -> Ada-SnapKV's kept tokens (on the CPU: not in the others' peaks)

            def keep_masks(budget):
                return lambda cache: masks.__setitem__(budget, kept_masks(cache, context))
            repeats = {run: [] for run in runs}
            for rep in range(args.repeats):
                # Interleaved: every method runs once per round, and each round starts one method
                # later, so that no method always runs first (or right after the same one) while
                # the machine's load drifts. The first round keeps the masked method last.
                shift = rep % len(runs)
                for method, budget in runs[shift:] + runs[:shift]:
                    bar.set_postfix_str(f"{context} x {batch}: {method}" + (f" B={budget}" if budget else "")
                                        + (f" ({rep + 1}/{args.repeats})" if args.repeats > 1 else ""))
                    if method.startswith("masked") and budget not in masks:   # ada-snapkv not asked for
                        run_one(model, ids, "ada-snapkv", budget, 0, device, on_prefill=keep_masks(budget))
                    repeats[(method, budget)].append(
                        run_one(model, ids, method, budget, args.steps, device, masks=masks.get(budget),
                                on_prefill=keep_masks(budget) if method == "ada-snapkv" and not rep else None,
                                warmup=args.warmup))
                    bar.update()
                    if checkpoint is not None:
                        checkpoint(rows + [median_record(r) for r in repeats.values() if r])
            for method, budget in runs:
                record = median_record(repeats[(method, budget)])
                record["model_bytes"] = model_bytes
                if args.keep and budget is not None:
                    record["keep"] = args.keep[budgets_of(args, context).index(budget)]
                if "peak_bytes" in record:   # what decoding needs beyond the model and the cache
                    record["workspace_bytes"] = record["decode_peak_bytes"] - model_bytes - record["kv_bytes"]
                rows.append(record)
            del ids, masks
    bar.close()
    return rows


# --- what the runs say ------------------------------------------------------------------------
def derive(rows: list[dict]) -> dict:
    """Ratios within one (context, batch), the eviction share, and the largest fit per method."""
    ok = [r for r in rows if r["status"] == "ok"]
    def find(method, context, batch, budget=None):
        return next((r for r in ok if (r["method"], r["context"], r["batch"], r["budget"]) ==
                     (method, context, batch, budget)), None)
    for r in ok:
        full = find("full", r["context"], r["batch"])
        if full is not None:
            r["x_full"] = r["decode_tokens_per_s"] / full["decode_tokens_per_s"]
        if r["method"] in GRAPHED:   # against the same policy's eager steps
            eager = find(GRAPHED[r["method"]], r["context"], r["batch"], r["budget"])
            if eager is not None:
                r["x_eager"] = r["decode_tokens_per_s"] / eager["decode_tokens_per_s"]
                r["tokens_as_eager"] = r["tokens"] == eager["tokens"]
        if r["method"] in PER_STEP:
            snap = find(PER_STEP[r["method"]], r["context"], r["batch"], r["budget"])
            if snap is not None:
                r["eviction_share"] = 1 - snap["decode_s"] / r["decode_s"]
    largest = {}
    for r in ok:
        key = r["method"] + (f"@{level(r)}" if r["budget"] else "")
        size = r["batch"] * r["context"]
        if size > largest.get(key, (0,))[0]:
            largest[key] = (size, r["batch"], r["context"])
    return {key: dict(batch=b, context=c) for key, (_, b, c) in largest.items()}


def level(r: dict) -> str:
    """A run's budget as asked: B tokens per KV head, or --keep's percentage of the context."""
    return f"{100 * r['keep']:g}%" if r.get("keep") else str(r["budget"] or "")


def kvpress_ratios(rows: list[dict]) -> list[dict]:
    """Per (context, batch, B) of ours SnapKV: its KV bytes over kvpress SnapKV's, ours Ada-SnapKV's
    over its, and its decode tokens/s over kvpress SnapKV's; None where one of the two did not run."""
    ok = {(r["method"], r["context"], r["batch"], r["budget"]): r for r in rows if r["status"] == "ok"}
    ratios = []
    for (method, *case), snap in ok.items():
        kvp, ada = ok.get(("kvpress-snapkv", *case)), ok.get(("ada-snapkv", *case))
        if method == "snapkv" and (kvp or ada):
            ratios.append(dict(zip(("context", "batch", "budget"), case),
                               snapkv_over_kvpress_bytes=kvp and snap["kv_bytes"] / kvp["kv_bytes"],
                               ada_over_snapkv_bytes=ada and ada["kv_bytes"] / snap["kv_bytes"],
                               snapkv_over_kvpress_decode=kvp and snap["decode_tokens_per_s"] /
                               kvp["decode_tokens_per_s"]))
    return ratios


def format_table(rows: list[dict]) -> str:
    big = max((r.get("peak_bytes", r.get("kv_bytes", 0)) for r in rows), default=0) >= 2**30
    unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)

    def size(n) -> str:
        return "—" if n is None else f"{n / scale:.2f}"
    head = (f"| context | batch | method | B | prefill s | decode tok/s | x full | peak {unit} | KV {unit} "
            f"| workspace {unit} | eviction share |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['context']} | {r['batch']} | {r['method']} | {r['budget'] or '—'} "
                         f"| {r['status']} | | | | | | |")
            continue
        x = f"{r['x_full']:.2f}" if "x_full" in r else "—"
        share = f"{100 * r['eviction_share']:.1f}%" if "eviction_share" in r else "—"
        lines.append(f"| {r['context']} | {r['batch']} | {r['method']} | {r['budget'] or '—'} "
                     f"| {r['prefill_s']:.2f} | {r['decode_tokens_per_s']:.1f} | {x} "
                     f"| {size(r.get('peak_bytes'))} | {size(r['kv_bytes'])} | {size(r.get('workspace_bytes'))} "
                     f"| {share} |")
    graphed = [r for r in rows if r["status"] == "ok" and "graph" in r]
    lines += [""] if graphed else []
    for r in graphed:
        g = r["graph"]
        eager = (f"{r['x_eager']:.2f}x the eager {GRAPHED[r['method']]}'s decode tok/s, "
                 f"{'the same' if r['tokens_as_eager'] else 'other'} tokens; " if "x_eager" in r else "")
        lines.append(f"{r['method']} at {r['context']} x {r['batch']}: {eager}steps warmed up "
                     f"{g['warmups']}, captured {g['captures']}, replayed {g['replays']}, eager {g['eager_steps']}"
                     + (f" (capture failed: {g['failed']})" if g["failed"] else ""))
    ratios = kvpress_ratios(rows)
    if ratios:
        head = ("| context | batch | B | ours snapkv / kvpress snapkv, KV bytes | ours ada-snapkv / ours snapkv, "
                "KV bytes | ours snapkv / kvpress snapkv, decode tok/s |")
        lines += ["", head, "|" + " --- |" * 6]
        for q in ratios:
            lines.append(f"| {q['context']} | {q['batch']} | {q['budget']} | " + " | ".join(
                "—" if x is None else f"{x:.3f}" for x in list(q.values())[3:]) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if r["status"] == "ok"]
    batches = sorted({r["batch"] for r in ok})
    keys = sorted({(r["method"], level(r)) for r in ok})
    budgets = sorted({b for _, b in keys})
    color = {m: plt.cm.tab10(i) for i, m in enumerate(METHODS)}          # colour: method
    style = {b: ("-", "--", ":", "-.")[i % 4] for i, b in enumerate(budgets)}   # line: budget
    fig, axes = plt.subplots(2, len(batches), figsize=(5 * len(batches), 8), squeeze=False)
    for col, batch in enumerate(batches):
        for method, budget in keys:
            pts = sorted((r["context"], r["decode_tokens_per_s"], r.get("peak_bytes", r["kv_bytes"]))
                         for r in ok if (r["method"], level(r), r["batch"]) == (method, budget, batch))
            if not pts:
                continue
            label = method + (f" B={budget}" if budget else "")
            ctx = [p[0] for p in pts]
            line = dict(color=color[method], linestyle=style[budget], marker="o", label=label)
            axes[0, col].plot(ctx, [p[1] for p in pts], **line)
            axes[1, col].plot(ctx, [p[2] / 2**30 for p in pts], **line)
        axes[0, col].set_title(f"batch {batch}")
        for row, ylabel in enumerate(("decode tokens/s", "peak GiB" if any("peak_bytes" in r for r in ok)
                                      else "KV GiB")):
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].grid(alpha=0.3)
            axes[row, col].set_xlabel("context (tokens)")
            axes[row, col].set_ylabel(ylabel)
    axes[0, -1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(paths: list[str], out: str | None, png: str | None) -> int:
    """The rows of several result files as one table (each (context, batch) from one run)."""
    docs = [json.load(open(p)) for p in paths]
    rows = [r for d in docs for r in d["rows"]]
    seen = {}
    for i, d in enumerate(docs):
        for r in d["rows"]:
            key = (r["context"], r["batch"])
            if seen.setdefault(key, i) != i:
                sys.exit(f"e2e --report: context {key[0]} x batch {key[1]} is in two runs; ratios "
                         "must come from one run")
    largest = derive(rows)
    print(format_table(rows))
    if out:
        merged = dict(docs[0], rows=rows, largest_fit=largest, kvpress_ratios=kvpress_ratios(rows),
                      table=format_table(rows), merged_from=paths)
        with open(out, "w") as f:
            json.dump(merged, f, indent=2)
        print(f"wrote {out}")
    if png is not None:
        png = png or os.path.splitext(out or paths[0])[0] + ".png"
        plot(rows, png, f"{docs[0]['model']} on {docs[0]['device']}, {docs[0]['steps']} decode steps")
        print(f"wrote {png}")
    return 0


# --- the command line -------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("llama8b", "smollm2", "tiny", "host"),
                        help="default: llama8b on CUDA, smollm2 on CPU")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--contexts", type=int_list, help="default: 8192,32768,131072 (GPU); 2048,8192 (CPU)")
    parser.add_argument("--batches", type=int_list, help="default: 1,4,16 (GPU); 1,4 (CPU)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budgets", type=int_list, help="tokens per KV head; default 512,1024,2048 (GPU)")
    budget.add_argument("--keep", type=fraction_list,
                        help="instead of --budgets: the kept fraction of each context, B = round(keep x "
                        "context) tokens per KV head; default 0.125 (CPU)")
    parser.add_argument("--steps", type=int, help="decode steps timed; default 256 (GPU), 64 (CPU)")
    parser.add_argument("--warmup", type=int, help="decode steps before the timed ones, per run; "
                        "default 4 (1 with --quick)")
    parser.add_argument("--repeats", type=int, help="runs of every method per context and batch, "
                        "interleaved; the median is reported (default 3, 1 with --quick)")
    parser.add_argument("--methods", help=f"of {', '.join(METHODS)} (default: all; on a CPU, which has no "
                        "CUDA graphs, all but the -graph ones)")
    parser.add_argument("--mlp-chunk", type=int, help="tokens per MLP call in the prefill; 0: off "
                        "(default 8192 on CUDA, off on CPU)")
    parser.add_argument("--quick", action="store_true", help="small sizes, prints only (a smoke run)")
    parser.add_argument("--out", help="the JSON path (default bench/results/e2e-<device>-<date>.json)")
    parser.add_argument("--plot", nargs="?", const="", help="also a PNG (default: next to the JSON)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="runs nothing: the table (and --plot) of earlier result files together, "
                        "e.g. one context per file when a machine limits how long a command may run")
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report, args.out, args.plot)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU")
    if args.methods is None:
        args.methods = ",".join(m for m in METHODS if cuda or m not in GRAPHED)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    if any(m in KVPRESS for m in args.methods) and (why := kvpress_missing()):
        print(f"skipped {', '.join(KVPRESS)}: {why}")
        args.methods = [m for m in args.methods if m not in KVPRESS]
    args.model = args.model or ("llama8b" if cuda else "smollm2")
    quick = args.quick
    args.contexts = args.contexts or ([512, 1024] if quick else [8192, 32768, 131072] if cuda else [2048, 8192])
    args.batches = args.batches or ([1, 2] if quick else [1, 4, 16] if cuda else [1, 4])
    if not args.keep:
        args.budgets = args.budgets or ([64] if quick else [512, 1024, 2048] if cuda else None)
        args.keep = None if args.budgets else [0.125]
    if any(not 0 < keep <= 1 for keep in args.keep or ()):
        parser.error("--keep takes fractions in (0, 1]")
    args.steps = args.steps or (8 if quick else 256 if cuda else 64)
    args.warmup = args.warmup if args.warmup is not None else 1 if quick else 4
    args.repeats = args.repeats or (1 if quick else 3)
    if args.warmup < 0 or args.repeats < 1:
        parser.error("--warmup must be >= 0 and --repeats >= 1")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    if min(args.contexts) <= STEP_BLOCK or args.steps < 1:
        parser.error(f"contexts must exceed the block-wise prefill's block ({STEP_BLOCK}) and steps be >= 1")

    try:   # a budget a method refuses fails now, not after an hour of runs
        for budget in {b for context in args.contexts for b in budgets_of(args, context)}:
            [POLICIES[m](budget) for m in POLICIES if m in args.methods or m == "ada-snapkv"]
    except ValueError as e:
        parser.error(str(e))
    register_masked()
    model, tokenizer = build_model(args.model, device, dtype)
    args.mlp_chunk = args.mlp_chunk if args.mlp_chunk is not None else 8192 if cuda else 0
    if args.mlp_chunk:
        chunk_mlps(model, args.mlp_chunk)
    import kvcache_ext
    package = os.path.dirname(os.path.abspath(kvcache_ext.__file__))   # installed, or the checkout
    import transformers
    kvpress = importlib.metadata.version("kvpress") if any(m in KVPRESS for m in args.methods) else None
    print(f"e2e on {device_name(device)}: {args.model} ({dtype}), contexts {args.contexts}, batches "
          f"{args.batches}, " + (f"budgets {args.budgets}" if args.budgets else f"keep {args.keep}") +
          f", {args.steps} decode steps (after {args.warmup}, median of {args.repeats} interleaved runs), "
          f"commit {git_commit()}, kvcache_ext from {package}, transformers "
          f"{transformers.__version__}" + (f", kvpress {kvpress}" if kvpress else ""))
    def checkpoint(rows_so_far):   # the rows measured so far, marked partial
        with open(args.out, "w") as f:
            json.dump(dict(benchmark="e2e", **run_metadata(device), partial=True, rows=rows_so_far), f, indent=2)
    rows = run_grid(model, tokenizer, args, device, progress=not args.no_progress,
                    checkpoint=checkpoint if args.out else None)
    largest = derive(rows)
    print(format_table(rows))
    print("largest batch x context that ran: " +
          ", ".join(f"{k} {v['batch']} x {v['context']}" for k, v in largest.items()))
    extra = dict(model=args.model, head_dim=model.config.head_dim, dtype=str(dtype).removeprefix("torch."),
                 steps=args.steps, warmup_steps=args.warmup, repeats=args.repeats,
                 step_prefill_block=STEP_BLOCK, mlp_chunk=args.mlp_chunk, kvcache_ext_path=package,
                 transformers=transformers.__version__, kvpress=kvpress, keep=args.keep,
                 largest_fit=largest, kvpress_ratios=kvpress_ratios(rows), table=format_table(rows))
    path = args.out
    if path:
        doc = dict(benchmark="e2e", **run_metadata(device), torch=torch.__version__, **extra, rows=rows)
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
    elif not quick:
        path = write_results("e2e", device, rows, extra)
    if path:
        print(f"wrote {path}")
    if args.plot is not None:
        png = args.plot or (os.path.splitext(path)[0] + ".png" if path else "e2e.png")
        plot(rows, png, f"{args.model} on {device_name(device)}, {args.steps} decode steps")
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
