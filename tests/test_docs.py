"""The docs stay reference: README.md within 300 lines and bench/README.md within 400, every
result JSON that a page names exists, and bench/results/ holds no JSON that no page names (the
current JSON of each benchmark stays, the superseded ones are in git's history).

A page names a JSON as ``bench/results/NAME.json`` or ``docs/results/NAME.json`` from the
repository root, or as ``results/NAME.json`` from its own folder (bench/README.md's
``results/`` is bench/results/, docs/*.md's is docs/results/)."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = {"README.md": 300, "bench/README.md": 400}
PAGES = ["README.md", "bench/README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
NAMED = re.compile(r"(?<![\w/.-])((?:bench/|docs/)?results/[\w.-]+\.json)")


def named_json(page: str) -> dict[str, str]:
    """{path from the repository root: as the page writes it} of every result JSON ``page`` names."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    found = {}
    for name in NAMED.findall(text):
        if name.startswith(("bench/", "docs/")):
            path = name
        else:   # results/... from the page's own folder
            path = os.path.normpath(os.path.join(os.path.dirname(page), name))
        found[path] = name
    return found


@pytest.mark.parametrize("page,limit", LIMITS.items())
def test_page_within_its_line_limit(page, limit):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = len(f.read().splitlines())
    assert lines <= limit, f"{page} has {lines} lines; the limit is {limit}: move detail to docs/*.md"


@pytest.mark.parametrize("page", PAGES)
def test_every_json_a_page_names_exists(page):
    missing = sorted(f"{name} ({path})" for path, name in named_json(page).items()
                     if not os.path.isfile(os.path.join(ROOT, path)))
    assert not missing, f"{page} names result files that do not exist: {missing}"


def test_every_json_in_bench_results_is_named_by_a_page():
    named = {path for page in PAGES for path in named_json(page)}
    kept = sorted(os.path.relpath(p, ROOT).replace(os.sep, "/")
                  for p in glob.glob(os.path.join(ROOT, "bench", "results", "*.json")))
    unnamed = [path for path in kept if path not in named]
    assert not unnamed, (f"bench/results holds JSON that no page names: {unnamed}; cite it with its "
                         "benchmark's current result, or delete it (git keeps it)")


def test_the_pattern_reads_both_forms_and_leaves_templates_alone():
    text = ("`bench/results/kernels-cpu-2026-11-28.json`, (`results/passkey.json`; "
            "bench/results/e2e-<device>-<date>.json, docs/results/run.sh")
    assert NAMED.findall(text) == ["bench/results/kernels-cpu-2026-11-28.json", "results/passkey.json"]
