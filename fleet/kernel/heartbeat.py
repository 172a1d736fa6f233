"""What a step knows of its attempt, and the heartbeats of long steps (decision 0053).

Inside a step function (async, or sync in its thread) ``current_attempt()`` is
the attempt number (1 first), ``last_heartbeat()`` the details the last earlier
attempt recorded with ``heartbeat(details)`` (None if none did), and
``heartbeat()`` says the step is alive. Outside a step each raises a
``ValidationError``.

``ctx.step(..., heartbeat=timedelta)`` makes the heartbeat a deadline: a
``HeartbeatWatch`` on the run's loop checks every third of it that the step
beat within it, and times the attempt out otherwise (``StepTimeoutError``,
kind ``heartbeat``: the retry policy decides). While such a step runs, the
run's lease is held to the heartbeat timeout (at most the runtime's
``lease_ms``; ``Renewal.narrow``), so when the worker dies the lease lapses
that soon and the recovery sweeper re-drives the execution: the step runs
again well before a whole lease would have passed.

Details are recorded as ``STEP_HEARTBEAT`` events, kernel-written and only when
the step gave new ones: the first at the next check, then at most every 0.8 of
the heartbeat timeout (Temporal's throttle, at most 60 s; temporalio/sdk-java#906),
and the newest unwritten ones before a failed attempt's ``STEP_FAILED``. A
liveness beat (``heartbeat()`` without details) writes nothing: the lease's
renewal is what a dead worker stops. A step without ``heartbeat=`` may call
``heartbeat(details)`` too; its details are recorded only when an attempt fails.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from fleet.kernel.errors import PayloadTooLargeError, RunAborted, ValidationError
from fleet.kernel.events import EventType, dumps, ensure_json
from fleet.kernel.flow_run import FlowRun

# The JSON text of one heartbeat's details: progress markers, not data.
DETAILS_MAX_BYTES = 64 * 1024
# Details are written at most every THROTTLE of the heartbeat timeout, and at
# least this often when new ones keep coming.
THROTTLE = 0.8
THROTTLE_MAX_S = 60.0


class StepAttempt:
    """One live attempt of one step, as its function sees it (``current_attempt``...).

    ``heartbeat`` may be called from the step's thread: it only assigns
    attributes, which the loop reads (``HeartbeatWatch``).
    """

    __slots__ = ("attempt", "beat_at", "details", "ended", "last", "step_id", "written")

    def __init__(self, step_id: str, attempt: int, last: Any) -> None:
        self.step_id = step_id
        self.attempt = attempt
        self.last = last  # what the earlier attempts recorded (the frame's ``heartbeat``)
        # When it last beat (time.monotonic()); set by the watch when it starts.
        self.beat_at = 0.0
        # The newest details, boxed: a new box for every heartbeat that gave some.
        self.details: tuple[Any] | None = None
        self.written: tuple[Any] | None = None  # the box last committed
        self.ended = False

    def unwritten(self) -> tuple[Any] | None:
        """The newest details, if they were not committed yet."""
        box = self.details
        return None if box is None or box is self.written else box


# The attempt whose function runs in this context: set around it by
# ``step_controls.call_step`` (a thread gets a copy of the context).
CURRENT: ContextVar[StepAttempt | None] = ContextVar("fleet_step_attempt", default=None)


def _current(what: str) -> StepAttempt:
    attempt = CURRENT.get()
    if attempt is None:
        raise ValidationError(
            f"fleet.{what}() is called inside a step's function (the function ctx.step "
            "runs, or a task it starts); here no step is running (the flow's body, or a "
            "thread the step started itself: pass the value on to it)", field=what)
    return attempt


def current_attempt() -> int:
    """The number of the step attempt running this code: 1 first, 2 for the first retry.

    A re-run after a crash counts as an attempt too (the step was in doubt).
    """
    return _current("current_attempt").attempt


def last_heartbeat() -> Any:
    """The details the last earlier attempt of this step recorded with ``heartbeat``
    (None on the first attempt, or when none recorded any): where a retry resumes."""
    last = _current("last_heartbeat").last
    if last is None or isinstance(last, (bool, int, float, str)):
        return last
    return json.loads(dumps(last))  # the step's own copy: the state keeps the recorded one


def heartbeat(details: Any = None) -> None:
    """Say the running step is alive; with ``details`` (JSON), record its progress.

    With ``ctx.step(..., heartbeat=timedelta)`` a step silent for longer than
    that is timed out and retried, and a worker that dies is noticed that soon.
    The retry reads the last recorded details with ``last_heartbeat()``.

    Raises:
        ValidationError: outside a step; details that are not JSON
            (``NotSerializableError``) or over 64 KiB (``PayloadTooLargeError``).
        asyncio.CancelledError: the attempt was abandoned (its timeout passed or
            its run was cancelled): stop its work.
    """
    attempt = _current("heartbeat")
    if attempt.ended:
        raise asyncio.CancelledError(
            f"step {attempt.step_id!r} attempt {attempt.attempt} was abandoned (timed out "
            "or cancelled): what it does now is never recorded; stop")
    if details is not None:
        recorded = ensure_json(details, "heartbeat details")
        size = len(dumps(recorded).encode())
        if size > DETAILS_MAX_BYTES:
            raise PayloadTooLargeError(
                f"heartbeat details of {size} bytes are over {DETAILS_MAX_BYTES}: record "
                "where the step is (a cursor, a count), not its data", field="details")
        attempt.details = (recorded,)
    attempt.beat_at = time.monotonic()


def commit_details(run: FlowRun, attempt: StepAttempt, box: tuple[Any]) -> int | None:
    """Commit ``box``'s details as ``STEP_HEARTBEAT``; its sequence (None: the journal
    has failed, the run ends on its own)."""
    try:
        event = run.journal.commit(EventType.STEP_HEARTBEAT,
                                   {"stepId": attempt.step_id, "attempt": attempt.attempt,
                                    "details": box[0]})
    except RunAborted:
        return None
    attempt.written = box
    return event.sequence


def record_unwritten(run: FlowRun, attempt: StepAttempt) -> None:
    """A failed attempt's newest details, committed before its ``STEP_FAILED`` (one write)."""
    box = attempt.unwritten()
    if box is not None:
        commit_details(run, attempt, box)


class HeartbeatWatch:
    """The loop's side of a step with ``heartbeat=``: the deadline, the writes, the lease.

    Args:
        run: The run the step belongs to.
        attempt: The attempt its function beats on.
        heartbeat_s: The heartbeat timeout, in seconds.
        on_late: Called (once, on the loop) when the step stayed silent for longer.
    """

    __slots__ = ("_attempt", "_handle", "_heartbeat_s", "_last_write", "_lease_ms", "_loop",
                 "_on_late", "_renewal", "_run", "_throttle_s", "_writes", "late")

    def __init__(self, run: FlowRun, attempt: StepAttempt, heartbeat_s: float,
                 on_late: Callable[[], None]) -> None:
        self._run = run
        self._attempt = attempt
        self._heartbeat_s = heartbeat_s
        self._throttle_s = min(THROTTLE * heartbeat_s, THROTTLE_MAX_S)
        self._on_late = on_late
        self._last_write = float("-inf")
        self._writes: set[asyncio.Task[None]] = set()
        self.late = False
        self._loop = asyncio.get_running_loop()
        attempt.beat_at = time.monotonic()  # the first beat is due within the timeout
        lease = run.journal.lease
        self._renewal = None if lease is None else lease.renewal
        self._lease_ms = max(1, round(heartbeat_s * 1000))
        if self._renewal is not None:
            self._renewal.narrow(self._lease_ms)
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(heartbeat_s / 3,
                                                                         self._tick)

    def _tick(self) -> None:
        if self._handle is None:
            return
        now = time.monotonic()
        attempt = self._attempt
        if now - attempt.beat_at > self._heartbeat_s:
            self._handle = None
            self.late = True
            self._on_late()
            return
        box = attempt.unwritten()
        if box is not None and now - self._last_write >= self._throttle_s:
            self._write(box, now)
        self._handle = self._loop.call_later(self._heartbeat_s / 3, self._tick)

    def _write(self, box: tuple[Any], now: float) -> None:
        sequence = commit_details(self._run, self._attempt, box)
        if sequence is None:
            return
        self._last_write = now
        # Durable now, not at the step's end: a worker that dies meanwhile leaves
        # these details to the retry. The journal serialises it with the run's writes.
        task = self._loop.create_task(self._run.journal.barrier(upto=sequence))
        self._writes.add(task)
        task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task[None]) -> None:
        self._writes.discard(task)
        if not task.cancelled():
            task.exception()  # a failed write latched the journal: the run ends on its own

    def stop(self) -> None:
        """The attempt ended: no more checks; the lease goes back to its own length."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._renewal is not None:
            self._renewal.widen(self._lease_ms)
            self._renewal = None


__all__ = ["CURRENT", "DETAILS_MAX_BYTES", "HeartbeatWatch", "StepAttempt", "commit_details",
           "current_attempt", "heartbeat", "last_heartbeat", "record_unwritten"]
