"""KVzip at small keep fractions: the chat prefix's two readings and ways of selecting by the scores.

Each prompt (agnostic passkey and needle, held-out seeds from ``--seed`` on) is prefilled once
and reconstructed once per reading of the chat template's prefix (``KVzip(skip_prefix=...)``:
``chat``, the default, kvpress's reading; ``rebuild``, ``skip_prefix=None``); each selection then
compresses the same recorded prefill by the same scores at every ``--keep``, and the question
comes over the compressed cache (as ``kvcache-ext eval --mode agnostic`` runs it):

- ``global``: KVzip's own selection, ``AdaKV(alpha=1.0, layers=AcrossLayers())`` (``kvzip-global``);
- ``pool3`` / ``pool5`` / ``pool7`` / ``avg5``: the same after pooling the scores along positions
  (``policies.Pooling``, max or mean, that kernel), as SnapKV pools its own;
- ``alpha0.5``: the layers' shares from the global top-k, Ada-KV's safeguard within each layer;
- ``recent16`` / ``sinks16``: the global top-k with the last 16 context tokens, or the first 16
  instead of 4, always held (inside the budget).

``--chunks`` reconstructs each prompt once more per chunk size (``KVzip(chunk=...)``, context
tokens per pass), so that the chunk's effect on the answers is measured on the same prompts.

With ``--kvpress`` (kvpress 0.5.5 importable: the venv of ``pip install ".[bench]"``), kvpress's
``KVzipPress`` runs on the same prompts at every ``--kvpress-keep`` (default: ``--keep``) too, as
it is (``kvpress``); with ``--kvpress-plus`` also with its ``kvzip_plus_normalization``
(``kvpress-plus``: each probability divided by the norm of the query token's hidden state and
multiplied by that of the key's value through the output projection). The table counts the
prompts where our ``chat``/``global`` at kvpress's chunk (2048) gives kvpress's very output.

    PYTHONPATH=$PWD python bench/kvzip_selection.py [--tasks passkey,needle] [--lengths 1024,2048,4096]
        [--depths 0.1,0.5,0.9] [--seed 100] [--keep 0.1,0.05] [--readings chat,rebuild]
        [--selections global,pool3,...] [--chunks 2048,1024] [--kvpress] [--kvpress-plus]
        [--kvpress-keep 0.25,0.1] [--out bench/results/kvzip-selection-cpu-DATE.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (first: the checkout's kvcache_ext ahead of an installed copy)
import kvcache_ext  # noqa: E402
from kvcache_ext.hf.cache_argument import with_cache  # noqa: E402
from kvcache_ext.cli.args import choice_list, depth_list, fraction_list, int_list  # noqa: E402
from kvcache_ext.evaluation.decoding import full_cache_from, greedy_continue  # noqa: E402
from kvcache_ext.evaluation.kvpress_runs import kvpress_missing  # noqa: E402
from kvcache_ext.evaluation.retrieval import budget_tokens, split_prompt  # noqa: E402
from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill  # noqa: E402
from kvcache_ext.hf.models import load_model  # noqa: E402
from kvcache_ext.policies import AcrossLayers, AdaKV, KVzip, Policy, Pooling, Protection  # noqa: E402
from kvcache_ext.engine.reconstruction import finish  # noqa: E402
from kvcache_ext.tasks import check_answer, make_needle_prompt, make_passkey_prompt  # noqa: E402
from agnostic import KVPRESS_CHUNK  # noqa: E402

MAKERS = {"passkey": make_passkey_prompt, "needle": make_needle_prompt}
READINGS = {"chat": "chat", "rebuild": None}   # name -> KVzip's skip_prefix
GLOBAL = dict(alpha=1.0, layers=AcrossLayers)
# name -> (pooling of the scores or None, AdaKV's arguments, protection or None for KVzip's sinks)
SELECTIONS = {
    "global": (None, GLOBAL, None),
    "pool3": (Pooling(3), GLOBAL, None),
    "pool5": (Pooling(5), GLOBAL, None),
    "pool7": (Pooling(7), GLOBAL, None),
    "avg5": (Pooling(5, "avg"), GLOBAL, None),
    "alpha0.5": (None, dict(alpha=0.5, layers=AcrossLayers), None),
    "recent16": (None, GLOBAL, Protection(sinks=4, recent=16)),
    "sinks16": (None, GLOBAL, Protection(sinks=16)),
}


def policy(skip_prefix, chunk: int, selection: str, budget: int) -> Policy:
    _, ada, protection = SELECTIONS[selection]
    allocation = AdaKV(alpha=ada["alpha"], layers=ada["layers"]())
    extra = {"protection": protection} if protection is not None else {}
    return Policy(KVzip(skip_prefix=skip_prefix, chunk=chunk), budget=budget, allocation=allocation, **extra)


def pooled(scores: list, pooling: Pooling | None, rebuilt: torch.Tensor) -> list:
    """Each layer's scores [B, H, n] pooled along positions over the tokens the passes rebuilt
    (``rebuilt`` [B, n]: a skipped prefix takes no part)."""
    if pooling is None:
        return [s.clone() for s in scores]
    return [pooling(s, rebuilt[:, None, :]) for s in scores]


def answer(model, tokenizer, cache, question, prompt) -> tuple[bool, str]:
    logits = model(question, **with_cache(model, cache), use_cache=True).logits[:, -1]
    new, _ = greedy_continue(model, cache, logits, 8, tokenizer.eos_token_id)
    text = tokenizer.decode(new, skip_special_tokens=True)
    return check_answer(text, prompt.answer), text


def kvpress_runs(model, tokenizer, prompt, keeps, plus_too: bool) -> list[dict]:
    from agnostic import kvpress_kvzip   # imports kvpress when called
    out = []
    for keep in keeps:
        for plus in (False, True) if plus_too else (False,):
            r = kvpress_kvzip(model, tokenizer, prompt, keep, plus)
            out.append({"reading": None, "chunk": None, "selection": "kvpress-plus" if plus else "kvpress",
                        "keep": keep, "correct": r["correct"], "output": r["output"], "kv_bytes": r["kv_bytes"]})
    return out


def run_prompt(model, tokenizer, prompt, readings, chunks, selections, keeps) -> list[dict]:
    context, question = split_prompt(prompt, "agnostic")
    recorded = record_prefill(model, context)
    ok, text = answer(model, tokenizer, full_cache_from(model, recorded), question, prompt)
    out = [{"reading": None, "chunk": None, "selection": "full", "keep": None, "correct": ok, "output": text}]
    n = context.shape[1]
    for reading, chunk in ((reading, chunk) for reading in readings for chunk in chunks):
        scores = None   # the passes run once per reading and chunk; every selection reuses them
        for selection in selections:
            for keep in keeps:
                pol = policy(READINGS[reading], chunk, selection, budget_tokens(keep, n))
                with kvcache_ext.patch(model, pol, tokenizer=tokenizer) as handle:
                    cache = compressed_cache(pol, recorded)
                    if scores is None:
                        start = time.perf_counter()
                        scores = [s.clone() for s in handle.score_prompt(compressed_cache(pol, recorded), context)]
                        passes_s = time.perf_counter() - start
                        rebuilt = pol.scorer.rebuilt(context, torch.ones_like(context, dtype=torch.bool),
                                                     handle.tokens)
                    finish(cache, pooled(scores, SELECTIONS[selection][0], rebuilt))
                    ok, text = answer(model, tokenizer, cache, question, prompt)
                    out.append({"reading": reading, "chunk": chunk, "selection": selection, "keep": keep,
                                "correct": ok, "output": text, "kv_bytes": cache.nbytes, "passes_s": passes_s})
    return out


def table(records, readings, chunks, selections, keeps) -> str:
    prompts = len([r for r in records if r["selection"] == "full"])
    full = sum(r["correct"] for r in records if r["selection"] == "full")
    keeps = sorted({r["keep"] for r in records if r["keep"] is not None} | set(keeps), reverse=True)
    lines = [f"{prompts} prompts; the full cache answers {full}", "",
             "| reading | chunk | selection | " + " | ".join(f"keep {k:g}" for k in keeps) + " |",
             "| --- | --- | --- |" + " --- |" * len(keeps)]

    def cell(match, keep) -> str:
        runs = [r for r in records if match(r) and r["keep"] == keep]
        return f"{sum(r['correct'] for r in runs)}/{prompts}" if runs else "—"

    for reading in readings:
        for chunk in chunks:
            for selection in selections:
                row = (reading, chunk, selection)
                cells = [cell(lambda r: (r["reading"], r["chunk"], r["selection"]) == row, k) for k in keeps]
                lines.append(f"| {reading} | {chunk} | {selection} | " + " | ".join(cells) + " |")
    for name in ("kvpress", "kvpress-plus"):
        if any(r["selection"] == name for r in records):
            cells = [cell(lambda r: r["selection"] == name, k) for k in keeps]
            lines.append(f"| kvpress 0.5.5 | {KVPRESS_CHUNK} | {name} | " + " | ".join(cells) + " |")
    ours = {(r["seed"], r["keep"]): r["output"] for r in records
            if (r["reading"], r["chunk"], r["selection"]) == ("chat", KVPRESS_CHUNK, "global")}
    theirs = {(r["seed"], r["keep"]): r["output"] for r in records if r["selection"] == "kvpress"}
    if ours and theirs:
        same = sum(ours.get(key) == out for key, out in theirs.items())
        lines.append(f"\nchat/global's output is kvpress's, word for word, in {same} of {len(theirs)} runs")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=choice_list(MAKERS), default="passkey,needle")
    p.add_argument("--lengths", type=int_list, default="1024,2048,4096")
    p.add_argument("--depths", type=depth_list, default="0.1,0.5,0.9")
    p.add_argument("--seed", type=int, default=100, help="the first prompt's seed (bench/agnostic.py uses 0 on)")
    p.add_argument("--keep", type=fraction_list, default="0.1,0.05")
    p.add_argument("--readings", type=choice_list(READINGS), default=",".join(READINGS))
    p.add_argument("--selections", type=choice_list(SELECTIONS), default=",".join(SELECTIONS))
    p.add_argument("--chunks", type=int_list, default=str(KVzip.chunk), help="KVzip chunk sizes, each its own passes")
    p.add_argument("--kvpress", action="store_true", help="kvpress's KVzipPress too")
    p.add_argument("--kvpress-plus", action="store_true", help="with --kvpress: its KVzip+ as well")
    p.add_argument("--kvpress-keep", type=fraction_list, default=None, help="kvpress's fractions (default: --keep)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    readings, chunks, selections, keeps = args.readings, args.chunks, args.selections, args.keep
    kvpress_keeps = keeps if args.kvpress_keep is None else args.kvpress_keep
    if args.kvpress_plus and not args.kvpress:
        p.error("--kvpress-plus: runs kvpress's KVzip+ beside its plain press: give --kvpress too")
    if args.kvpress and (why := kvpress_missing()):
        p.error(f"--kvpress: {why}")
    if args.out:
        open(args.out, "a").close()   # an unwritable path fails now, not after an hour
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    records, seed = [], args.seed
    for task in args.tasks:
        for length in args.lengths:
            for depth in args.depths:
                prompt = MAKERS[task](tokenizer, length, depth, seed=seed)
                key = dict(task=task, length=prompt.length, depth=depth, seed=seed)
                seed += 1
                runs = run_prompt(model, tokenizer, prompt, readings, chunks, selections, keeps)
                if args.kvpress:
                    runs += kvpress_runs(model, tokenizer, prompt, kvpress_keeps, args.kvpress_plus)
                runs = [{**key, **r} for r in runs]
                records += runs
                print(f"{task} {prompt.length} depth {depth:g}: " + " ".join(
                    f"{r['reading'] or ''}/{r['chunk'] or ''}/{r['selection']}@{r['keep']}:"
                    f"{'ok' if r['correct'] else 'miss'}" for r in runs), flush=True)
    print("\n" + table(records, readings, chunks, selections, keeps))
    if args.out:
        common.write_out(args.out, args, records=records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
