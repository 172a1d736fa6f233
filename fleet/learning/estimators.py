"""The arithmetic every estimator shares: an estimate, its standard error and its interval.

Each estimator of ``evaluate_policy`` is a smooth function ``f`` of the means
``m`` of a few per-unit columns (a unit is a decision, or a trajectory for
PDIS): IPS is ``m(w*r)``, SNIPS ``m(w*r) / m(w)``, DR ``m(v + w*(r - q))``, and
so on (``fleet.learning.evaluation`` builds the columns). One implementation
then serves them all:

- the value is ``f(m)``, each mean summed with ``math.fsum``;
- the standard error comes from the influence function (the delta method):
  unit ``i`` has influence ``IF_i = grad f(m) . (c_i - m)``, and
  ``std_error = sqrt(sum(IF_i ** 2)) / n``. For SNIPS this is the usual
  ``sqrt(sum((w * (r - snips)) ** 2)) / sum(w)``;
- the normal interval is ``value -/+ z * std_error``;
- the bootstrap interval resamples the units ``resamples`` times with
  replacement (``random.Random(seed)``: a seed repeats it), recomputes ``f``
  each time, and takes the percentiles ``(1 - c) / 2`` and ``(1 + c) / 2``.
  A resample's reward model is the one already fitted: the bootstrap, like the
  influence function, does not count the model's own variance.

Plain Python: the sums are O(units) and the bootstrap O(resamples x units)
(200 resamples of 300 units take about 6 ms); decision 0040 says why not numpy.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from fleet.kernel.errors import ConfigurationError, EvaluationError, TooFewSamplesError

#: A percentile interval needs this many resamples beyond each of its ends (so 200
#: for a 95% interval, 100 for 90%).
TAIL_RESAMPLES = 5
#: Fewer units than this have too few distinct resamples for percentiles to mean much.
MIN_BOOTSTRAP_UNITS = 10
#: A standard error needs two units at least (one unit's spread is no spread).
MIN_INTERVAL_UNITS = 2

Means = Sequence[float]


@dataclass(frozen=True, slots=True)
class Form:
    """An estimator as a function of column means and its gradient."""

    value: Callable[[Means], float]
    gradient: Callable[[Means], list[float]]


@dataclass(frozen=True, slots=True)
class Estimate:
    """A value, its influence-function standard error and the interval asked for."""

    value: float
    std_error: float
    interval: tuple[float, float]
    method: str  # "normal" or "bootstrap"


def mean_form() -> Form:
    """``m0``: IPS, DR, PDIS."""
    return Form(lambda m: m[0], lambda m: [1.0])


def ratio_form() -> Form:
    """``m0 / m1``: SNIPS."""
    return Form(lambda m: m[0] / m[1], lambda m: [1.0 / m[1], -m[0] / (m[1] * m[1])])


def offset_ratio_form() -> Form:
    """``m0 + m1 / m2``: self-normalised DR (the model's value plus the normalised
    correction)."""
    return Form(lambda m: m[0] + m[1] / m[2],
                lambda m: [1.0, 1.0 / m[2], -m[1] / (m[2] * m[2])])


def ratio_sum_form(steps: int) -> Form:
    """``sum_t m(2t) / m(2t+1)``: self-normalised PDIS, one ratio per decision step; a
    step no trajectory reaches with a weight above 0 adds nothing."""
    def value(m: Means) -> float:
        return math.fsum(m[2 * t] / m[2 * t + 1] for t in range(steps) if m[2 * t + 1] > 0.0)

    def gradient(m: Means) -> list[float]:
        out: list[float] = []
        for t in range(steps):
            den = m[2 * t + 1]
            out += [1.0 / den, -m[2 * t] / (den * den)] if den > 0.0 else [0.0, 0.0]
        return out

    return Form(value, gradient)


def estimate(columns: Sequence[Sequence[float]], form: Form, *, confidence: float,
             bootstrap: int = 0, seed: int | None = None) -> Estimate:
    """The value of ``form`` over the units' ``columns``, its standard error and interval.

    Raises:
        TooFewSamplesError: fewer units than an interval needs.
        EvaluationError: the value or its standard error is not finite.
    """
    n = len(columns[0])
    if n < MIN_INTERVAL_UNITS:
        raise TooFewSamplesError(
            f"{n} unit(s) evaluated: a standard error needs at least {MIN_INTERVAL_UNITS}; "
            "collect more decisions")
    means = [math.fsum(col) / n for col in columns]
    value = form.value(means)
    grad = form.gradient(means)
    influence = [math.fsum(g * (col[i] - m) for g, col, m in zip(grad, columns, means,
                                                                  strict=True))
                 for i in range(n)]
    std_error = math.sqrt(math.fsum(x * x for x in influence)) / n
    if not (math.isfinite(value) and math.isfinite(std_error)):
        raise EvaluationError(
            f"the estimate is {value!r} with standard error {std_error!r}: a reward or a "
            "weight is too large (record_outcome bounds scores at 1e9; check custom "
            "rewards and tiny propensities)")
    if bootstrap:
        low, high = percentile_interval(columns, form, confidence=confidence,
                                        resamples=bootstrap, seed=seed)
        return Estimate(value, std_error, (low, high), "bootstrap")
    half = NormalDist().inv_cdf(0.5 + confidence / 2.0) * std_error
    return Estimate(value, std_error, (value - half, value + half), "normal")


def check_resamples(resamples: int, confidence: float) -> None:
    """Refuse a bootstrap too small for its interval (before any data is read).

    Raises:
        ConfigurationError: ``resamples`` is not an int, or leaves fewer than
            ``TAIL_RESAMPLES`` resamples beyond each end of the interval.
    """
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 0:
        raise ConfigurationError(f"bootstrap must be an int >= 0 (0: no bootstrap), got "
                                 f"{resamples!r}")
    if resamples == 0:
        return
    need = math.ceil(2 * TAIL_RESAMPLES / (1.0 - confidence) - 1e-9)
    if resamples < need:
        raise ConfigurationError(
            f"bootstrap={resamples} leaves {resamples * (1.0 - confidence) / 2:.3g} "
            f"resamples beyond each end of a {confidence:.0%} interval; ask for at least "
            f"{need}")


def percentile_interval(columns: Sequence[Sequence[float]], form: Form, *,
                        confidence: float, resamples: int,
                        seed: int | None) -> tuple[float, float]:
    """The bootstrap percentile interval of ``form`` over the units' ``columns``.

    Raises:
        TooFewSamplesError: fewer than ``MIN_BOOTSTRAP_UNITS`` units, or too many
            resamples whose value is undefined (every weight 0).
    """
    n = len(columns[0])
    if n < MIN_BOOTSTRAP_UNITS:
        raise TooFewSamplesError(
            f"{n} unit(s) evaluated: a bootstrap needs at least {MIN_BOOTSTRAP_UNITS}; use "
            "the normal interval (bootstrap=0) or collect more decisions")
    rng = random.Random(seed)
    rows = list(zip(*columns, strict=True))
    values: list[float] = []
    for _ in range(resamples):
        means = [sum(col) / n for col in zip(*rng.choices(rows, k=n), strict=True)]
        try:
            value = form.value(means)
        except ZeroDivisionError:  # every resampled weight 0: no estimate this time
            continue
        if math.isfinite(value):
            values.append(value)
    lost = resamples - len(values)
    if lost > resamples * (1.0 - confidence) / 2.0:
        raise TooFewSamplesError(
            f"{lost} of {resamples} resamples had no estimate (every weight 0): the "
            "target policy is too rarely on the logged choices for a bootstrap")
    values.sort()
    return quantile(values, (1.0 - confidence) / 2.0), quantile(values, (1.0 + confidence) / 2.0)


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linearly interpolated (numpy's default)."""
    pos = q * (len(ordered) - 1)
    below = math.floor(pos)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (pos - below)
