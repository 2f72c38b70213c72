"""The C++ kernel tests (GoogleTest, csrc/tests/), one pytest test per gtest case.

At collection time the gtest binary is configured and built with CMake into build/gtest under
the repository root (an existing build there is reused: `cmake --build` recompiles only what
changed) and its cases are listed; the binary then runs once per session, with JSON output, and
each pytest test reports its own case: a gtest failure fails it with gtest's messages, a gtest
skip (the CUDA cases on a machine without a GPU) skips it with the reason.

CMake and GoogleTest are required: without them the test `test_gtest[build]` fails and says what
to install (Debian/Ubuntu: `apt-get install cmake libgtest-dev`). Build output is shown only when
the build fails.

Environment:
  KVCACHE_EXT_GTEST_BIN   path of a prebuilt kvcache_ext_gtest: nothing is built.
  KVCACHE_EXT_CMAKE_ARGS  extra arguments for `cmake -S . -B build/gtest` (for example
                          "-DKVCACHE_EXT_CUDA=OFF" or "-DCMAKE_CUDA_ARCHITECTURES=80");
                          when set, the build directory is (re)configured with them.
  KVCACHE_EXT_GTEST_TIMEOUT  seconds the binary may run (default 1800).
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = ROOT / "build" / "gtest"
BINARY = "kvcache_ext_gtest"
BUILD_ID = "build"  # the one test id reported when the binary cannot be built or listed
INSTALL_HINT = ("The C++ kernel tests need CMake (>= 3.18) and GoogleTest: "
                "apt-get install cmake libgtest-dev (Debian/Ubuntu).")


class BuildError(Exception):
    pass


@dataclass
class Prepared:
    binary: Path | None = None
    cases: list = field(default_factory=list)
    error: str | None = None
    build_seconds: float = 0.0


_prepared: Prepared | None = None


def _tail(output: str, lines: int = 200) -> str:
    """The last lines of a build log, preceded by any earlier compiler error lines."""
    all_lines = output.splitlines()
    head = all_lines[:-lines]
    errors = [line for line in head if re.search(r"\berror\b|Error", line)]
    parts = []
    if errors:
        parts.append("--- error lines from earlier in the output ---")
        parts += errors[:100]
    if head:
        parts.append(f"--- last {lines} of {len(all_lines)} lines ---")
    parts += all_lines[-lines:]
    return "\n".join(parts)


def _run_step(what: str, cmd: list, hint: str = "") -> None:
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace")
    if proc.returncode != 0:
        raise BuildError(f"{what} failed (exit status {proc.returncode}):\n  "
                         f"{shlex.join(str(c) for c in cmd)}\n{hint}\n{_tail(proc.stdout)}")


def _local_cuda_arch() -> str | None:
    """The compute capability of this machine's GPU ("90"), so that a fresh build on a GPU
    box runs its CUDA cases; None without a GPU (CMakeLists.txt then defaults to 90)."""
    try:
        import torch
        if torch.version.cuda and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return f"{major}{minor}"
    except Exception:
        pass
    return None


def _build() -> Path:
    prebuilt = os.environ.get("KVCACHE_EXT_GTEST_BIN")
    if prebuilt:
        path = Path(prebuilt)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BuildError(f"KVCACHE_EXT_GTEST_BIN={prebuilt} is not an executable file")
        return path
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildError(f"cmake was not found on PATH. {INSTALL_HINT}")
    extra = shlex.split(os.environ.get("KVCACHE_EXT_CMAKE_ARGS", ""))
    configured = (BUILD_DIR / "CMakeCache.txt").exists() and any(
        (BUILD_DIR / f).exists() for f in ("Makefile", "build.ninja"))
    if not configured or extra:
        args = [cmake, "-S", ROOT, "-B", BUILD_DIR, f"-DPython3_EXECUTABLE={sys.executable}"]
        arch = _local_cuda_arch()
        if arch and not any(a.startswith("-DCMAKE_CUDA_ARCHITECTURES") for a in extra):
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={arch}")
        _run_step("configuring the gtest build with cmake", args + extra,
                  hint=f"{INSTALL_HINT} (GoogleTest is found with find_package(GTest).)")
    _run_step("building the gtest binary", [cmake, "--build", BUILD_DIR, "-j2"])
    binary = BUILD_DIR / BINARY
    if not binary.exists():
        raise BuildError(f"the build succeeded but {binary} does not exist")
    return binary


def _parse_list(text: str) -> list:
    """Full case names (Suite.Case, Prefix/Suite.Case/Param) from --gtest_list_tests."""
    cases, suite = [], None
    for line in text.splitlines():
        if not line.strip() or line.startswith("Running main()"):
            continue
        if not line[0].isspace():
            suite = line.split("#")[0].strip()  # "Suite." (with "# TypeParam = ..." cut)
        elif suite is not None:
            cases.append(suite + line.split("#")[0].strip())
    return cases


def _prepare() -> Prepared:
    global _prepared
    if _prepared is None:
        started = time.monotonic()
        try:
            binary = _build()
            proc = subprocess.run([str(binary), "--gtest_list_tests"], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, errors="replace")
            if proc.returncode != 0:
                raise BuildError(f"{binary} --gtest_list_tests failed (exit status "
                                 f"{proc.returncode}):\n{_tail(proc.stdout)}")
            cases = _parse_list(proc.stdout)
            if not cases:
                raise BuildError(f"{binary} lists no test cases:\n{_tail(proc.stdout)}")
            _prepared = Prepared(binary, cases, None, time.monotonic() - started)
        except BuildError as e:
            _prepared = Prepared(error=str(e), build_seconds=time.monotonic() - started)
    return _prepared


def pytest_generate_tests(metafunc):
    if "gtest_case" in metafunc.fixturenames:
        prepared = _prepare()
        cases = [BUILD_ID] if prepared.error else prepared.cases
        metafunc.parametrize("gtest_case", cases, ids=cases)


# ---------------------------------------------------------------------------------------
# Running the binary once
# ---------------------------------------------------------------------------------------
@dataclass
class Outcome:
    status: str  # "passed", "failed", "skipped"
    message: str = ""


@dataclass
class Run:
    outcomes: dict
    returncode: int
    output: str
    note: str = ""  # why some cases have no outcome (crash, timeout)


_MARK = re.compile(r"^\[\s*(RUN|OK|FAILED|SKIPPED)\s*\] ([^\s,]+)")


def _blocks(output: str) -> dict:
    """Text printed by each case, from its [ RUN ] line to its end line (or the end)."""
    blocks, current = {}, None
    for line in output.splitlines():
        m = _MARK.match(line)
        if m and m.group(1) == "RUN":
            current = m.group(2)
            blocks[current] = []
        elif current is not None:
            if m and m.group(2) == current:
                blocks[current].append(line)
                current = None
            else:
                blocks[current].append(line)
    return {k: "\n".join(v) for k, v in blocks.items()}


def _skip_reason(block: str) -> str:
    # gtest prints "<file>:<line>: Skipped" and then the message given to GTEST_SKIP().
    lines = block.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith(": Skipped"):
            msg = [x for x in lines[i + 1:] if not _MARK.match(x)]
            return " ".join(x.strip() for x in msg if x.strip()) or "skipped by GTEST_SKIP()"
    return "skipped by GTEST_SKIP()"


def _outcomes_from_json(path: Path, blocks: dict) -> dict:
    data = json.loads(path.read_text())
    outcomes = {}
    for suite in data.get("testsuites", []):
        for case in suite.get("testsuite", []):
            name = f"{case.get('classname', suite.get('name'))}.{case['name']}"
            failures = [f.get("failure", "") for f in case.get("failures", [])]
            if failures:
                outcomes[name] = Outcome("failed", "\n\n".join(failures))
            elif case.get("result") == "SKIPPED":
                reasons = [s.get("message", "") for s in case.get("skipped", []) if s.get("message")]
                reason = " ".join(reasons) or _skip_reason(blocks.get(name, ""))
                outcomes[name] = Outcome("skipped", reason)
            elif case.get("status") == "RUN":
                outcomes[name] = Outcome("passed")
    return outcomes


def _outcomes_from_output(blocks: dict) -> dict:
    """Fallback when the binary died before writing its JSON: what its output shows."""
    outcomes = {}
    for name, block in blocks.items():
        last = block.splitlines()[-1] if block else ""
        m = _MARK.match(last)
        if not m or m.group(2) != name:
            continue  # never finished
        if m.group(1) == "OK":
            outcomes[name] = Outcome("passed")
        elif m.group(1) == "SKIPPED":
            outcomes[name] = Outcome("skipped", _skip_reason(block))
        else:
            outcomes[name] = Outcome("failed", block)
    return outcomes


@pytest.fixture(scope="session")
def gtest_run(request, tmp_path_factory):
    prepared = _prepare()
    if prepared.error:
        return None
    selected = sorted({item.callspec.params["gtest_case"] for item in request.session.items
                       if hasattr(item, "callspec") and "gtest_case" in item.callspec.params})
    json_path = tmp_path_factory.mktemp("gtest") / "results.json"
    cmd = [str(prepared.binary), f"--gtest_output=json:{json_path}", "--gtest_color=no"]
    if selected and len(selected) < len(prepared.cases) and not any(
            set(name) & set("*?:-") for name in selected):
        cmd.append("--gtest_filter=" + ":".join(selected))
    timeout = float(os.environ.get("KVCACHE_EXT_GTEST_TIMEOUT", "1800"))
    note = ""
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", timeout=timeout)
        output, returncode = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        returncode, note = -1, f"the gtest binary was killed after {timeout:.0f} s"
    blocks = _blocks(output)
    if json_path.exists():
        outcomes = _outcomes_from_json(json_path, blocks)
    else:
        outcomes = _outcomes_from_output(blocks)
        unfinished = [n for n in blocks if n not in outcomes]
        if not note:
            note = f"the gtest binary exited with status {returncode} without writing its results"
        if unfinished:
            note += f"; it died while running {unfinished[-1]}"
    return Run(outcomes, returncode, output, note)


def test_gtest(gtest_case, gtest_run):
    prepared = _prepare()
    if prepared.error:
        pytest.fail(f"the C++ kernel tests could not be built or listed:\n{prepared.error}",
                    pytrace=False)
    outcome = gtest_run.outcomes.get(gtest_case)
    if outcome is None:
        block = _blocks(gtest_run.output).get(gtest_case)
        detail = block if block is not None else _tail(gtest_run.output, 60)
        why = gtest_run.note or f"it did not run (exit status {gtest_run.returncode})"
        pytest.fail(f"gtest case {gtest_case} has no result: {why}.\n{detail}", pytrace=False)
    if outcome.status == "skipped":
        pytest.skip(f"gtest skipped {gtest_case}: {outcome.message}")
    if outcome.status == "failed":
        pytest.fail(f"gtest case {gtest_case} failed:\n{outcome.message}", pytrace=False)
