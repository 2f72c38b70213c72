"""The source says why, not when or how fast: no date, issue number, research spec, DESIGN.md or
bench/results/ path in any file under kvcache_ext/ or csrc/ (csrc/tests/ aside). Dates and issue
numbers are history (git and CHANGELOG.md keep it); the research specs and DESIGN.md are not in
the repository (cite the paper, or docs/); a results JSON is replaced at every run (cite the
benchmark that writes it). Reads the files as text, imports nothing."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("kvcache_ext", "csrc")
SKIPPED_DIRS = {ROOT / "csrc" / "tests"}
SKIPPED_NAMES = {"__pycache__"}
BINARY_SUFFIXES = {".so", ".o", ".a", ".pyc", ".pyd", ".dll", ".dylib", ".obj", ".lib"}

# What is refused, each with a pattern precise enough to leave code and prose alone: a date is
# YYYY-MM-DD with a real month and day, not inside a longer run of digits (so "2048-1024" or a
# hex constant is not one); an issue is "issue N" / "issue #N" / "issue-N", or a list "issues
# N and M" (a bare "issues N" is also the verb: "a thread issues 4 loads").
PATTERNS = {
    "date": re.compile(r"(?<!\d)(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])(?!\d)"),
    "issue number": re.compile(
        r"\bissue[\s-]*#?\s*\d+\b|\bissues\s+#?\d+(?:\s*(?:,|and|&)\s*#?\d+)+\b", re.IGNORECASE),
    "research spec": re.compile(r"\bresearch/|\bseed-\d{3}\b"),
    "DESIGN.md": re.compile(r"\bDESIGN\.md\b"),
    "bench/results path": re.compile(r"\bbench/results/"),
}


def hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, matched text) of every refused string in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for kind, pattern in PATTERNS.items():
            found += [(number, kind, m.group(0)) for m in pattern.finditer(line)]
    return found


def scanned_files() -> list[Path]:
    files = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file() or path.suffix in BINARY_SUFFIXES:
                continue
            if SKIPPED_NAMES & set(path.parts) or any(d in path.parents for d in SKIPPED_DIRS):
                continue
            files.append(path)
    return files


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_patterns_catch_planted_examples():
    planted = {
        "# as before 2026-11-26, moved": "date",
        "// bench/results/decode-calls-cpu-2026-11-27.json": "date",
        "Left for later (issue 43), in this order": "issue number",
        "the goals of Issue #42": "issue number",
        "the issue-18 targets": "issue number",
        "issues 42 and 43 asked": "issue number",
        "(research/seed-000-caote.md §4.1)": "research spec",
        "the numerically stable form of seed-000 §9.3": "research spec",
        '// the host side (DESIGN.md "Ragged store")': "DESIGN.md",
        "(bench/decode_calls.py; bench/results/x.json)": "bench/results path",
    }
    for line, kind in planted.items():
        assert kind in {k for _, k, _ in hits(line)}, (line, kind)
    clean = [
        "torch 2.13.0, transformers 4.57.1, CUDA 12.8",
        "constexpr uint64_t kMask = 0x2026112700000000ull;",
        "a [2048-1024] slice; shapes 32 x 32768; 2026-13-45 is no date",
        "a thread issues all its units of a chunk; each warp issues 4 loads",
        "Issues the copies of the tile at token t0 into stage `stage`",
        "the random seed=3, seed-1 of the sweep; research paper; design.md",
        "per-token copies are faster than one gather (bench/kernels.py measures both)",
        "Results go to bench/results (one JSON per benchmark)",
    ]
    for line in clean:
        assert hits(line) == [], (line, hits(line))


def test_scans_the_sources():
    names = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert "kvcache_ext/__init__.py" in names
    assert any(n.startswith("csrc/") and n.endswith(".cpp") for n in names)
    assert not any(n.startswith("csrc/tests/") for n in names)


def test_no_dates_issue_numbers_or_outside_files_in_the_source():
    found = []
    for path in scanned_files():
        text = read_text(path)
        if text is None:
            continue
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{line}: {kind}: {match!r}" for line, kind, match in hits(text)]
    assert not found, ("history or files outside the repository in the source (a comment says why; "
                       "cite the paper or docs/, the benchmark script, not its results):\n"
                       + "\n".join(found))
