"""How far a mean over prompts may be from the mean over all prompts a task could draw: the
standard error of one task's mean, and of a plain mean of such means (RULER's average over its
tasks). A table reads ``62.0 ± 4.1``: the mean and its standard error (docs/evaluation.md says
how to read it as an interval)."""
from __future__ import annotations

import math
import statistics


def standard_error(values: list[float]) -> float | None:
    """The standard error of the mean of ``values``: their sample standard deviation (n - 1)
    over sqrt(n); None for fewer than two values, which give no estimate of the spread.
    Equal values give exactly 0 (``statistics`` sums them exactly)."""
    if len(values) < 2:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def mean_of_means_error(errors: list[float | None]) -> float | None:
    """The standard error of the plain mean of independent means with standard errors ``errors``:
    sqrt(sum of their squares) / their count. None when any of them is None (a mean of one prompt
    has no spread, so neither has the average it enters)."""
    if not errors or any(e is None for e in errors):
        return None
    return math.sqrt(sum(e * e for e in errors)) / len(errors)
