"""``RetryPolicy``: how a failing step is retried, checked when it is built.

Attempt ``n`` that failed is retried after ``delay(n)``: ``initial_interval *
backoff ** (n - 1)``, at most ``max_interval``, then moved by up to ``jitter`` of
itself either way (``jitter=0.5``: anywhere in 50-150 % of it), so many runs that
failed together do not retry together. The delay is recorded as the failure's
``retryAt``, so a replay waits for the time the live run chose.

Which errors are retried (``retries``): never a ``StepFailure`` the step raised
(a typed failure, final by definition) nor a ``StepFailedError`` it let through;
never one of ``non_retryable``; when ``retry_on`` is given, only those. A
``StepTimeoutError`` (an attempt over its ``timeout`` or its ``heartbeat``) is an
ordinary error here: retried unless a policy says otherwise. A policy that
contradicts itself (a ``retry_on`` entry that ``non_retryable`` covers, so it
could never be retried) is refused when it is built, as is every number out of
range: a ``ValidationError`` naming the field (decision 0053).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from fleet.kernel.errors import StepFailedError, StepFailure, StepTimeoutError, ValidationError

ErrorTypes = tuple[type[BaseException], ...]


def _refuse(name: str, problem: str) -> ValidationError:
    return ValidationError(f"RetryPolicy {name}: {problem}", field=name)


def _seconds(name: str, value: Any) -> float:
    """A non-negative, finite number of seconds from a number or a ``timedelta``."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise _refuse(name, f"a timedelta or a number of seconds, got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise _refuse(name, f"must be finite and not negative, got {value!r}")
    return seconds


def _error_types(name: str, value: Any) -> ErrorTypes:
    """A tuple of exception classes (one class alone is taken as a tuple of one)."""
    items = (value,) if isinstance(value, type) else value
    if not isinstance(items, (tuple, list, frozenset, set)) or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in items):
        raise _refuse(name, f"a tuple of exception classes, e.g. (ValueError, KeyError); "
                            f"got {value!r}")
    return tuple(items)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a failing step is retried; every attempt and its ``retryAt`` is logged.

    Args:
        max_attempts: attempts in all, the first included (1: never retried).
        initial_interval: the delay after the first failure (seconds or a ``timedelta``).
        backoff: each later delay is this many times the one before (at least 1).
        max_interval: no delay is longer (seconds or a ``timedelta``), before jitter.
        non_retryable: errors (and their subclasses) that fail the step at once.
        retry_on: when given, only these errors (and their subclasses) are retried.
        jitter: a fraction of each delay in [0, 1]: the delay is drawn uniformly
            from ``delay * (1 - jitter)`` to ``delay * (1 + jitter)``.
    """

    max_attempts: int = 3
    initial_interval: float | timedelta = 0.1
    backoff: float = 2.0
    max_interval: float | timedelta = 60.0
    non_retryable: ErrorTypes = ()
    retry_on: ErrorTypes = ()
    jitter: float = 0.0
    _initial: float = field(init=False, repr=False, compare=False)
    _cap: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise _refuse("max_attempts", f"an int of at least 1, got {attempts!r}")
        initial = _seconds("initial_interval", self.initial_interval)
        cap = _seconds("max_interval", self.max_interval)
        backoff = self.backoff
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) \
                or not math.isfinite(backoff) or backoff < 1:
            raise _refuse("backoff", f"a finite number of at least 1, got {backoff!r}")
        jitter = self.jitter
        if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) \
                or not 0 <= jitter <= 1:
            raise _refuse("jitter", f"a fraction of the delay in [0, 1] (0.5: +/-50 %), "
                                    f"got {jitter!r}")
        never = _error_types("non_retryable", self.non_retryable)
        only = _error_types("retry_on", self.retry_on)
        for wanted in only:
            if issubclass(wanted, (StepFailure, StepFailedError)) \
                    and not issubclass(wanted, StepTimeoutError):
                raise _refuse("retry_on", f"{wanted.__name__} is never retried (a typed "
                                          "failure is final); leave it out")
            covering = [t for t in never if issubclass(wanted, t)]
            if covering:
                raise _refuse("retry_on", f"{wanted.__name__} is also non_retryable (as "
                                          f"{covering[0].__name__}), so it could never be "
                                          "retried; name it in one of the two")
        object.__setattr__(self, "non_retryable", never)
        object.__setattr__(self, "retry_on", only)
        object.__setattr__(self, "_initial", initial)
        object.__setattr__(self, "_cap", cap)

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (jitter drawn anew each call)."""
        base = min(self._cap, self._initial * self.backoff ** (attempt - 1))
        if self.jitter:
            base *= 1 + self.jitter * (2 * random.random() - 1)
        return float(base)

    def retries(self, exc: BaseException) -> bool:
        """Whether an attempt that raised ``exc`` may be retried (attempts left aside)."""
        if isinstance(exc, StepFailure) or (
                isinstance(exc, StepFailedError) and not isinstance(exc, StepTimeoutError)):
            return False
        if self.non_retryable and isinstance(exc, self.non_retryable):
            return False
        return not self.retry_on or isinstance(exc, self.retry_on)


NO_RETRY = RetryPolicy(max_attempts=1)
# A step's policy when it names none: one frozen instance, not a new one per step.
DEFAULT_RETRY = RetryPolicy()

__all__ = ["DEFAULT_RETRY", "NO_RETRY", "RetryPolicy"]
