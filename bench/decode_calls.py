"""Per-layer decode calls of SnapKV against Ada-SnapKV, timed one by one inside the model.

    python bench/decode_calls.py                       # SmolLM2, 8K x 4, 128 steps per policy
    python bench/decode_calls.py --context 2048 --steps 128
    python bench/decode_calls.py --reserve             # pages reserved first: no call adds any
    python bench/decode_calls.py --model tiny --context 512 --batch 2 --steps 8   # a smoke run

End to end, Ada-SnapKV and SnapKV decode the same number of tokens per layer, but Ada-SnapKV's
heads have unequal lengths, so they fill their last pages on different steps: many more of its
decode steps add pages. This script says what that costs. Both caches are prefilled with the
same random prompt (keep 12.5 %), then decode in turns of 4 steps (the order alternating), and
every layer's ``RaggedKVStore.append_and_attend`` is timed alone. Printed per policy: the
median call, split by whether the call added pages (and how many did), and the median step
inside and outside those calls. Only numbers from one run compare: this machine's speed drifts
between runs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (puts the checkout first on sys.path)
import torch

import kvcache_ext
from kvcache_ext.hf.cache_argument import with_cache
from kvcache_ext.policies import AdaKV, Policy, SnapKV
from kvcache_ext.kernels.store import RaggedKVStore
from e2e import build_model

TURN = 4   # decode steps per policy before the other takes its turn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=128, help="decode steps per policy (a multiple of 4)")
    parser.add_argument("--reserve", action="store_true",
                        help="tell the caches the run's length (max_cache_len): pages for every step at the prefill")
    args = parser.parse_args()
    if args.context < 512 or args.batch < 1 or args.steps < TURN or args.steps % TURN:
        parser.error("--context must be >= 512 (12.5 % of it beyond SnapKV's 32-token window), "
                     "--batch >= 1 and --steps a positive multiple of 4")

    model = build_model(args.model, "cpu", torch.float32)
    model = model[0] if isinstance(model, tuple) else model
    vocab = model.config.vocab_size
    ids = torch.randint(min(100, vocab - 1), vocab, (args.batch, args.context),
                        generator=torch.Generator().manual_seed(0))
    budget = args.context // 8
    policies = {"snapkv": Policy(SnapKV(), budget=budget),
                "ada-snapkv": Policy(SnapKV(), budget=budget, allocation=AdaKV())}
    calls = []   # (seconds, added pages) of the step being decoded
    plain = RaggedKVStore.append_and_attend

    def timed(store, *args_):
        before = store.slab_allocations
        start = time.perf_counter()
        out = plain(store, *args_)
        calls.append((time.perf_counter() - start, store.slab_allocations > before))
        return out

    with torch.no_grad():
        caches = {}
        for name, policy in policies.items():
            handle = kvcache_ext.patch(model, policy)
            # --reserve: the cache is told the run's length, as the patched generate tells it,
            # so the prefill leaves every head pages for all the steps.
            cache = handle.new_cache(max_cache_len=args.context + args.steps if args.reserve else None)
            model(ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
            handle.unpatch()
            caches[name] = (policy, cache)
        token = torch.full((args.batch, 1), min(1234, vocab - 1))
        steps = {name: [] for name in caches}     # per step: (seconds, its calls)
        RaggedKVStore.append_and_attend = timed
        try:
            for turn in range(args.steps // TURN):
                order = list(caches) if turn % 2 == 0 else list(caches)[::-1]
                for name in order:
                    policy, cache = caches[name]
                    kvcache_ext.patch(model, policy)
                    for _ in range(TURN):
                        calls.clear()
                        position = torch.full_like(token, args.context + len(steps[name]))
                        start = time.perf_counter()
                        model(token, **with_cache(model, cache), use_cache=True, position_ids=position)
                        steps[name].append((time.perf_counter() - start, list(calls)))
                    kvcache_ext.unpatch(model)
        finally:
            RaggedKVStore.append_and_attend = plain

    print(f"{args.model} fp32, context {args.context} x batch {args.batch}, keep 12.5 %, "
          f"{args.steps} steps per policy in turns of {TURN}{', pages reserved' if args.reserve else ''}, "
          f"{torch.get_num_threads()} threads")
    print("| policy | call µs (median) | calls adding pages | their µs | other calls' µs | step ms "
          "| outside the calls ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, record in steps.items():
        every = [(t * 1e6, added) for _, step_calls in record for t, added in step_calls]
        adding = [t for t, added in every if added]
        other = [t for t, added in every if not added]
        median = lambda xs: f"{statistics.median(xs):.1f}" if xs else "—"
        outside = [(total - sum(t for t, _ in step_calls)) * 1e3 for total, step_calls in record]
        print(f"| {name} | {median([t for t, _ in every])} | {len(adding)} of {len(every)} | {median(adding)} "
              f"| {median(other)} | {statistics.median(t * 1e3 for t, _ in record):.2f} "
              f"| {statistics.median(outside):.2f} |")


if __name__ == "__main__":
    main()
