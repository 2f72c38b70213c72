"""KVzip and the chat template's prefix: three readings measured side by side.

A chat prompt opens with the template's prefix (SmolLM2: its system prompt and the user turn's
header, 24 tokens) before the user's text. The sources treat it differently:

- ``rebuild`` (``KVzip(skip_prefix=None)``, the library's default before 2026-11-26): the passes
  rebuild the whole context, prefix included, and the prefix is scored like every other token;
- ``drop`` (kvpress 0.5.5's ``KVzipPress``, and the library's default ``skip_prefix="chat"``): the
  passes rebuild the text after the prefix only; the prefix's tokens score 0, so all but the
  sinks go first;
- ``hold`` (the KVzip authors' code, its ``evict_range``): the passes rebuild the text after the
  prefix only; the prefix is always held (here inside the same budget, so that every reading
  holds the same bytes).

Each reading answers the agnostic passkey and needle prompts of ``bench/agnostic.py`` (same
seeds for the same lengths and depths) with KVzip's own selection at every ``--keep``:

    PYTHONPATH=$PWD python bench/kvzip_prefix.py [--lengths 1024,2048,4096] [--depths 0.5]
        [--keep 0.25,0.1,0.05] [--readings rebuild,drop,hold] [--out bench/results/kvzip-prefix-cpu-DATE.json]

All three run ``kvzip-global-rebuild``; ``drop`` and ``hold`` are measured by wrapping
``KVzip.passes`` (the passes start after the prefix) and ``reconstruction.finish`` (the prefix's
scores set before the budgets are kept), for the length of the run: batch 1 only, which is what
these prompts are. (``tests/test_bench_kvzip_vs_kvpress.py`` checks that ``drop`` scores and
keeps exactly as the library's ``skip_prefix="chat"``.)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (first: the checkout's kvcache_ext ahead of an installed copy)
import kvcache_ext.engine.reconstruction as reconstruction  # noqa: E402
from kvcache_ext.cli.args import choice_list, depth_list, fraction_list, int_list  # noqa: E402
from kvcache_ext.evaluation.retrieval import run_prompt  # noqa: E402
from kvcache_ext.hf.models import load_model  # noqa: E402
from kvcache_ext.engine.reconstruction import chat_template_tokens  # noqa: E402
from kvcache_ext.policies import KVzip  # noqa: E402
from kvcache_ext.tasks import make_needle_prompt, make_passkey_prompt  # noqa: E402

READINGS = ("rebuild", "drop", "hold")
MAKERS = {"passkey": make_passkey_prompt, "needle": make_needle_prompt}


def chat_prefix(tokenizer) -> list[int]:
    """The tokens the chat template puts before a user's text (what ``skip_prefix="chat"`` skips)."""
    return chat_template_tokens(tokenizer, "prefix")


@contextlib.contextmanager
def reading(name: str, prefix: list[int]):
    """Within the block, KVzip follows reading ``name`` (a no-op for ``rebuild``)."""
    if name == "rebuild":
        yield
        return
    plain_passes, plain_finish = KVzip.passes, reconstruction.finish
    skipped = {"tokens": 0}

    def passes(self, ids, valid, tokens, start=0):   # start: 0 (skip_prefix=None)
        p = len(prefix)
        if ids.shape[0] != 1 or ids.shape[1] <= p or ids[0, :p].tolist() != prefix:
            raise ValueError("this bench's readings need one chat prompt that opens with the template's prefix")
        skipped["tokens"] = p
        return [(inputs, real, lo + p, hi + p) for inputs, real, lo, hi in
                plain_passes(self, ids[:, p:], valid[:, p:], tokens)]

    def finish(cache, scores):
        for layer_scores in scores:   # the sinks among them stay protected by the policy
            layer_scores[..., :skipped["tokens"]] = 0.0 if name == "drop" else float("inf")
        return plain_finish(cache, scores)

    KVzip.passes, reconstruction.finish = passes, finish
    try:
        yield
    finally:
        KVzip.passes, reconstruction.finish = plain_passes, plain_finish


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int_list, default="1024,2048,4096")
    p.add_argument("--depths", type=depth_list, default="0.5")
    p.add_argument("--keep", type=fraction_list, default="0.25,0.1,0.05")
    p.add_argument("--readings", type=choice_list(READINGS), default=",".join(READINGS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lengths, depths, keeps, readings = args.lengths, args.depths, args.keep, args.readings
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    prefix = chat_prefix(tokenizer)
    records, seed = [], 0
    for task, make in MAKERS.items():   # the seeds of bench/agnostic.py
        for length, depth in ((length, depth) for length in lengths for depth in depths):
            prompt = make(tokenizer, length, depth, seed=seed)
            seed += 1
            for name in readings:
                with reading(name, prefix):
                    runs = run_prompt(model, tokenizer, prompt, task, "agnostic", ["kvzip-global-rebuild"], keeps)
                for r in runs:
                    records.append({"reading": name, "task": task, "length": prompt.length, "depth": depth,
                                    "seed": prompt.seed, "keep": r.budget, "correct": r.correct,
                                    "output": r.output, "kv_bytes": r.kv_bytes, "full_bytes": r.full_bytes})
                print(f"{task} {prompt.length} depth {depth:g} {name}: " +
                      " ".join("ok" if r.correct else "miss" for r in runs), flush=True)
    print(f"\nchat prefix: {len(prefix)} tokens\n\n| reading | " +
          " | ".join(f"keep {k:g}" for k in keeps) + " |\n| --- |" + " --- |" * len(keeps))
    for name in readings:
        cells = [sum(r["correct"] for r in records if r["reading"] == name and r["keep"] == k) for k in keeps]
        total = len([r for r in records if r["reading"] == name and r["keep"] == keeps[0]])
        print(f"| {name} | " + " | ".join(f"{c}/{total}" for c in cells) + " |")
    if args.out:
        common.write_out(args.out, args, {"prefix_tokens": len(prefix)}, records=records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
