"""Key metrics per profiled kernel from an Nsight Compute details CSV, as a Markdown table.

    ncu --import REPORT.ncu-rep --page details --csv > details.csv
    python bench/nsight/summarize.py details.csv

Picks, for each kernel launch in the report, the metrics that say whether a memory-bound
kernel is doing its job (see bench/README.md, "Nsight"): duration, DRAM throughput as % of
peak, memory and compute (SM) speed-of-light %, the DRAM bandwidth reached, the L2 and L1 hit
rates and the achieved vs theoretical occupancy. A metric missing from the report (a smaller
--set, another ncu version) prints as "—".
"""
from __future__ import annotations

import csv
import re
import sys

# (column title, section name fragment, metric name): the names the Nsight Compute sections use.
COLUMNS = [
    ("duration", "Speed Of Light", "Duration"),
    ("DRAM % of peak", "Speed Of Light", "DRAM Throughput"),
    ("memory SOL %", "Speed Of Light", "Memory Throughput"),
    ("compute SOL %", "Speed Of Light", "Compute (SM) Throughput"),
    ("DRAM bandwidth", "Memory Workload Analysis", "Memory Throughput"),
    ("L2 hit %", "Memory Workload Analysis", "L2 Hit Rate"),
    ("L1 hit %", "Memory Workload Analysis", "L1/TEX Hit Rate"),
    ("achieved occupancy %", "Occupancy", "Achieved Occupancy"),
    ("theoretical occupancy %", "Occupancy", "Theoretical Occupancy"),
    ("registers/thread", "Launch Statistics", "Registers Per Thread"),
]


def short_name(name: str) -> str:
    """A kernel's name without its return type, namespaces and arguments:
    'void ns::(anonymous namespace)::attend_split<c10::BFloat16, 128, 1>(...)'
    -> 'attend_split<c10::BFloat16, 128, 1>'."""
    name = re.sub(r"^void\s+", "", name.strip())
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # drop the parameter list: the first '(' outside <...>
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not name.startswith("(anonymous", i):
            cut = i
            break
    name = name[:cut]
    head, sep, tail = name.partition("<")
    return head.split("::")[-1] + sep + tail


def summarize(path: str) -> str:
    launches: dict[str, dict] = {}
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("==")]  # ncu's own log lines
    for row in csv.DictReader(lines):
        launch = launches.setdefault(row.get("ID", "?"), {
            "kernel": short_name(row.get("Kernel Name", "?")), "grid": row.get("Grid Size", ""),
            "block": row.get("Block Size", ""), "metrics": {}})
        key = (row.get("Section Name", ""), row.get("Metric Name", ""))
        unit = row.get("Metric Unit", "")
        value = row.get("Metric Value", "")
        launch["metrics"][key] = value if unit in ("", "%") else f"{value} {unit}"
    head = ["ID", "kernel", "grid", "block"] + [title for title, _, _ in COLUMNS]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for launch_id, launch in launches.items():
        cells = [launch_id, launch["kernel"], launch["grid"], launch["block"]]
        for _, section, metric in COLUMNS:
            found = [v for (s, m), v in launch["metrics"].items() if m == metric and section in s]
            cells.append(found[0] if found else "—")
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit(__doc__)
    print(summarize(argv[0]))


if __name__ == "__main__":
    main()
