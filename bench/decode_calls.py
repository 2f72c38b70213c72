"""Per-layer decode calls inside the model, timed one by one: SnapKV against Ada-SnapKV, and
the eager fast path against the ops.

    python bench/decode_calls.py                       # SmolLM2, 8K x 4, 128 steps per policy
    python bench/decode_calls.py --context 2048 --steps 128
    python bench/decode_calls.py --reserve             # pages reserved first: no call adds any
    python bench/decode_calls.py --paths fast,ops --out bench/results/decode-calls-cpu-<date>.json
    python bench/decode_calls.py --model tiny --context 512 --batch 2 --steps 8   # a smoke run

A decode step that only appends (one token, no padding, a policy that never evicts while
decoding) calls every layer's ``RaggedLayerKV.append_and_attend``; that call is timed alone.
``--paths`` says how the call runs: ``fast``, the eager fast path (one pybind call,
``kvcache_ext._C.append_and_attend``), and/or ``ops``, the same work through the torch ops and
the page allocator's host steps (``RaggedKVStore.append``: ``prepare_append`` + ``store_append``;
``ragged_attention``: ``attention_plan`` + ``attention_run``), as the engine runs it under
``torch.compile``. Both paths give the same outputs.

Ada-SnapKV's heads have unequal lengths, so they fill their last pages on different steps: many
more of its decode steps add pages. Every (policy, path) decodes its own cache, all prefilled
with the same random prompt (keep 12.5 %), in turns of 4 steps, the order of the turns reversed
every other round, so that a slow stretch of the machine weighs on every variant. Printed per
variant: the median call, split by whether the call added pages (and how many did), and the
median step inside and outside those calls; with both paths, the ratio ops / fast per policy.
Only numbers from one run compare: this machine's speed drifts between runs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (puts the checkout first on sys.path)
import torch

import kvcache_ext
from kvcache_ext.engine.ragged_storage import RaggedLayerKV
from kvcache_ext.hf.cache_argument import with_cache
from kvcache_ext.policies import AdaKV, Policy, SnapKV
from e2e import build_model

TURN = 4   # decode steps per variant before the next takes its turn
PATHS = ("fast", "ops")


def through_ops(kv: RaggedLayerKV, k, v, pos, q, scale):
    """The ``ops`` path: what ``RaggedLayerKV.append_and_attend`` runs under torch.compile."""
    kv.append(k, v, pos, None)
    return kv.attend(q, scale, None, ())[0]


def median(xs) -> float | None:
    return statistics.median(xs) if xs else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=128, help="decode steps per variant (a multiple of 4)")
    parser.add_argument("--reserve", action="store_true",
                        help="tell the caches the run's length (max_cache_len): pages for every step at the prefill")
    parser.add_argument("--paths", default="fast",
                        help="comma-separated: fast (the eager fast path), ops (the torch ops); default fast")
    parser.add_argument("--out", help="write the steps' and calls' times to this JSON file")
    args = parser.parse_args()
    if args.context < 512 or args.batch < 1 or args.steps < TURN or args.steps % TURN:
        parser.error("--context must be >= 512 (12.5 % of it beyond SnapKV's 32-token window), "
                     "--batch >= 1 and --steps a positive multiple of 4")
    paths = [p for p in args.paths.split(",") if p]
    if not paths or any(p not in PATHS for p in paths) or len(set(paths)) != len(paths):
        parser.error(f"--paths must name some of {', '.join(PATHS)}, each once; got {args.paths!r}")

    model = build_model(args.model, "cpu", torch.float32)
    model = model[0] if isinstance(model, tuple) else model
    vocab = model.config.vocab_size
    ids = torch.randint(min(100, vocab - 1), vocab, (args.batch, args.context),
                        generator=torch.Generator().manual_seed(0))
    budget = args.context // 8
    policies = {"snapkv": Policy(SnapKV(), budget=budget),
                "ada-snapkv": Policy(SnapKV(), budget=budget, allocation=AdaKV())}
    calls = []   # (seconds, added pages) of the step being decoded
    plain = RaggedLayerKV.append_and_attend
    run = {"fast": plain, "ops": through_ops}
    path_now = [paths[0]]

    def timed(kv, *args_):
        before = kv.store.slab_allocations
        start = time.perf_counter()
        out = run[path_now[0]](kv, *args_)
        calls.append((time.perf_counter() - start, kv.store.slab_allocations > before))
        return out

    variants = [(name, path) for name in policies for path in paths]
    with torch.no_grad():
        caches = {}
        for name, path in variants:
            policy = policies[name]
            handle = kvcache_ext.patch(model, policy)
            # --reserve: the cache is told the run's length, as the patched generate tells it,
            # so the prefill leaves every head pages for all the steps.
            cache = handle.new_cache(max_cache_len=args.context + args.steps if args.reserve else None)
            model(ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
            handle.unpatch()
            caches[name, path] = cache
        token = torch.full((args.batch, 1), min(1234, vocab - 1))
        steps = {variant: [] for variant in variants}     # per step: (seconds, its calls)
        RaggedLayerKV.append_and_attend = timed
        try:
            for turn in range(args.steps // TURN):
                for name, path in variants if turn % 2 == 0 else variants[::-1]:
                    cache, path_now[0] = caches[name, path], path
                    kvcache_ext.patch(model, policies[name])
                    for _ in range(TURN):
                        calls.clear()
                        position = torch.full_like(token, args.context + len(steps[name, path]))
                        start = time.perf_counter()
                        model(token, **with_cache(model, cache), use_cache=True, position_ids=position)
                        steps[name, path].append((time.perf_counter() - start, list(calls)))
                    kvcache_ext.unpatch(model)
        finally:
            RaggedLayerKV.append_and_attend = plain

    print(f"{args.model} fp32, context {args.context} x batch {args.batch}, keep 12.5 %, "
          f"{args.steps} steps per variant in turns of {TURN}{', pages reserved' if args.reserve else ''}, "
          f"{torch.get_num_threads()} threads")
    print("| policy | path | call µs (median) | calls adding pages | their µs | other calls' µs | step ms "
          "| outside the calls ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    shown = lambda x, scale=1.0: "—" if x is None else f"{x * scale:.{1 if scale == 1e6 else 2}f}"
    summary = {}
    for (name, path), record in steps.items():
        every = [(t, added) for _, step_calls in record for t, added in step_calls]
        adding = [t for t, added in every if added]
        row = {"policy": name, "path": path, "calls": len(every), "calls_adding_pages": len(adding),
               "call_s": median([t for t, _ in every]), "adding_call_s": median(adding),
               "other_call_s": median([t for t, added in every if not added]),
               "step_s": median([total for total, _ in record]),
               "outside_s": median([total - sum(t for t, _ in step_calls) for total, step_calls in record])}
        summary[name, path] = row
        print(f"| {name} | {path} | {shown(row['call_s'], 1e6)} | {len(adding)} of {len(every)} "
              f"| {shown(row['adding_call_s'], 1e6)} | {shown(row['other_call_s'], 1e6)} "
              f"| {shown(row['step_s'], 1e3)} | {shown(row['outside_s'], 1e3)} |")
    if set(paths) == set(PATHS):
        for name in policies:
            fast, ops = summary[name, "fast"], summary[name, "ops"]
            print(f"{name}: ops / fast = {ops['call_s'] / fast['call_s']:.3f} per call "
                  f"({(ops['call_s'] - fast['call_s']) * 1e6:+.1f} µs), "
                  f"{ops['step_s'] / fast['step_s']:.3f} per step")
    if args.out:
        common.write_out(args.out, args, {"model_threads": torch.get_num_threads(), "turn": TURN},
                         rows=list(summary.values()),
                         steps=[{"policy": name, "path": path, "step_s": [t for t, _ in record],
                                 "calls_s": [sum(t for t, _ in step_calls) for _, step_calls in record],
                                 "call_median_s": [median([t for t, _ in step_calls]) for _, step_calls in record],
                                 "calls_adding_pages": [sum(a for _, a in step_calls) for _, step_calls in record]}
                                for (name, path), record in steps.items()])


if __name__ == "__main__":
    main()
