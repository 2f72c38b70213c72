"""Results of ``kvcache-ext eval``: one row per (task, mode, policy, budget), a table, a plot."""
from __future__ import annotations

import math
from collections import defaultdict

from kvcache_ext.evaluation.spread import mean_of_means_error, standard_error
from kvcache_ext.tasks.ruler import TASKS as RULER_TASKS

METRICS = {   # task -> (metric of a row, its label, higher is better)
    "passkey": ("accuracy", "accuracy", True),
    "needle": ("accuracy", "accuracy", True),
    "multi": ("accuracy", "accuracy over the questions", True),
    "ppl": ("ppl", "perplexity", False),
    "fidelity": ("kl", "KL(full || policy), nats/token", False),
    **{task: ("score", "RULER score (share of the answers found, 0-100)", True) for task in RULER_TASKS},
    "ruler": ("score", "RULER score, mean over its tasks (0-100)", True),
}


def summarize(records: list[dict]) -> list[dict]:
    """Rows: per (task, mode, policy, budget), the task's metric over the records, the mean KV
    bytes held at the end of a run (``kv_bytes``) and as a fraction of the full cache's. A RULER
    task's row also has each prompt's score (``prompt_scores``, by length and seed) and the
    standard error of their mean (``sem``, None under two prompts)."""
    groups = defaultdict(list)
    for r in records:
        groups[(r["task"], r["mode"], r["policy"], r["budget"])].append(r)
    rows = []
    for (task, mode, policy, budget), rs in groups.items():
        row = {"task": task, "mode": mode, "policy": policy, "budget": budget, "n": len(rs),
               "kv_bytes": sum(r["kv_bytes"] for r in rs) / len(rs),
               "kv_fraction": sum(r["kv_bytes"] for r in rs) / max(sum(r["full_bytes"] for r in rs), 1)}
        if task in ("passkey", "needle", "multi"):
            row["correct"] = sum(r["correct"] for r in rs)
            row["accuracy"] = row["correct"] / len(rs)
        elif task == "ppl":
            tokens = sum(r["tokens"] for r in rs)
            row["nll"] = sum(r["nll"] * r["tokens"] for r in rs) / tokens
            row["ppl"] = math.exp(row["nll"])
        elif task == "fidelity":
            tokens = sum(r["tokens"] for r in rs)
            row["kl"] = sum(r["kl"] * r["tokens"] for r in rs) / tokens
            row["top1"] = sum(r["top1"] * r["tokens"] for r in rs) / tokens
        elif task in RULER_TASKS:
            row["correct"] = sum(r["correct"] for r in rs)
            row["prompt_scores"] = [{"length": r["length"], "seed": r["seed"], "score": 100 * r["score"]}
                                    for r in sorted(rs, key=lambda r: (r["length"], r["seed"]))]
            scores = [p["score"] for p in row["prompt_scores"]]
            row["score"] = sum(scores) / len(scores)
            row["sem"] = standard_error(scores)
        rows.append(row)
    rows += _ruler_means(rows)
    modes = ("aware", "agnostic", "blockwise", "teacher-forced")
    tasks = list(METRICS)
    order = lambda r: (tasks.index(r["task"]), modes.index(r["mode"]), r["policy"] != "full", r["budget"] or 0)
    return sorted(rows, key=order)   # stable: policies stay in the order they ran


def _ruler_means(rows: list[dict]) -> list[dict]:
    """Rows of task "ruler": per (mode, policy, budget), the mean of the RULER tasks' scores
    (RULER's average), when more than one RULER task ran, and its standard error propagated from
    the tasks' (the tasks are fixed, their prompts drawn independently: docs/evaluation.md)."""
    groups = defaultdict(list)
    for row in rows:
        if row["task"] in RULER_TASKS:
            groups[(row["mode"], row["policy"], row["budget"])].append(row)
    if len({row["task"] for rs in groups.values() for row in rs}) < 2:
        return []
    return [{"task": "ruler", "mode": mode, "policy": policy, "budget": budget, "n": sum(r["n"] for r in rs),
             "tasks": len(rs), "kv_fraction": sum(r["kv_fraction"] for r in rs) / len(rs),
             "kv_bytes": sum(r["kv_bytes"] for r in rs) / len(rs),
             "score": sum(r["score"] for r in rs) / len(rs), "sem": mean_of_means_error([r["sem"] for r in rs])}
            for (mode, policy, budget), rs in groups.items()]


def format_table(rows: list[dict]) -> str:
    """A markdown table: one line per (task, mode, policy), one column per budget."""
    if not rows:
        return "(no results)"
    lines = []
    for (task, mode) in dict.fromkeys((r["task"], r["mode"]) for r in rows):
        _, label, _ = METRICS[task]
        sub = [r for r in rows if r["task"] == task and r["mode"] == mode]
        budgets = sorted({r["budget"] for r in sub if r["budget"] is not None})
        spread = "; ± its standard error over the prompts" if any(r.get("sem") is not None for r in sub) else ""
        lines += [f"{task} ({mode}): {label}{spread}; in brackets, KV bytes held / full cache", "",
                  "| policy | " + " | ".join(_budget_label(b) for b in budgets) + " |",
                  "| --- |" + " --- |" * len(budgets)]
        # a RULER mean over fewer tasks than the table's others (runs merged by --report) says so
        most = max(r.get("tasks", 0) for r in sub)
        for policy in dict.fromkeys(r["policy"] for r in sub):
            cells = {r["budget"]: r for r in sub if r["policy"] == policy}
            if None in cells:   # the full cache: the same value in every column
                text = [_cell(task, cells[None], most)] * len(budgets)
            else:
                text = [_cell(task, cells[b], most) if b in cells else "" for b in budgets]
            lines.append(f"| {policy} | " + " | ".join(text) + " |")
        lines.append("")
    return "\n".join(lines)


def _budget_label(budget) -> str:
    return f"keep {budget:g}" if isinstance(budget, float) else f"B={budget}"


def _cell(task: str, row: dict, most_tasks: int = 0) -> str:
    kv = f" ({row['kv_fraction']:.2f})"
    if row.get("tasks", most_tasks) < most_tasks:
        kv += f" over {row['tasks']} of {most_tasks} tasks"
    if task in ("passkey", "needle", "multi"):
        return f"{row['correct']}/{row['n']}" + kv
    if task == "ppl":
        return f"{row['ppl']:.2f}" + kv
    if METRICS[task][0] == "score":
        spread = f" ± {row['sem']:.1f}" if row.get("sem") is not None else ""
        return f"{row['score']:.1f}{spread}" + kv
    return f"{row['kl']:.3f}, top-1 {row['top1']:.2f}" + kv


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """The task's metric against the budget, one line per policy, one panel per (task, mode)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["task"], r["mode"]) for r in rows))
    style = policy_styles([p for p in dict.fromkeys(r["policy"] for r in rows) if p != "full"])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (task, mode) in zip(axes[0], panels):
        metric, label, _ = METRICS[task]
        sub = [r for r in rows if r["task"] == task and r["mode"] == mode]
        for policy in dict.fromkeys(r["policy"] for r in sub):
            pts = sorted((r["budget"], r[metric]) for r in sub if r["policy"] == policy and r["budget"])
            full = [r[metric] for r in sub if r["policy"] == policy and r["budget"] is None]
            if full and task == "fidelity":
                continue   # KL 0 against itself: nothing to draw on a log scale
            if full:
                ax.axhline(full[0], color="black", linestyle="--", linewidth=1, label="full cache")
            elif pts:
                ax.plot([b for b, _ in pts], [m for _, m in pts], label=policy, **style[policy])
        ax.set_xscale("log", base=2)
        budgets = sorted({r["budget"] for r in sub if r["budget"]})
        ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
        fractions = all(isinstance(b, float) for b in budgets)
        ax.set_xlabel("fraction of the prompt kept" if fractions else "budget (tokens per KV head)")
        ax.set_ylabel(label)
        if task in ("ppl", "fidelity"):
            ax.set_yscale("log")
        ax.set_title(f"{task}, {mode}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best", ncol=2)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def policy_styles(policies: list[str]) -> dict[str, dict]:
    """Matplotlib line settings per policy: up to 20 in distinct colours, with markers and dashes
    so that crossing lines stay apart."""
    import matplotlib
    colours = matplotlib.colormaps["tab20"].colors
    return {p: dict(color=colours[(2 * i) % 20 + (2 * i) // 20], marker="osD^v<>p*hX"[i % 11],
                    linestyle=("-", "--", ":")[i % 3]) for i, p in enumerate(policies)}
