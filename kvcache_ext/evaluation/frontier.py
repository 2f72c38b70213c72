"""The accuracy-per-byte frontier of a RULER run: RULER's mean over its tasks against the KV bytes
a run holds at its end, one line per method across its keep fractions (or budgets), one panel
per prompt mode, each point with its standard error over the prompts as an error bar.

kvpress's presses are lines of their own, dashed with open markers. Their bytes are what their
caches hold as measured, like ours: an Ada-KV press masks a full-size cache, so its line sits at
the full cache's bytes whatever it keeps. The full cache is a star and a dotted line across the
panel: what every method is read against."""
from __future__ import annotations

from kvcache_ext.evaluation.report import METRICS, policy_styles
from kvcache_ext.tasks.ruler import TASKS as RULER_TASKS

MIB = 2 ** 20


def frontier_rows(rows: list[dict]) -> list[dict]:
    """The summary rows the frontier draws: RULER's mean over tasks (``summarize``'s task
    "ruler"), or the rows of the one RULER task when a single task ran. Raises ValueError when
    the rows hold no RULER task."""
    means = [r for r in rows if r["task"] == "ruler"]
    if means:
        return means
    tasks = {r["task"] for r in rows if r["task"] in RULER_TASKS}
    if not tasks:
        raise ValueError("the records hold no RULER task: the frontier plots RULER's scores")
    return [r for r in rows if r["task"] in tasks]   # one task: summarize made no mean


def _error_bars(rows: list[dict]) -> list[float] | None:
    """The rows' standard errors for ``errorbar`` (None: no row has one, so no bars)."""
    if all(r.get("sem") is None for r in rows):
        return None
    return [r.get("sem") or 0.0 for r in rows]


def plot_frontier(rows: list[dict], path: str, title: str = "") -> dict[str, dict[str, list]]:
    """Draws the frontier of ``summarize``'s rows to the PNG ``path``; returns what each panel
    (mode) drew: {label: [[MiB, score], ...]} per line, in the legend's order."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = frontier_rows(rows)
    task = rows[0]["task"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    methods = [p for p in dict.fromkeys(r["policy"] for r in rows) if p != "full"]
    style = policy_styles(methods)
    most = max(r.get("tasks", 1) for r in rows)   # a mean over fewer tasks (merged runs) says so
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.8), squeeze=False, sharey=True)
    drawn = {}
    for ax, mode in zip(axes[0], modes):
        sub = [r for r in rows if r["mode"] == mode]
        for full in [r for r in sub if r["policy"] == "full"]:
            ax.axhline(full["score"], color="black", linestyle=":", linewidth=1)
            ax.errorbar([full["kv_bytes"] / MIB], [full["score"]], yerr=_error_bars([full]), color="black",
                        marker="*", markersize=11, linestyle="none", capsize=3, label="full cache")
            scale = full["kv_bytes"] / MIB   # the top axis reads the bytes as a share of the full cache's
            top = ax.secondary_xaxis("top", functions=(lambda x, s=scale: x / s, lambda f, s=scale: f * s))
            top.set_xlabel("share of the full cache's bytes", fontsize=8)
        for policy in methods:
            points = sorted((r for r in sub if r["policy"] == policy), key=lambda r: r["kv_bytes"])
            if not points:
                continue
            line = {**style[policy], "linestyle": "-"}
            if policy.startswith("kvpress-"):
                line.update(linestyle="--", markerfacecolor="none")
            tasks = points[0].get("tasks", most)
            label = policy if tasks == most else f"{policy} (over {tasks} of {most} tasks)"
            ax.errorbar([r["kv_bytes"] / MIB for r in points], [r["score"] for r in points],
                        yerr=_error_bars(points), capsize=3, label=label, **line)
        ax.set_xlim(left=0)
        ax.set_xlabel("KV bytes held at the end of a run, MiB (mean over the prompts)")
        ax.set_ylabel(METRICS[task][1])
        ax.set_title(f"{'RULER' if task == 'ruler' else task}, {mode}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        drawn[mode] = {bars.get_label(): bars.lines[0].get_xydata().tolist() for bars in ax.containers}
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
