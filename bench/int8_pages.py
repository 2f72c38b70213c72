"""int8 pages against the unquantized store and against transformers' QuantizedCache, side by side.

    python bench/int8_pages.py                  # the default model (fp32, CPU), 6 passkey prompts of 2K
                                                # tokens, keep 1 / .5 / .25 / .125 (a few minutes on 2 cores)
    python bench/int8_pages.py --quick          # one prompt of 512 tokens, keep 1 and .25, no quanto: a smoke run
    python bench/int8_pages.py --model tiny --quick   # a tiny random Llama (what the smoke test runs)
    python bench/int8_pages.py --device cuda --dtype bfloat16 --no-quanto   # on a GPU, bf16 pages against int8

Every prompt runs these caches in one process, interleaved (each prompt runs every method in turn):

- ``full``: the unpatched model with transformers' ``DynamicCache`` (the answers and bytes every
  other method is compared with).
- ``store@keep`` and ``int8@keep``: the model patched with ``--policy`` (default Ada-SnapKV)
  keeping that fraction of each prompt (one-shot, after the prefill), its pages in the model's
  dtype or int8 (``patch(..., kv_dtype="int8")``).
- ``int4sim@keep`` (with ``--int4-sim``): a simulation of 4-bit pages, which no kernel stores: the
  reference path (``handle.new_cache(reference=True)``, the masked dense cache that the int8
  pages' tests compare with) holding K and V as 4-bit pages would give them back (symmetric,
  levels -7..7, one float16 scale per group of ``--int4-group`` channels of a token's row:
  ``bench/kv_formats.py``'s ``four_bit_round_trip``). Its
  answers and tokens are compared with ``store@keep``'s like int8's; its speed and bytes are not
  measured (docs/store.md computes the bytes).
- ``quanto4`` and ``quanto2``: transformers' ``QuantizedCache`` with optimum-quanto's 4- and
  2-bit backend and its default residual length (the newest tokens unquantized), holding every
  token: the way a user quantizes a whole cache today. Run when ``optimum.quanto`` imports.

Every method runs once untimed first (quanto compiles its kernels at first use). Each run
prefills the prompt, then decodes ``--steps`` greedy tokens (end of text not honoured,
so that every run decodes the same count; the answer is read up to the first end of text).
Reported per method, over the prompts: passkey answers right; KV bytes at the end (our caches'
``nbytes``: K, V, scales, positions, score channels, page tables; ``DynamicCache``'s K+V;
``QuantizedCache``'s every tensor, packed data, scales, offsets and the residual window), as a
fraction of ``full``'s; decode tokens/s (median over prompts), and
- of ``int8@keep``: the greedy tokens equal to ``store@keep``'s (positions alike over all
  tokens decoded, and whether each prompt's answer is the same), and its decode tokens/s over
  ``store@keep``'s;
- of every method: decode tokens/s over ``quanto4``'s.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, write_out  # noqa: E402
from kv_formats import four_bit_round_trip  # noqa: E402

import kvcache_ext  # noqa: E402
from kvcache_ext.cache_argument import with_cache  # noqa: E402
from kvcache_ext.evaluation.decoding import cache_bytes  # noqa: E402
from kvcache_ext.evaluation.named_policies import make_policy  # noqa: E402
from kvcache_ext.tasks.passkey import check_answer, make_passkey_prompt  # noqa: E402


def quantized_cache_bytes(cache) -> int:
    """Every tensor a QuantizedCache's layers hold, a quantized tensor by its inner tensors
    (packed data, scales, offsets), each storage counted once."""
    seen, total = set(), 0

    def walk(value, depth=0):
        nonlocal total
        if depth > 6:
            return
        if isinstance(value, torch.Tensor):
            if hasattr(value, "__tensor_flatten__") and type(value) is not torch.Tensor:
                names, _ = value.__tensor_flatten__()
                for name in names:
                    walk(getattr(value, name), depth + 1)
                return
            key = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
            if value.numel() and key not in seen:
                seen.add(key)
                total += value.untyped_storage().nbytes()
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, depth + 1)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for v in vars(value).values():
                walk(v, depth + 1)

    for layer in cache.layers:
        walk(layer)
    return total


@torch.no_grad()
def decode(model, cache, ids: torch.Tensor, steps: int):
    """Prefill ``ids`` [1, n] over ``cache``, then ``steps`` greedy tokens. Returns (tokens,
    decode seconds)."""
    out = model(ids, **with_cache(model, cache), use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [int(token)]
    start = time.perf_counter()
    for _ in range(steps - 1):
        out = model(token, **with_cache(model, cache), use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
    return tokens, time.perf_counter() - start


def answer_text(tokenizer, tokens, eos):
    if eos is not None and eos in tokens:
        tokens = tokens[:tokens.index(eos)]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def quanto_available() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except Exception:
        return False
    return True


def equal_share(runs: list[dict], base: list[dict]) -> float:
    """Greedy tokens equal to base's, position by position, over every prompt's tokens."""
    same = sum(a == b for r, s in zip(runs, base) for a, b in zip(r["tokens"], s["tokens"]))
    return same / sum(len(r["tokens"]) for r in runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model path or id, 'tiny' (random weights), default SmolLM2")
    p.add_argument("--policy", default="ada-snapkv")
    p.add_argument("--keep", default="1,0.5,0.25,0.125")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=6, help="passkey prompts (depths 0.1, 0.5, 0.9 in turn)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--no-quanto", action="store_true", help="leave QuantizedCache out")
    p.add_argument("--int4-sim", action="store_true", help="add int4sim@keep: 4-bit pages simulated on the "
                   "reference path")
    p.add_argument("--int4-group", type=int, default=32,
                   help="channels per 4-bit scale, a divisor of head_dim (default 32)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="the model's dtype, which the unquantized pages hold (default float32)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None,
                   help="the JSON (default bench/results/int8-pages-<cpu or the GPU's name>-<commit>.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.keep, args.length, args.prompts, args.steps, args.no_quanto = "1,0.25", 512, 1, 8, True
    keeps = [float(x) for x in args.keep.split(",")]
    torch.set_grad_enabled(False)
    if args.model == "tiny":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from tiny_models import tiny_model
        model, tokenizer = tiny_model("llama", heads=4, kv_heads=2, layers=2), None
        model = model.to(args.device, getattr(torch, args.dtype))
    else:
        from kvcache_ext.hf.models import load_model
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    eos = getattr(tokenizer, "eos_token_id", None)

    prompts = []
    for i in range(args.prompts):
        depth = (0.1, 0.5, 0.9)[i % 3]
        if tokenizer is None:
            ids = torch.randint(3, 100, (args.length,), generator=torch.Generator().manual_seed(i))
            prompts.append((ids, None))
        else:
            prompt = make_passkey_prompt(tokenizer, args.length, depth, seed=i)
            prompts.append((prompt.input_ids, prompt.answer))

    kinds = ("store", "int8", "int4sim") if args.int4_sim else ("store", "int8")
    methods = ["full"] + [f"{kind}@{keep:g}" for keep in keeps for kind in kinds]
    if not args.no_quanto and quanto_available():
        methods += ["quanto4", "quanto2"]

    def run(method, ids):
        from transformers import DynamicCache, QuantizedCache
        if method == "full":
            cache = DynamicCache(config=model.config)
            tokens, seconds = decode(model, cache, ids, args.steps)
            return tokens, seconds, cache_bytes(cache)
        if method.startswith("quanto"):
            cache = QuantizedCache("quanto", model.config, nbits=int(method[len("quanto"):]))
            tokens, seconds = decode(model, cache, ids, args.steps)
            return tokens, seconds, quantized_cache_bytes(cache)
        kind, keep = method.split("@")
        policy = make_policy(args.policy, max(2, round(float(keep) * ids.shape[1])))
        policy = dataclasses.replace(policy, budget=None, ratio=float(keep))
        if kind == "int4sim":   # the reference path's int8 twin, its round trip swapped for 4 bits
            from unittest import mock

            from kvcache_ext.reference import masked_cache
            with kvcache_ext.patch(model, policy, tokenizer=tokenizer, kv_dtype="int8") as handle, \
                    mock.patch.object(masked_cache, "as_attended", lambda x: four_bit_round_trip(x, args.int4_group)):
                cache = handle.new_cache(reference=True, max_cache_len=ids.shape[1] + args.steps)
                tokens, seconds = decode(model, cache, ids, args.steps)
                return tokens, None, None
        with kvcache_ext.patch(model, policy, tokenizer=tokenizer,
                               kv_dtype="int8" if kind == "int8" else None) as handle:
            cache = handle.new_cache(max_cache_len=ids.shape[1] + args.steps)
            tokens, seconds = decode(model, cache, ids, args.steps)
            return tokens, seconds, cache.nbytes

    # One untimed run of every method first: quanto compiles its kernels at first use.
    for method in methods:
        run(method, prompts[0][0][None, :512].to(args.device))
    results = {m: [] for m in methods}
    for i, (ids, answer) in enumerate(prompts):
        for j in range(len(methods)):   # each prompt starts one method later
            method = methods[(i + j) % len(methods)]
            tokens, seconds, held = run(method, ids[None].to(args.device))
            correct = None if answer is None else check_answer(answer_text(tokenizer, tokens, eos), answer)
            results[method].append({"prompt": i, "tokens": tokens, "decode_s": seconds, "kv_bytes": held,
                                    "correct": correct,
                                    "tokens_per_s": None if seconds is None else (args.steps - 1) / seconds})
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)

    full_bytes = statistics.mean(r["kv_bytes"] for r in results["full"])
    quanto_tps = (statistics.median(r["tokens_per_s"] for r in results["quanto4"]) if "quanto4" in results
                  else None)
    rows = []
    for method in methods:
        rs = results[method]
        measured = rs[0]["kv_bytes"] is not None   # not for a simulation
        tps = statistics.median(r["tokens_per_s"] for r in rs) if measured else None
        row = {"method": method, "prompts": len(rs),
               "correct": None if rs[0]["correct"] is None else sum(r["correct"] for r in rs),
               "kv_bytes": statistics.mean(r["kv_bytes"] for r in rs) if measured else None,
               "kv_fraction": statistics.mean(r["kv_bytes"] for r in rs) / full_bytes if measured else None,
               "tokens_per_s": tps, "x_quanto4": tps / quanto_tps if quanto_tps and measured else None}
        if not measured:
            base = results["store@" + method.split("@")[1]]
            row["tokens_equal"] = equal_share(rs, base)
            row["same_answers"] = all(r["correct"] == s["correct"] for r, s in zip(rs, base))
        elif method.startswith("int8@"):
            base = results["store@" + method.split("@")[1]]
            row["tokens_equal"] = equal_share(rs, base)
            row["same_answers"] = all(r["correct"] == s["correct"] for r, s in zip(rs, base))
            row["x_store"] = tps / statistics.median(r["tokens_per_s"] for r in base)
            row["bytes_x_store"] = row["kv_bytes"] / statistics.mean(r["kv_bytes"] for r in base)
        rows.append(row)

    head = f"{'method':<12} {'right':>6} {'KV MB':>8} {'of full':>8} {'tok/s':>7} {'x quanto4':>9} " \
           f"{'tokens = store':>14} {'x store':>8} {'bytes x store':>13}"
    print(head)
    for r in rows:
        def f(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "-"
        right = f"{r['correct']}/{r['prompts']}" if r["correct"] is not None else "-"
        mb = f"{r['kv_bytes'] / 1e6:.2f}" if r["kv_bytes"] is not None else "-"
        print(f"{r['method']:<12} {right:>6} {mb:>8} {f('kv_fraction', '.3f'):>8} "
              f"{f('tokens_per_s', '.1f'):>7} {f('x_quanto4', '.2f'):>9} {f('tokens_equal', '.3f'):>14} "
              f"{f('x_store', '.3f'):>8} {f('bytes_x_store', '.3f'):>13}")
    if not args.quick or args.out:
        from common import device_name, git_commit
        where = "cpu" if args.device == "cpu" else device_name(args.device).replace(" ", "-")
        out = args.out or os.path.join(RESULTS, f"int8-pages-{where}-{git_commit()}.json")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        write_out(out, args, rows=rows, runs=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
