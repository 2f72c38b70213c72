"""KVzip's prefill cost: ours (the reconstruction passes included) over a dense prefill, in rounds.

Issue 19 asks for ours at most 2.5x a plain dense prefill of the same prompt. ``bench/agnostic.py``
times each once, beside other work, and one run of the same prompt moved by up to a third on
the shared 2-core machine. Here each prompt's dense prefill (the unpatched model on HF's
``DynamicCache``, logits for every token, as kvpress's pipeline runs it) and ours
(``kvzip-global`` at ``--keep``, the patched model's own prefill of the same ids: its passes
and its compression included) are timed in ``--rounds`` interleaved rounds, the order swapped
every round, and the medians' ratio is printed beside every run's seconds. Ours is also split
into its reconstruction passes (``reconstruction.reconstruct``) and, inside them, the scores'
products (``reconstruction.score_pass``), so that the table says where the extra time goes.
``--chunks`` times ours at each of several chunk sizes (``KVzip(chunk=...)``) in the same rounds.

    PYTHONPATH=$PWD python bench/kvzip_prefill.py [--lengths 1024,2048,4096] [--rounds 3] [--keep 0.05]
        [--chunks 1024,2048] [--out bench/results/kvzip-prefill-cpu-DATE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (first: the checkout's kvcache_ext ahead of an installed copy)
import kvcache_ext  # noqa: E402
import kvcache_ext.engine.reconstruction as reconstruction  # noqa: E402
from kvcache_ext.hf.cache_argument import with_cache  # noqa: E402
from kvcache_ext.cli.args import int_list, int_range  # noqa: E402
from kvcache_ext.evaluation.named_policies import make_policy  # noqa: E402
from kvcache_ext.evaluation.retrieval import budget_tokens  # noqa: E402
from kvcache_ext.hf.models import load_model  # noqa: E402
from kvcache_ext.policies import KVzip  # noqa: E402
from kvcache_ext.tasks import make_passkey_prompt  # noqa: E402


class PartTimer:
    """Wall time spent inside ``module.name`` while installed (the function is put back after)."""

    def __init__(self, module, name: str):
        self.module, self.name, self.seconds = module, name, 0.0
        self.original = getattr(module, name)

    def __enter__(self):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        setattr(self.module, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)


def dense_prefill(model, ids) -> float:
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    model(ids, **with_cache(model, cache), use_cache=True)
    return time.perf_counter() - start


def ours_prefill(model, tokenizer, ids, keep: float, chunk: int = KVzip.chunk) -> dict:
    policy = common.at_chunk(make_policy("kvzip-global", budget_tokens(keep, ids.shape[1])), chunk)
    # the patched forward calls reconstruction.reconstruct by its module's name: timed there.
    with kvcache_ext.patch(model, policy, tokenizer=tokenizer) as handle, \
            PartTimer(reconstruction, "reconstruct") as passes, PartTimer(reconstruction, "score_pass") as scores:
        cache = handle.new_cache()
        start = time.perf_counter()
        model(ids, **with_cache(model, cache), use_cache=True)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "passes": passes.seconds, "scores": scores.seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int_list, default="1024,2048,4096", help="prompt lengths in tokens")
    parser.add_argument("--rounds", type=int_range(1), default=3)
    parser.add_argument("--keep", type=float, default=0.05, help="the fraction ours keeps")
    parser.add_argument("--seed", type=int, default=0, help="the passkey prompt's seed (depth 0.5)")
    parser.add_argument("--chunks", type=int_list, default=str(KVzip.chunk),
                        help="ours' KVzip chunk sizes, each timed")
    parser.add_argument("--out", default=None, help="also write the runs to this JSON file")
    args = parser.parse_args(argv)
    if not 0 < args.keep <= 1:
        parser.error(f"--keep: a fraction in (0, 1], got {args.keep}")
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, commit {common.git_commit()}, "
          f"{args.rounds} rounds, ours = kvzip-global at keep {args.keep}")
    print("| context tokens | chunk | dense prefill s (median) | ours s (median) | ours / dense | passes s | "
          "scores s | dense runs | ours runs |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for length in args.lengths:
        prompt = make_passkey_prompt(tokenizer, length, 0.5, seed=args.seed)
        ids = prompt.input_ids[None, :prompt.haystack_end]
        dense, ours = [], {chunk: [] for chunk in args.chunks}
        for r in range(args.rounds):
            order = ["dense", *args.chunks]
            for which in order if r % 2 == 0 else order[::-1]:
                if which == "dense":
                    dense.append(dense_prefill(model, ids))
                else:
                    ours[which].append(ours_prefill(model, tokenizer, ids, args.keep, which))
        d = statistics.median(dense)
        for chunk, runs in ours.items():
            o = statistics.median(run["seconds"] for run in runs)
            mid = sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]
            rows.append({"context_tokens": ids.shape[1], "chunk": chunk, "dense_s": dense, "ours": runs,
                         "ratio": o / d})
            print(f"| {ids.shape[1]} | {chunk} | {d:.2f} | {o:.2f} | {o / d:.2f}x | {mid['passes']:.2f} | "
                  f"{mid['scores']:.2f} | " + ", ".join(f"{s:.2f}" for s in dense) + " | "
                  + ", ".join(f"{run['seconds']:.2f}" for run in runs) + " |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": common.git_commit(), "torch": torch.__version__, "keep": args.keep,
                       "rounds": args.rounds, "seed": args.seed, "chunks": args.chunks, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
