"""kvpress's presses at every ratio from one prefill, checked against kvpress's own pipeline.

    PYTHONPATH=$PWD python bench/kvpress_scored_once.py [--presses kvpress-snapkv,...]
        [--tasks niah_single_2,...] [--length 2048] [--seeds 1] [--keep 0.75,0.5,0.25,0.125]
        [--modes aware,agnostic] [--max-new-tokens 48] [--out results.json]

Needs kvpress (the venv of ``pip install ".[bench]"``: kvpress 0.5.5, transformers 5.2).

``kvcache-ext eval`` runs each kvpress press once per prompt for all its ratios
(``evaluation.kvpress_runs.run_press_budgets``): one prefill that keeps the press's scores (and,
for KVzip, one set of reconstruction passes), then, per ratio, the press's own selection on a
copy of the whole cache, the question and the decode. This script runs both that and kvpress's
pipeline, press around the prefill, once per ratio (``run_press``), on the same RULER-style
prompts, one after the other in one process, and records per (press, mode, prompt) whether the
answer tokens and the KV bytes are the same at every ratio, and the wall time of each way
(prefills, passes, questions and decodes). Results: JSON (``--out``) with every record and the
summary; the script exits 1 when any answer or byte count differs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (first: it puts a built checkout ahead of an installed copy)
from kvcache_ext.cli.args import choice_list, fraction_list, int_range  # noqa: E402
from kvcache_ext.evaluation.kvpress_runs import (  # noqa: E402
    SCORED_ONCE, kvpress_missing, run_press, run_press_budgets)
from kvcache_ext.evaluation.retrieval import MODES, split_prompt  # noqa: E402
from kvcache_ext.hf.models import load_model  # noqa: E402
from kvcache_ext.tasks.ruler import TASKS, make_ruler_prompt  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presses", type=choice_list(SCORED_ONCE),
                   default="kvpress-snapkv,kvpress-ada-snapkv,kvpress-expected-attention,kvpress-kvzip")
    p.add_argument("--tasks", type=choice_list(TASKS), default="niah_single_2,niah_multikey_1,niah_multivalue")
    p.add_argument("--length", type=int_range(64), default=2048, help="tokens per prompt")
    p.add_argument("--seeds", type=int_range(1), default=1, help="prompts per task")
    p.add_argument("--keep", type=fraction_list, default="0.75,0.5,0.25,0.125", help="fractions kept")
    p.add_argument("--modes", type=choice_list(MODES), default="aware,agnostic")
    p.add_argument("--max-new-tokens", type=int_range(1), default=48)
    p.add_argument("--out", default=None, help="JSON of every record and the summary")
    args = p.parse_args(argv)
    if why := kvpress_missing():
        p.error(why)
    if args.out:
        open(args.out, "a").close()   # an unwritable path fails now, not after the runs
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    records = []
    for task in args.tasks:
        for seed in range(args.seeds):
            prompt = make_ruler_prompt(tokenizer, task, args.length, seed=seed)
            for mode in args.modes:
                context, question = split_prompt(prompt, mode)
                for name in args.presses:
                    start = time.perf_counter()
                    once = run_press_budgets(model, tokenizer, name, args.keep, context, question,
                                             args.max_new_tokens)
                    once_s = time.perf_counter() - start
                    start = time.perf_counter()
                    each = [run_press(model, tokenizer, name, keep, context, question, args.max_new_tokens)
                            for keep in args.keep]
                    each_s = time.perf_counter() - start
                    record = dict(press=name, mode=mode, task=task, seed=seed, length=prompt.length,
                                  keep=args.keep,
                                  same_tokens=[a[0] == b[0] for a, b in zip(once, each)],
                                  same_bytes=[a[2] == b[2] for a, b in zip(once, each)],
                                  bytes=[a[2] for a in once], scored_once_s=once_s, pipeline_s=each_s)
                    records.append(record)
                    print(f"{name:32s} {mode:8s} {task}:{seed}  same tokens {record['same_tokens']}  "
                          f"same bytes {record['same_bytes']}  {each_s / once_s:.2f}x faster", flush=True)
    same = all(all(r["same_tokens"]) and all(r["same_bytes"]) for r in records)
    speed = sum(r["pipeline_s"] for r in records) / sum(r["scored_once_s"] for r in records)
    summary = dict(runs=len(records) * len(args.keep), identical=same, pipeline_over_scored_once=speed)
    print(f"{'all' if same else 'NOT all'} {summary['runs']} runs identical; "
          f"scored once: {speed:.2f}x faster than the pipeline per ratio")
    if args.out:
        common.write_out(args.out, args, records=records, summary=summary)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
