"""How close each page format gives back a model's real K and V: int8 (what ``kv_dtype="int8"``
stores), fp8 e4m3 and 4-bit, each with float16 scales, side by side on the same rows.

    python bench/kv_formats.py                 # the default model (fp32), one 2K-token passkey prompt
    python bench/kv_formats.py --model tiny    # a tiny random Llama (what the smoke test runs)

The prompt is prefilled once into transformers' ``DynamicCache``; every layer's K and V rows
(one per token and KV head, K after the rotary embedding, as a cache holds them) are rounded
through each format and compared with themselves:

- ``int8``: ``kvcache_ext.reference.round_trip``, the int8 pages' format (one scale per row);
- ``fp8-e4m3``: one float16 scale per row, ``max |x| / 448``, the row over its scale cast to
  torch's ``float8_e4m3fn`` and back (no kernel stores it);
- ``int4-gN``: ``four_bit_round_trip``, 4-bit steps with one float16 scale per group of N
  channels (no kernel stores it; ``bench/int8_pages.py --int4-sim`` runs a model over it).

Reported per format, for K and for V: the relative error ``||x' - x|| / ||x||`` over all rows
(every layer), its worst layer, and the bytes a token's K or V row takes in that format
(data and scales) against the model's dtype.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, git_commit, write_out  # noqa: E402

from kvcache_ext import reference  # noqa: E402
from kvcache_ext.cache_argument import with_cache  # noqa: E402

FP8_MAX = 448.0   # the largest finite float8_e4m3fn


def four_bit_round_trip(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., D] as 4-bit pages would give it back, in float32: per group of ``group`` channels
    of a row, scale = float16(max |x| / 7), steps round(x / scale) clamped to [-7, 7] (0 where the
    scale is 0), then steps x scale. A row narrower than a group is one group."""
    shape = x.shape
    group = min(group, shape[-1])
    xf = x.float().reshape(*shape[:-1], -1, group)
    scale = (xf.abs().amax(-1, keepdim=True) / 7).clamp(max=65504).to(torch.float16).float()
    steps = torch.where(scale > 0, torch.round(xf / torch.where(scale > 0, scale, 1)).clamp(-7, 7), 0)
    return (steps * scale).reshape(shape)


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] through e4m3 with one float16 scale per row, in float32."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(max=65504).to(torch.float16).float()
    safe = torch.where(scale > 0, scale, 1)
    return torch.where(scale > 0, (xf / safe).to(torch.float8_e4m3fn).float() * scale, 0)


def formats(group: int) -> dict:
    """name: (round trip, bytes of a row of D elements)."""
    return {"int8": (lambda x: reference.round_trip(x.float()), lambda D: D + 2),
            "fp8-e4m3": (fp8_round_trip, lambda D: D + 2),
            f"int4-g{group}": (lambda x: four_bit_round_trip(x, group), lambda D: D // 2 + 2 * max(1, D // group))}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model path or id, 'tiny' (random weights), default SmolLM2")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--group", type=int, default=32, help="channels per 4-bit scale (default 32)")
    p.add_argument("--out", default=None, help="the JSON (default bench/results/kv-formats-cpu-<commit>.json)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.model == "tiny":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from tiny_models import tiny_model
        model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
        ids = torch.randint(3, 100, (1, args.length), generator=torch.Generator().manual_seed(0))
    else:
        from kvcache_ext.hf.models import load_model
        from kvcache_ext.tasks.passkey import make_passkey_prompt
        model, tokenizer = load_model(args.model)
        ids = make_passkey_prompt(tokenizer, args.length, 0.5, seed=0).input_ids[None]
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    model(ids, **with_cache(model, cache), use_cache=True)
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    D = layers[0][0].shape[-1]
    dtype_bytes = layers[0][0].element_size()

    rows = []
    for name, (round_trip, row_bytes) in formats(args.group).items():
        row = {"format": name, "row_bytes": row_bytes(D), "of_model_dtype": row_bytes(D) / (D * dtype_bytes)}
        for part, index in (("k", 0), ("v", 1)):
            per_layer = [relative_error(round_trip(kv[index]), kv[index]) for kv in layers]
            every = torch.cat([kv[index].flatten(0, -2) for kv in layers])
            row[f"{part}_error"] = relative_error(round_trip(every), every)
            row[f"{part}_worst_layer"] = max(per_layer)
        rows.append(row)

    print(f"{len(layers)} layers, head_dim {D}, {ids.shape[1]} tokens")
    print(f"{'format':<10} {'row bytes':>9} {'of dtype':>8} {'K error':>8} {'K worst':>8} {'V error':>8} {'V worst':>8}")
    for r in rows:
        print(f"{r['format']:<10} {r['row_bytes']:>9} {r['of_model_dtype']:>8.3f} {r['k_error']:>8.4f} "
              f"{r['k_worst_layer']:>8.4f} {r['v_error']:>8.4f} {r['v_worst_layer']:>8.4f}")
    if args.model != "tiny" or args.out:
        out = args.out or os.path.join(RESULTS, f"kv-formats-cpu-{git_commit()}.json")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        write_out(out, args, rows=rows, layers=len(layers), head_dim=D, tokens=int(ids.shape[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
