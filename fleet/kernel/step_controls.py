"""How one attempt of a step runs: in a thread or on the loop, within its limits.

``call_step`` runs the step's function for one attempt (``steps._run_live``
calls it between ``STEP_STARTED`` and the attempt's outcome):

- **Where.** A sync function runs in a thread (``step_threads``, decision 0054),
  so it never stalls the loop and every other run on it; ``blocking=False``
  runs it on the loop instead (for a function known to be quick: the thread hop
  costs ~20 us). An ``async def`` runs on the loop.
- **Its limits** (decision 0053). ``timeout``: start-to-close, per attempt; an
  async body is cancelled at the limit, a sync one is abandoned in its thread
  (its late result is dropped, never recorded). ``heartbeat``: the step must
  call ``fleet.heartbeat()`` at least that often (``HeartbeatWatch``). Either
  way the attempt fails with ``StepTimeoutError`` and the retry policy decides.
- **What it knows.** ``fleet.current_attempt()``, ``fleet.last_heartbeat()``
  and ``fleet.heartbeat()`` work inside the function (a context variable,
  copied into the thread).

Cancelling the awaiting task (a cancellation of the run, a worker cutting its
runs) propagates ``asyncio.CancelledError``: an async body is cancelled, a sync
one abandoned, and nothing of either is recorded.

``step_controls`` checks ``timeout``, ``heartbeat`` and ``blocking`` before
anything is written. They are ``ctx.step``'s own keywords, so they are never
passed to the function; a number is refused (only a ``timedelta``), so that
``ctx.step("get", requests.get, url, timeout=5)``, which once meant the
function's own timeout, fails loudly rather than silently become a step limit.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import FunctionType
from typing import Any

from fleet.kernel.errors import RunInterrupt, StepFailedError, StepTimeoutError, ValidationError
from fleet.kernel.flow_run import FlowRun
from fleet.kernel.heartbeat import CURRENT, HeartbeatWatch, StepAttempt, record_unwritten
from fleet.kernel.step_threads import run_in_thread
from fleet.kernel.values import printable

# A heartbeat timeout is also the lease of the run while the step runs: renewed
# every third of it, it must outlast a store round trip under load.
HEARTBEAT_MIN = timedelta(seconds=1)
# What a step returns most, never awaitable: no ABC check (inspect.isawaitable) for it.
_PLAIN = frozenset({type(None), bool, int, float, str, dict, list})
_CO_COROUTINE = inspect.CO_COROUTINE


@dataclass(frozen=True, slots=True)
class StepControls:
    """A step's own limits and where it runs (seconds; None: no limit)."""

    timeout: float | None = None
    heartbeat: float | None = None
    blocking: bool = True


ON_THE_LOOP = StepControls(blocking=False)


def _limit(value: Any, name: str, minimum: timedelta | None = None) -> float | None:
    if value is None:
        return None
    if not isinstance(value, timedelta):
        raise ValidationError(
            f"ctx.step's {name} is a datetime.timedelta (e.g. timedelta(seconds=30)), got "
            f"{value!r}; to pass {name}= to the step's function itself, bind it: "
            f"functools.partial(fn, {name}=...)", field=name)
    seconds = value.total_seconds()
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValidationError(f"ctx.step's {name} must be positive, got {value!r}", field=name)
    if minimum is not None and value < minimum:
        raise ValidationError(
            f"ctx.step's {name} must be at least {minimum} (the run's lease is held to it "
            f"while the step runs), got {value!r}", field=name)
    return seconds


def step_controls(timeout: Any, heartbeat: Any, blocking: Any) -> StepControls | None:
    """The checked controls of a ``ctx.step`` call; None for the defaults (the fast path).

    Raises:
        ValidationError: naming the field: a timeout or heartbeat that is not a
            positive ``timedelta`` (a heartbeat under ``HEARTBEAT_MIN``), a
            ``blocking`` that is not a bool.
    """
    if timeout is None and heartbeat is None:
        if blocking is True:
            return None
        if blocking is False:
            return ON_THE_LOOP  # no new object per step: the opt-out is for quick steps
    if not isinstance(blocking, bool):
        raise ValidationError(f"ctx.step's blocking is True or False, got {blocking!r}",
                              field="blocking")
    return StepControls(_limit(timeout, "timeout"),
                        _limit(heartbeat, "heartbeat", HEARTBEAT_MIN), blocking)


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is an ``async def`` (or a partial of one, or an object whose
    ``__call__`` is one): it runs on the loop. Anything else is taken as blocking."""
    if type(fn) is FunctionType:
        return bool(fn.__code__.co_flags & _CO_COROUTINE)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))  # noqa: B004 - a callable object's own method


async def call_step(run: FlowRun, step_id: str, attempt: int, fn: Callable[..., Any],
                    args: tuple[Any, ...], kwargs: dict[str, Any],
                    controls: StepControls | None) -> Any:
    """Run attempt ``attempt`` of step ``step_id``: ``fn(*args, **kwargs)``'s result.

    Raises what the function raised, ``StepTimeoutError`` when the attempt ran
    out of time, ``asyncio.CancelledError`` when the run is cancelled.
    """
    frame = run.state.frames.get(step_id)
    current = StepAttempt(step_id, attempt, None if frame is None else frame.heartbeat)
    token = CURRENT.set(current)
    try:
        if controls is None:
            # The common case, kept short (decision 0031): an async def on the loop,
            # anything else in a thread.
            if (fn.__code__.co_flags & _CO_COROUTINE if type(fn) is FunctionType
                    else is_async(fn)):
                result = fn(*args, **kwargs)
            else:
                result = await run_in_thread(fn, args, kwargs)
        elif controls.timeout is not None or controls.heartbeat is not None:
            return await _limited(run, current, fn, args, kwargs, controls)
        elif controls.blocking and not is_async(fn):
            result = await run_in_thread(fn, args, kwargs)
        else:
            result = fn(*args, **kwargs)
        if type(result) not in _PLAIN and inspect.isawaitable(result):
            result = await result
        return result
    except (RunInterrupt, asyncio.CancelledError):
        raise
    except Exception:
        # The details the step gave last, for the retry (one write with STEP_FAILED).
        record_unwritten(run, current)
        raise
    finally:
        current.ended = True
        CURRENT.reset(token)


async def _limited(run: FlowRun, current: StepAttempt, fn: Callable[..., Any],
                   args: tuple[Any, ...], kwargs: dict[str, Any], controls: StepControls) -> Any:
    """An attempt under ``asyncio.timeout``: the step's timeout, brought forward to now
    when its heartbeat is late."""
    watch: HeartbeatWatch | None = None
    limit = asyncio.timeout(controls.timeout)
    try:
        async with limit:
            if controls.heartbeat is not None:
                watch = HeartbeatWatch(run, current, controls.heartbeat,
                                       lambda: _bring_forward(limit))
            if controls.blocking and not is_async(fn):
                result = await run_in_thread(fn, args, kwargs)
            else:
                result = fn(*args, **kwargs)
            if type(result) not in _PLAIN and inspect.isawaitable(result):
                result = await result
    except TimeoutError as exc:
        if not limit.expired():
            raise  # the function's own TimeoutError: an ordinary failure
        raise _timed_out(current, controls, watch) from exc
    finally:
        if watch is not None:
            watch.stop()
    if limit.expired():
        # The body swallowed its cancellation and returned: the limit still holds
        # (as for a sync body, whose late result is dropped).
        raise _timed_out(current, controls, watch)
    return result


def _bring_forward(limit: asyncio.Timeout) -> None:
    """The heartbeat is late: the attempt's limit is now (unless it already passed)."""
    if not limit.expired():
        limit.reschedule(0)


def _timed_out(current: StepAttempt, controls: StepControls,
               watch: HeartbeatWatch | None) -> StepTimeoutError:
    where = f"step {current.step_id!r} (attempt {current.attempt})"
    if watch is not None and watch.late:
        assert controls.heartbeat is not None
        limit = timedelta(seconds=controls.heartbeat)
        return StepTimeoutError(
            f"{where} sent no heartbeat for {limit} (its heartbeat timeout): call "
            "fleet.heartbeat() more often than that, or give it a longer heartbeat",
            step_id=current.step_id, error={}, kind="heartbeat")
    assert controls.timeout is not None
    return StepTimeoutError(
        f"{where} did not finish within {timedelta(seconds=controls.timeout)} (its timeout); "
        "give it a longer timeout, or make the step faster", step_id=current.step_id,
        error={}, kind="timeout")


def attempt_error(exc: BaseException, retryable: bool) -> dict[str, Any]:
    """The recorded error of a failed attempt (``STEP_FAILED``'s ``error``)."""
    error: dict[str, Any] = {"type": type(exc).__name__, "message": printable(str(exc), 4000),
                             "retryable": retryable}
    if isinstance(exc, StepTimeoutError):
        error["code"] = exc.code
        error["kind"] = exc.kind
    return error


def step_failed(step_id: str, error: dict[str, Any]) -> StepFailedError:
    """What the flow gets for a step that failed for good with ``error`` (live or replayed):
    a ``StepTimeoutError`` when its last attempt timed out, else a ``StepFailedError``."""
    message = f"step {step_id!r} failed: {error.get('message', '')}"
    if error.get("code") == StepTimeoutError.code:
        return StepTimeoutError(message, step_id=step_id, error=error,
                                kind=str(error.get("kind") or "timeout"))
    return StepFailedError(message, step_id=step_id, error=error)


__all__ = ["HEARTBEAT_MIN", "ON_THE_LOOP", "StepControls", "attempt_error", "call_step", "is_async",
           "step_controls", "step_failed"]
