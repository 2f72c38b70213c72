"""The multi-question task served with shared prefixes: every context of the task asked its
questions as concurrent requests (context + question each) on transformers' continuous batching
engine, at one KV memory budget, three ways:

- ``full``: the unpatched model on HF's paged cache with HF's own prefix sharing (its blocks of
  a prompt's full tokens shared between requests): what a user of ``generate_batch`` runs;
- ``<policy>``: the model patched with the policy, each request compressing its own whole
  prompt (its own copy of the context);
- ``<policy>+shared``: the context compressed once by the policy (``handle.share_prefix``) and
  every request continuing a fork of it, the context's pages read in place.

Printed and written per method: answers right, the most requests decoding at once, the most KV
bytes held (sampled while serving; shared prefixes included), wall seconds (prefix compression
included) and generated tokens per second; the ratios against ``full`` are the headline.

    python bench/shared_prefix.py --length 2048 --contexts 2 --repeats 4 --num-blocks 160 \\
        --out bench/results/shared-prefix-cpu-DATE.json
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

from common import write_out   # noqa: E402  (bench/common.py: sys.path, result files)

import kvcache_ext   # noqa: E402
from kvcache_ext.cli.args import MODEL_HELP   # noqa: E402
from kvcache_ext.evaluation.named_policies import make_policy   # noqa: E402
from kvcache_ext.hf.models import load_model   # noqa: E402
from kvcache_ext.tasks import check_answer   # noqa: E402
from kvcache_ext.tasks.multi_question import make_multi_question_prompt   # noqa: E402

SHARED = "+shared"


def policy_of(name: str, keep: float):
    """The named policy keeping ``keep`` of each prompt (or, shared, of the context)."""
    import dataclasses
    policy = make_policy(name, max(2, round(keep * 1024)))
    return dataclasses.replace(policy, budget=None, ratio=keep)


def held_bytes(manager) -> tuple[int, int]:
    """(KV bytes held, requests decoding) of a running engine, or (0, 0) before it has a cache.
    Decoding: the whole prompt run (the engine's active requests also count prompts it has only
    begun, which HF's paged cache may then move out to make room)."""
    from transformers.generation.continuous_batching.requests import RequestStatus
    processor = getattr(manager, "batch_processor", None)
    cache = getattr(processor, "cache", None)
    if cache is None:
        return 0, 0
    running = sum(state.status == RequestStatus.DECODING
                  for state in list(processor.scheduler.active_requests.values()))
    if hasattr(cache, "admission"):     # ours: the requests' ragged caches and the shared prefixes
        return cache.nbytes + cache.prefix_bytes, running
    return cache.num_sectors * cache.bytes_per_sector - int(cache.compute_free_capacity(relative=False)), running


def sample(manager, stop: threading.Event, peaks: dict) -> None:
    while not stop.is_set():
        try:
            held, running = held_bytes(manager)
        except (AttributeError, RuntimeError):   # the engine between states
            held, running = 0, 0
        peaks["held"] = max(peaks["held"], held)
        peaks["running"] = max(peaks["running"], running)
        time.sleep(0.005)


def run_method(args, model, tokenizer, prompts, method: str) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    shared = method.endswith(SHARED)
    name = method[:-len(SHARED)] if shared else method
    inputs = [p.context.tolist() + q.tolist() for p in prompts for q in p.questions for _ in range(args.repeats)]
    answers = [a for p in prompts for a in p.answers for _ in range(args.repeats)]
    config = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    longest = max(len(i) for i in inputs)
    engine = ContinuousBatchingConfig(num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens or longest + 64,
                                      page_size=16)
    patch = kvcache_ext.patch(model, policy_of(name, args.keep), tokenizer=tokenizer) if name != "full" else None
    peaks = {"held": 0, "running": 0}
    start = time.perf_counter()
    try:
        if patch is not None and shared:
            for p in prompts:
                patch.share_prefix(p.context)
        prefix_s = time.perf_counter() - start
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=engine)
        stop = threading.Event()
        watcher = threading.Thread(target=sample, args=(manager, stop, peaks), daemon=True)
        manager.start()
        watcher.start()
        ids = manager.add_requests(inputs=inputs, max_new_tokens=args.max_tokens)
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=args.timeout)
            if result is None:
                raise RuntimeError(f"{method}: no result in {args.timeout} s")
            if result.is_finished():
                results[result.request_id] = result
        manager.stop(block=True)
        stop.set()
        watcher.join()
    finally:
        if patch is not None:
            patch.unpatch()
    seconds = time.perf_counter() - start
    ordered = [results[i] for i in ids]
    errors = [r.error for r in ordered if r.error is not None]
    texts = [tokenizer.decode(r.generated_tokens, skip_special_tokens=True) for r in ordered]
    right = sum(check_answer(t, a) for t, a in zip(texts, answers))
    generated = sum(len(r.generated_tokens) for r in ordered)
    row = {"method": method, "requests": len(inputs), "right": right, "errors": len(errors),
           "most_decoding": peaks["running"], "most_held_bytes": peaks["held"], "seconds": seconds,
           "prefix_seconds": prefix_s, "tokens_per_s": generated / seconds, "answers": texts}
    print(f"{method:32s} right {right}/{len(inputs)}  most decoding {peaks['running']:3d}  "
          f"held {peaks['held'] / 2**20:8.1f} MiB  {seconds:7.1f} s  {row['tokens_per_s']:6.2f} tok/s", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--methods", default="full,snapkv,kvzip-global+shared,snapkv+shared,ada-expected-attention+shared",
                   help="full (HF's paged cache and prefix sharing), a policy name (each request compresses its "
                        "own prompt), or a policy name +shared (the context compressed once, shared)")
    p.add_argument("--keep", type=float, default=0.25, help="fraction of each prompt (shared: of the context) kept")
    p.add_argument("--length", type=int, default=2048, help="tokens of each context")
    p.add_argument("--contexts", type=int, default=2, help="contexts, each asked its three questions")
    p.add_argument("--repeats", type=int, default=4, help="requests per question (as many users asking it)")
    p.add_argument("--num-blocks", type=int, required=True, help="the KV budget, in the engine's blocks")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="default: the longest prompt + 64")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--device", default="cpu", help="cpu, cuda, ...")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    prompts = [make_multi_question_prompt(tokenizer, args.length, seed=s) for s in range(args.contexts)]
    rows = []
    with torch.inference_mode():
        for method in args.methods.split(","):
            rows.append(run_method(args, model, tokenizer, prompts, method.strip()))
    base = next((r for r in rows if r["method"] == "full"), None)
    if base is not None:
        for r in rows:
            r["decoding_vs_full"] = r["most_decoding"] / max(base["most_decoding"], 1)
            r["held_vs_full"] = r["most_held_bytes"] / max(base["most_held_bytes"], 1)
            r["tokens_per_s_vs_full"] = r["tokens_per_s"] / base["tokens_per_s"]
            print(f"{r['method']:32s} decoding {r['decoding_vs_full']:.2f}x  held {r['held_vs_full']:.2f}x  "
                  f"tokens/s {r['tokens_per_s_vs_full']:.2f}x  of full")
    if args.out:
        write_out(args.out, args, {"command": "python bench/shared_prefix.py " + " ".join(argv or sys.argv[1:])},
                  rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
