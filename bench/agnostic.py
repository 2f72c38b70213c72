"""Query-agnostic retrieval side by side with kvpress's KVzip, on the same prompts, with the cost.

    PYTHONPATH=$PWD python bench/agnostic.py [--tasks passkey,needle] [--lengths 1024,2048,4096]
        [--depths 0.1,0.5,0.9] [--keep 0.25,0.1,0.05] [--methods kvzip-global,...]
        [--kvpress-keep 0.25,0.1] [--out results.json]

Every prompt is asked in agnostic mode: its context (everything before the question) is
compressed first, then the question is fed over the compressed cache, then 8 greedy tokens.
Per prompt, one after the other in the same process (so that every ratio is measured side by side):

- ``dense``: the unpatched model's prefill of the context on HF's ``DynamicCache`` (wall time
  and extra peak memory: the baseline of the cost ratios);
- ``full``: the full cache's answer (is the prompt answerable at all?);
- ours, each of ``--methods`` (names of ``kvcache-ext eval``): its answers at every keep
  fraction through the eval harness (``retrieval.run_prompt``: one dense prefill, one set of
  reconstruction passes, then each fraction's cache); and, for KVzip's methods, the patched
  model's own prefill of the context (the passes included), timed and its extra peak memory
  measured, once per prompt at the smallest fraction;
- ``kvpress-kvzip`` (when ``import kvpress`` works: the venv of ``pip install ".[bench]"``):
  ``KVzipPress(compression_ratio=1 - keep)`` around the prefill of a ``DynamicCache``, at each
  of ``--kvpress-keep`` (each run reconstructs again: kvpress has no way to reuse the scores);
  then the question and the same greedy decode. kvpress masks a full-size cache: its KV bytes
  are the full cache's.

Extra peak memory = the largest resident set size sampled every 2 ms during the prefill, minus
the resident size before it. Results: JSON (``--out``) with every record and a summary table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (first: it puts a built checkout ahead of an installed copy)
import kvcache_ext  # noqa: E402
from kvcache_ext.cache_argument import with_cache  # noqa: E402
from kvcache_ext.cli.args import choice_list, depth_list, fraction_list, int_list, int_range  # noqa: E402
from kvcache_ext.evaluation.decoding import cache_bytes, greedy_continue  # noqa: E402
from kvcache_ext.evaluation.kvpress_runs import kvpress_missing, kvzip_tokenizer, unmask  # noqa: E402
from kvcache_ext.evaluation.named_policies import make_policy, parse_policies  # noqa: E402
from kvcache_ext.evaluation.retrieval import budget_tokens, run_prompt  # noqa: E402
from kvcache_ext.hf.models import load_model  # noqa: E402
from kvcache_ext.tasks import check_answer, make_needle_prompt, make_passkey_prompt  # noqa: E402

MAKERS = {"passkey": make_passkey_prompt, "needle": make_needle_prompt}
KVPRESS_CHUNK = 2048   # KVzipPress's chunk_size in kvpress 0.5.5 (ours: KVzip.chunk, 1024)


class PeakRSS:
    """The largest resident set size while the block runs, above the size at its start."""

    def __enter__(self):
        import psutil
        self._proc, self._stop = psutil.Process(), threading.Event()
        self.start = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.extra = self.peak - self.start


def timed_prefill(model, ids, cache, press=None) -> dict:
    """Wall time and extra peak memory of the prefill of ``ids`` into ``cache``."""
    import contextlib
    gc.collect()
    with PeakRSS() as mem:
        start = time.perf_counter()
        with press(model) if press is not None else contextlib.nullcontext():
            out = model(ids, **with_cache(model, cache), use_cache=True)
        seconds = time.perf_counter() - start
    return {"prefill_s": seconds, "extra_peak_bytes": mem.extra, "logits": out.logits[:, -1]}


def kvpress_kvzip(model, tokenizer, prompt, keep: float, plus: bool = False) -> dict:
    """kvpress's KVzipPress at ``keep`` on the prompt's context, then the question and 8 tokens.
    ``plus``: with its ``kvzip_plus_normalization`` (method ``kvpress-kvzip-plus``)."""
    from kvpress import KVzipPress
    from transformers import DynamicCache
    ids = prompt.input_ids[None]
    context, question = ids[:, :prompt.haystack_end], ids[:, prompt.haystack_end:]
    cache = DynamicCache(config=model.config)
    try:
        with kvzip_tokenizer(tokenizer):   # the default model is a GGUF file, without a hub name
            run = timed_prefill(model, context, cache,
                                KVzipPress(compression_ratio=1 - keep, kvzip_plus_normalization=plus))
        logits = model(question, **with_cache(model, cache), use_cache=True).logits[:, -1]
        new, _ = greedy_continue(model, cache, logits, 8, tokenizer.eos_token_id)
    finally:
        unmask(model)
    text = tokenizer.decode(new, skip_special_tokens=True)
    return {"method": "kvpress-kvzip-plus" if plus else "kvpress-kvzip", "keep": keep, "prefill_s": run["prefill_s"],
            "extra_peak_bytes": run["extra_peak_bytes"], "kv_bytes": cache_bytes(cache),
            "output": text, "correct": check_answer(text, prompt.answer)}


def ours_prefill(model, tokenizer, context, method: str, keep: float) -> dict:
    """The patched model's own prefill of ``context`` with ``method`` at ``keep`` (the passes
    of a reconstructing scorer included)."""
    policy = make_policy(method, budget_tokens(keep, context.shape[1]))
    with kvcache_ext.patch(model, policy, tokenizer=tokenizer) as handle:
        cache = handle.new_cache()
        run = timed_prefill(model, context, cache)
    return {"method": method, "keep": keep, "prefill_s": run["prefill_s"],
            "extra_peak_bytes": run["extra_peak_bytes"], "kv_bytes": cache_bytes(cache)}


def summarize(records: list[dict]) -> list[dict]:
    """Per (task, method, keep): accuracy, KV bytes over the full cache's, prefill time over the
    dense prefill's of the same prompts, and the largest extra peak memory."""
    dense = {(r["task"], r["length"], r["depth"], r["seed"]): r for r in records if r["method"] == "dense"}
    groups = {}
    for r in records:
        if r["method"] != "dense" and "correct" in r:
            groups.setdefault((r["task"], r["method"], r["keep"]), []).append(r)
    rows = []
    for (task, method, keep), rs in groups.items():
        base = [dense[(r["task"], r["length"], r["depth"], r["seed"])] for r in rs]
        timed = [(r, b) for r, b in zip(rs, base) if r.get("prefill_s")]
        rows.append({
            "task": task, "method": method, "keep": keep, "n": len(rs), "correct": sum(r["correct"] for r in rs),
            "accuracy": sum(r["correct"] for r in rs) / len(rs),
            "kv_fraction": sum(r["kv_bytes"] for r in rs) / sum(b["full_bytes"] for b in base),
            "prefill_over_dense": (sum(r["prefill_s"] for r, _ in timed) / sum(b["prefill_s"] for _, b in timed)
                                   if timed else None),
            "max_extra_peak_MiB": max((r["extra_peak_bytes"] for r in rs if "extra_peak_bytes" in r),
                                      default=0) / 2**20 or None})
    return sorted(rows, key=lambda r: (r["task"], r["method"], -(r["keep"] or 1.0)))


def format_table(rows: list[dict], records: list[dict]) -> str:
    lines = ["| task | method | keep | answered | KV bytes / full | prefill / dense prefill | extra peak MiB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{r['prefill_over_dense']:.2f}x" if r["prefill_over_dense"] else ""
        peak = f"{r['max_extra_peak_MiB']:.0f}" if r["max_extra_peak_MiB"] else ""
        keep = "" if r["keep"] is None else f"{r['keep']:g}"
        lines.append(f"| {r['task']} | {r['method']} | {keep} | {r['correct']}/{r['n']} | "
                     f"{r['kv_fraction']:.3f} | {ratio} | {peak} |")
    dense = [r for r in records if r["method"] == "dense"]
    if dense:
        peak = max(r["extra_peak_bytes"] for r in dense) / 2**20
        lines.append(f"\ndense prefill: {sum(r['prefill_s'] for r in dense):.1f} s over {len(dense)} prompts, "
                     f"extra peak up to {peak:.0f} MiB")
    return "\n".join(lines)


def _fractions_or_none(text: str) -> list[float]:
    """--kvpress-keep: fractions in (0, 1], or '' for none."""
    return fraction_list(text) if text.strip() else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=choice_list(MAKERS), default="passkey,needle")
    p.add_argument("--lengths", type=int_list, default="1024,2048,4096")
    p.add_argument("--depths", type=depth_list, default="0.1,0.5,0.9")
    p.add_argument("--seeds", type=int_range(1), default=1, help="prompts per (length, depth)")
    p.add_argument("--keep", type=fraction_list, default="0.25,0.1,0.05",
                   help="fractions of the context kept (ours)")
    p.add_argument("--methods", default="kvzip-global", help="our methods (kvcache-ext eval names)")
    p.add_argument("--kvpress-keep", type=_fractions_or_none, default="0.25,0.1",
                   help="fractions for kvpress's KVzip ('' for none)")
    p.add_argument("--out", default=None, help="JSON of every record and the summary, written after each prompt")
    args = p.parse_args(argv)
    keeps, kvp_keeps = args.keep, args.kvpress_keep
    methods = parse_policies(args.methods)
    if kvp_keeps and (why := kvpress_missing()):
        print(f"kvpress-kvzip is skipped: {why}", file=sys.stderr)
        kvp_keeps = []
    if args.out:
        open(args.out, "a").close()   # an unwritable path fails now, not after an hour
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    from transformers import DynamicCache
    records, seed = [], 0
    for task in args.tasks:
        for length in args.lengths:
            for depth in args.depths:
                for _ in range(args.seeds):
                    prompt = MAKERS[task](tokenizer, length, depth, seed=seed)
                    key = dict(task=task, length=prompt.length, depth=depth, seed=seed)
                    seed += 1
                    context = prompt.input_ids[None, :prompt.haystack_end]
                    cache = DynamicCache(config=model.config)
                    run = timed_prefill(model, context, cache)
                    records.append({**key, "method": "dense", "prefill_s": run["prefill_s"],
                                    "extra_peak_bytes": run["extra_peak_bytes"], "full_bytes": cache_bytes(cache)})
                    del cache
                    # The full cache's answer first (is the prompt answerable at all?), then ours.
                    for r in run_prompt(model, tokenizer, prompt, task, "agnostic", ["full"] + methods, keeps):
                        records.append({**key, "method": r.policy, "keep": r.budget, "correct": r.correct,
                                        "output": r.output, "kv_bytes": r.kv_bytes,
                                        "harness_prefill_s": r.prefill_s})
                    for method in methods:
                        if make_policy(method, 64).scorer.capabilities.reconstructs:
                            timing = ours_prefill(model, tokenizer, context, method, min(keeps))
                            for r in records:   # the patched prefill's cost goes with every fraction
                                if r.get("method") == method and all(r[k] == v for k, v in key.items()):
                                    r.update(prefill_s=timing["prefill_s"],
                                             extra_peak_bytes=timing["extra_peak_bytes"])
                    for keep in kvp_keeps:
                        records.append({**key, **kvpress_kvzip(model, tokenizer, prompt, keep)})
                    print(f"{task} {prompt.length} tokens, depth {depth}: " + ", ".join(
                        f"{r['method']}@{r.get('keep')}={'ok' if r['correct'] else 'miss'}"
                        for r in records if "correct" in r and all(r[k] == v for k, v in key.items())), flush=True)
                    if args.out:
                        with open(args.out, "w") as f:
                            json.dump({"meta": {**common.run_metadata("cpu"), "partial": True},
                                       "records": records, "rows": summarize(records)}, f, indent=1)
    rows = summarize(records)
    print(format_table(rows, records))
    if args.out:
        common.write_out(args.out, args, records=records, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
