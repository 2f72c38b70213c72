"""Ada-KV across tensor-parallel ranks, exact against per rank, on passkey prompts.

    PYTHONPATH=$PWD python bench/tensor_parallel.py [--ranks 3] [--lengths 1024,2048]
        [--depths 0.25,0.5,0.75] [--budgets 64,128] [--repeats 3] [--out tp.json]

The default model (SmolLM2-135M: 9 query heads, 3 KV heads) is saved as safetensors and loaded
by ``--ranks`` CPU processes (gloo) with transformers' own plan (``tp_plan="auto"``), so that
each rank's attention and cache hold 3 / ranks of its KV heads; one more process runs the
unsharded model. For each passkey prompt and budget (tokens per KV head) both run three
policies: SnapKV (uniform: no rank talks to another), Ada-SnapKV with the exact split across
ranks (``AdaKV()``: one all-gather of the scores per layer's eviction) and Ada-SnapKV per rank
(``AdaKV(across_ranks="per_rank")``: each rank splits its share of the budget over its own
heads). Printed per policy and budget: the passkeys answered by the ranks and by one process,
how many prompts give one process's tokens, and the prefill time on the ranks (``generate`` of
one token, the median of ``--repeats``, the slowest rank). The exact split's cost per eviction
is its prefill time less per rank's, over the layers (each evicts once, at the end of the
prompt).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (first: the checkout's kvcache_ext ahead of an installed copy)
import kvcache_ext  # noqa: E402
from kvcache_ext.cli.args import depth_list, int_list, int_range  # noqa: E402
from kvcache_ext.hf.tensor_parallel import tp_plan_auto  # noqa: E402
from kvcache_ext.policies import AdaKV, Policy, SnapKV  # noqa: E402
from kvcache_ext.tasks import check_answer, make_passkey_prompt  # noqa: E402

ACROSS_RANKS = {"snapkv": None, "ada-snapkv-exact": "exact", "ada-snapkv-per-rank": "per_rank"}   # None: uniform
POLICIES = tuple(ACROSS_RANKS)
NEW_TOKENS = 8   # a five-digit passkey and what surrounds it


def make_policy(name: str, budget: int) -> Policy:
    across = ACROSS_RANKS[name]
    allocation = {} if across is None else {"allocation": AdaKV(across_ranks=across)}
    return Policy(SnapKV(), budget=budget, **allocation)


def run_all(model, prompts: list[dict], budgets: list[int], repeats: int) -> list[dict]:
    """Per prompt, budget and policy: the tokens generated and the median prefill seconds."""
    out = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt["ids"]])
        for budget in budgets:
            for name in POLICIES:
                with kvcache_ext.patch(model, make_policy(name, budget)):
                    seconds = []
                    for _ in range(repeats):
                        start = time.perf_counter()
                        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
                        seconds.append(time.perf_counter() - start)
                    new = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                         do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
                out.append({"prompt": i, "budget": budget, "policy": name, "tokens": new,
                            "prefill_s": statistics.median(seconds)})
    return out


def _rank(rank: int, world: int, path: str, port: int, prompts: list[dict], budgets: list[int], repeats: int,
          results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)   # the ranks share the machine's cores
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **tp_plan_auto()).eval()
        with torch.no_grad():
            torch.save(run_all(model, prompts, budgets, repeats), os.path.join(results, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int_range(2), default=3, help="tensor-parallel CPU processes (must divide the 3 KV heads)")
    p.add_argument("--lengths", type=int_list, default="1024,2048", help="prompt lengths in tokens")
    p.add_argument("--depths", type=depth_list, default="0.25,0.5,0.75", help="passkey depths in [0, 1]")
    p.add_argument("--budgets", type=int_list, default="64,128", help="tokens kept per KV head (SnapKV protects its 32 last)")
    p.add_argument("--repeats", type=int_range(1), default=3, help="timed prefills per run (the median is kept)")
    p.add_argument("--out", default=None, help="JSON of the rows, the records and the run's description")
    args = p.parse_args(argv)
    for budget in args.budgets:
        try:
            make_policy(POLICIES[0], budget)
        except ValueError as err:
            p.error(f"--budgets {budget}: {err}")

    import torch.multiprocessing as mp
    from kvcache_ext.hf.models import load_model
    model, tokenizer = load_model()
    kv_heads, layers = model.config.num_key_value_heads, model.config.num_hidden_layers
    if kv_heads % args.ranks or model.config.num_attention_heads % args.ranks:
        p.error(f"--ranks {args.ranks}: the default model's {kv_heads} KV heads and "
                f"{model.config.num_attention_heads} query heads must split evenly over the ranks")
    prompts = []
    for n in args.lengths:
        for depth in args.depths:
            prompt = make_passkey_prompt(tokenizer, n, depth, seed=len(prompts))
            prompts.append({"length": n, "depth": depth, "answer": prompt.answer, "ids": prompt.input_ids.tolist()})
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        path, results = os.path.join(tmp, "model"), os.path.join(tmp, "results")
        os.makedirs(results)
        model.save_pretrained(path)
        print(f"{args.ranks} ranks x {len(prompts)} prompts x {len(args.budgets)} budgets x {len(POLICIES)} policies",
              flush=True)
        mp.spawn(_rank, args=(args.ranks, path, common.free_port(), prompts, args.budgets, args.repeats, results),
                 nprocs=args.ranks, join=True)
        ranks = [torch.load(os.path.join(results, f"rank{r}.pt")) for r in range(args.ranks)]
    one = run_all(model, prompts, args.budgets, 1)   # its tokens only: its time is not compared

    def answered(tokens, prompt) -> bool:
        return check_answer(tokenizer.decode(tokens, skip_special_tokens=True), prompt["answer"])

    records = []
    for j, single in enumerate(one):
        on_ranks = [r[j] for r in ranks]
        assert all(r["tokens"] == on_ranks[0]["tokens"] for r in on_ranks), "the ranks generated different tokens"
        prompt = prompts[single["prompt"]]
        records.append({"length": prompt["length"], "depth": prompt["depth"], "budget": single["budget"],
                        "policy": single["policy"], "answered": answered(on_ranks[0]["tokens"], prompt),
                        "answered_one_process": answered(single["tokens"], prompt),
                        "same_tokens": on_ranks[0]["tokens"] == single["tokens"],
                        "prefill_s": max(r["prefill_s"] for r in on_ranks)})
    rows = []
    print(f"| policy | budget | answered ({args.ranks} ranks) | answered (one process) | tokens as one process "
          f"| prefill s ({args.ranks} ranks) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for budget in args.budgets:
        for name in POLICIES:
            mine = [r for r in records if r["budget"] == budget and r["policy"] == name]
            row = {"policy": name, "budget": budget, "prompts": len(mine),
                   "answered": sum(r["answered"] for r in mine),
                   "answered_one_process": sum(r["answered_one_process"] for r in mine),
                   "same_tokens": sum(r["same_tokens"] for r in mine),
                   "prefill_s": statistics.median(r["prefill_s"] for r in mine)}
            rows.append(row)
            print(f"| {name} | {budget} | {row['answered']}/{len(mine)} | {row['answered_one_process']}/{len(mine)} "
                  f"| {row['same_tokens']}/{len(mine)} | {row['prefill_s']:.2f} |")
    for budget in args.budgets:
        by = {r["policy"]: r["prefill_s"] for r in rows if r["budget"] == budget}
        extra = (by["ada-snapkv-exact"] - by["ada-snapkv-per-rank"]) / layers
        print(f"budget {budget}: the exact split costs {extra * 1e3:+.1f} ms per layer's eviction "
              f"({layers} layers) against per rank")
    if args.out:
        common.write_out(args.out, args, meta={"ranks": args.ranks, "layers": layers, "kv_heads": kv_heads,
                                               "machine": common.cpu_model(), "cores": os.cpu_count()},
                         rows=rows, records=records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
