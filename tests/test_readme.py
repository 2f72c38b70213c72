"""The Python examples of README.md, docs/store.md, docs/kernels.md and docs/evaluation.md run as written.

Each ```python block runs verbatim, in a fresh namespace. The ```text block that follows it
(nothing but blank lines between) is what it prints to stdout, line for line and exactly; only
where a value is not fixed (a timing) may a line of it hold ``...``, which matches any text. A
block that prints must be followed by such a block, and one without it must print nothing, so
that every output a page shows is checked and no output goes unshown.

Each block runs with DeprecationWarning and FutureWarning raised as errors, and fails when
transformers logs a deprecation (its once-only warnings are reset first, so one logged by an
earlier test is logged again): no example prints a deprecation warning on the installed
transformers (5.24 renamed ``past_key_values`` to ``cache``; the examples pass the cache through
``kvcache_ext.with_cache``).

Cheap: an example that calls ``kvcache_ext.hf.models.load_model()`` gets the default model the
test session has already loaded (tests/conftest.py), and the model is unpatched after it even
when the example fails.
"""
import contextlib
import io
import logging
import os
import re
import warnings

import pytest
import transformers

import kvcache_ext
from kvcache_ext.hf import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "docs/store.md", "docs/kernels.md", "docs/evaluation.md"]
BLOCK = re.compile(r"```python\n(.*?)```(?:\s*```text\n(.*?)```)?", re.S)


def examples(page: str) -> list[tuple[str, str | None]]:
    """(code, expected output or None) of every python block of ``page``, in order."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return [(code, shown) for code, shown in BLOCK.findall(f.read())]


def matches(line: str, shown: str) -> bool:
    """``line`` equals ``shown``, each ``...`` of ``shown`` matching any text."""
    return re.fullmatch(".*".join(re.escape(part) for part in shown.split("...")), line) is not None


class DeprecationLog(logging.Handler):
    """Collects what transformers logs about deprecations."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        message = record.getMessage()
        if "deprecat" in message.lower():
            self.messages.append(message)


CASES = [(page, i) for page in PAGES for i in range(len(examples(page)))]


def test_every_page_has_examples():
    for page in PAGES:
        assert examples(page), f"{page} has no python example"


@pytest.mark.parametrize("page,index", CASES, ids=[f"{page}:{i}" for page, i in CASES])
def test_example_runs_and_prints_what_the_page_shows(page, index, request, monkeypatch):
    code, shown = examples(page)[index]
    if "load_model(" in code:
        loaded = request.getfixturevalue("default_model")
        real = models.load_model
        monkeypatch.setattr(models, "load_model",
                            lambda *args, **kwargs: loaded if not args and not kwargs else real(*args, **kwargs))
        request.addfinalizer(lambda: kvcache_ext.is_patched(loaded[0]) and kvcache_ext.unpatch(loaded[0]))

    transformers.utils.logging.warning_once.cache_clear()
    log = DeprecationLog()
    logger = transformers.utils.logging.get_logger("transformers")
    logger.addHandler(log)
    stdout = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(stdout):
            warnings.simplefilter("error", DeprecationWarning)
            warnings.simplefilter("error", FutureWarning)
            exec(compile(code, f"{page} example {index}", "exec"), {"__name__": "__readme__"})
    finally:
        logger.removeHandler(log)

    assert not log.messages, f"{page} example {index}: transformers logged {log.messages}"
    printed = stdout.getvalue().splitlines()
    if shown is None:
        assert not printed, f"{page} example {index} prints {printed} but the page shows no output"
        return
    expected = shown.splitlines()
    assert len(printed) == len(expected) and all(map(matches, printed, expected)), (
        f"{page} example {index} printed\n" + "\n".join(printed) + "\nbut the page shows\n" + shown)


def test_matches_reads_dots_as_any_text_and_nothing_else():
    assert matches("took 1.25 s", "took ... s")
    assert not matches("took 1.25 s", "took 1.2 s")
    assert not matches("[1, 2]", "[1, 2, 3]")
    assert matches("a.b", "a.b") and not matches("axb", "a.b")   # a dot is a dot


def test_a_deprecation_logged_by_transformers_is_caught():
    """The check above is not vacuous: transformers' own deprecation message is collected."""
    transformers.utils.logging.warning_once.cache_clear()
    log = DeprecationLog()
    logger = transformers.utils.logging.get_logger("transformers")
    logger.addHandler(log)
    try:
        transformers.utils.logging.get_logger("transformers.models").warning_once("`x` is deprecated.")
    finally:
        logger.removeHandler(log)
    assert log.messages == ["`x` is deprecated."]
