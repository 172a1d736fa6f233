"""A schedule's settings and its ticks (``Runtime.schedule``; decision 0058).

``ScheduleSpec`` holds what ``runtime.schedule`` was given, checked before
anything is written (``ValidationError`` naming the field in its message and in
``details["field"]``: ``schedule_id``, ``cron``, ``every``, ``timezone``,
``overlap``, ``catchup``), and its log form (the schedule flow's input). Its ticks:

- ``cron``: a 5-field expression (minute hour day-of-month month day-of-week),
  parsed and evaluated by cronsim in ``timezone`` with Debian cron's rules for
  daylight saving time: a time the clocks skip runs at the jump, a time they
  repeat runs once;
- ``every``: the multiples of the interval since the Unix epoch (UTC), whole
  seconds: ``every=timedelta(hours=1)`` ticks on the hour whenever the schedule
  was made, so a schedule made again names the same ticks.

``plan`` says which ticks that fell due since the last one run when the schedule
wakes (the catch-up rule) and how many were missed. ``tick_id`` and
``scheduled_at`` are the two directions of a tick's run id ``<schedule
id>@<tick in ISO 8601 UTC>`` (``2025-06-01T03:00:00Z``; milliseconds only when
not zero), a form only a schedule may create (``fleet.kernel.ids``).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from fleet.kernel.errors import ValidationError
from fleet.kernel.fold import ExecutionState
from fleet.kernel.ids import TICK_SUFFIX
from fleet.kernel.values import MAX_TIME_MS, datetime_from_ms, printable

#: The reserved flow every schedule runs as, and the prefix of its executions' ids:
#: ``__fleet_schedule__:<schedule id>/<generation>`` (``~<n>`` after each continue_as_new).
SCHEDULE_FLOW_ID = "__fleet_schedule"
SCHEDULE_PREFIX = "__fleet_schedule__:"
OVERLAPS = ("skip", "buffer_one", "allow")
#: A tick fired this late is still on time (the timer service's poll, a queued drive, a
#: drive the recovery sweeper re-sends): the latest due tick runs within this even when
#: ``catchup`` is 0; older ticks need ``catchup``.
LATE_GRACE_MS = 60_000
#: At most this many missed ticks run after one wake (the latest ones); the rest count
#: as missed.
MAX_CATCHUP_RUNS = 1_000
#: Cron ticks missed before the catch-up window are counted one by one up to this many
#: per wake (a minute's cron down for 69 days); past it the count is a lower bound.
MAX_COUNTED = 100_000
_MAX_EVERY_S = 10 * 366 * 86_400
_SCHEDULE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,200}\Z")


def field_error(field: str, message: str) -> ValidationError:
    """A ``ValidationError`` that names the argument it is about."""
    return ValidationError(f"{field}: {message}", field=field)


def check_schedule_id(schedule_id: Any) -> str:
    """A schedule id: 1-200 letters, digits or ``_.:-`` (so its run ids stay apart)."""
    if not isinstance(schedule_id, str) or not _SCHEDULE_ID.match(schedule_id):
        raise field_error("schedule_id", f"{printable(schedule_id, 60)} is not usable: use "
                          "1-200 letters, digits or _ . : -")
    return schedule_id


def _every_ms(every: Any) -> int:
    if not isinstance(every, timedelta):
        raise field_error("every", f"takes a timedelta, e.g. timedelta(minutes=5); got "
                          f"{type(every).__name__} {printable(every, 60)}")
    seconds = every.total_seconds()
    if seconds <= 0:
        raise field_error("every", f"must be a positive interval, got {every!r}")
    if every % timedelta(seconds=1) or seconds > _MAX_EVERY_S:
        raise field_error("every", f"must be a whole number of seconds from 1 s to 10 years, "
                          f"got {every!r}")
    return int(seconds) * 1000


def _catchup_ms(catchup: Any) -> int:
    if not isinstance(catchup, timedelta):
        raise field_error("catchup", f"takes a timedelta (timedelta(0): run no missed tick), "
                          f"got {type(catchup).__name__} {printable(catchup, 60)}")
    if catchup < timedelta(0) or catchup > timedelta(days=3660):
        raise field_error("catchup", f"must be from 0 to 10 years, got {catchup!r}")
    return catchup // timedelta(milliseconds=1)


def _zone(timezone: Any) -> ZoneInfo:
    if not isinstance(timezone, str) or not timezone:
        raise field_error("timezone", f"takes an IANA zone name such as 'Europe/Riga', got "
                          f"{printable(timezone, 60)}")
    try:
        return ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise field_error("timezone", f"{printable(timezone, 60)} is not a time zone this "
                          "machine knows (an IANA name such as 'Europe/Riga' or 'UTC'; "
                          "without system zone data install the tzdata package)") from exc


def _check_cron(cron: Any, zone: ZoneInfo) -> str:
    if not isinstance(cron, str):
        raise field_error("cron", f"takes a 5-field cron expression such as '0 3 * * *', "
                          f"got {type(cron).__name__}")
    fields = cron.split()
    if len(fields) != 5:
        raise field_error("cron", f"{printable(cron, 80)} has {len(fields)} fields; a "
                          "schedule takes the 5 of crontab: minute hour day-of-month month "
                          "day-of-week (e.g. '0 3 * * *')")
    try:
        found = next(CronSim(cron, datetime.now(zone)), None)
    except CronSimError as exc:
        raise field_error("cron", f"{printable(cron, 80)} is not a valid cron expression: "
                          f"{exc}") from exc
    if found is None:
        raise field_error("cron", f"{printable(cron, 80)} matches no time in the next 50 "
                          "years")
    return " ".join(fields)


@dataclass(frozen=True, slots=True)
class Plan:
    """What a wake at ``now`` does: the ticks to run (oldest first), the ticks missed
    (outside the catch-up window), and the latest tick due (the new last tick)."""

    run: list[int]
    missed: int
    latest: int | None


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """The settings of one schedule, checked (see the module)."""

    schedule_id: str
    flow_id: str
    input: Any
    cron: str | None
    every_ms: int | None
    timezone: str
    overlap: str
    catchup_ms: int

    @classmethod
    def build(cls, schedule_id: Any, flow_id: str, input: Any, *, cron: Any, every: Any,
              timezone: Any, overlap: Any, catchup: Any) -> ScheduleSpec:
        """Check every setting (``ValidationError`` naming the first bad one)."""
        check_schedule_id(schedule_id)
        if (cron is None) == (every is None):
            raise field_error("cron" if cron is not None else "every",
                              "give cron or every, not both" if cron is not None
                              else "give cron (an expression) or every (a timedelta)")
        zone = _zone(timezone)
        every_ms = None if every is None else _every_ms(every)
        if every_ms is not None and zone.key != "UTC":
            raise field_error("timezone", "every counts from the Unix epoch in UTC; a "
                              "timezone applies to cron only (e.g. cron='0 3 * * *', "
                              f"timezone={timezone!r})")
        if overlap not in OVERLAPS:
            raise field_error("overlap", f"must be one of {list(OVERLAPS)}, got "
                              f"{printable(overlap, 60)}")
        return cls(schedule_id, flow_id, input, None if cron is None else _check_cron(cron, zone),
                   every_ms, zone.key, str(overlap), _catchup_ms(catchup))

    # -- the log form (the schedule flow's input) -------------------------------------
    def to_log(self) -> dict[str, Any]:
        return {"id": self.schedule_id, "flow": self.flow_id, "input": self.input,
                "cron": self.cron, "everyMs": self.every_ms, "timezone": self.timezone,
                "overlap": self.overlap, "catchupMs": self.catchup_ms}

    @classmethod
    def from_log(cls, data: Any) -> ScheduleSpec:
        """The spec a schedule flow was started with, checked again."""
        if not isinstance(data, dict) or not isinstance(data.get("flow"), str):
            raise ValidationError(f"not a schedule's settings: {printable(data, 200)}")
        every = data.get("everyMs")
        catchup = data.get("catchupMs")
        if not (every is None or (isinstance(every, int) and not isinstance(every, bool))) \
                or not isinstance(catchup, int) or isinstance(catchup, bool):
            raise ValidationError(f"not a schedule's settings: {printable(data, 200)}")
        return cls.build(data.get("id"), data["flow"], data.get("input"),
                         cron=data.get("cron"),
                         every=None if every is None else timedelta(milliseconds=every),
                         timezone=data.get("timezone"), overlap=data.get("overlap"),
                         catchup=timedelta(milliseconds=catchup))

    def differences(self, other: ScheduleSpec) -> list[str]:
        """The settings (by argument name) in which ``other`` differs from this spec."""
        pairs = {"flow": (self.flow_id, other.flow_id), "input": (self.input, other.input),
                 "cron": (self.cron, other.cron), "every": (self.every_ms, other.every_ms),
                 "timezone": (self.timezone, other.timezone),
                 "overlap": (self.overlap, other.overlap),
                 "catchup": (self.catchup_ms, other.catchup_ms)}
        return [name for name, (a, b) in pairs.items() if a != b]

    @property
    def every(self) -> timedelta | None:
        return None if self.every_ms is None else timedelta(milliseconds=self.every_ms)

    @property
    def catchup(self) -> timedelta:
        return timedelta(milliseconds=self.catchup_ms)

    # -- ticks --------------------------------------------------------------------------
    def _cron_after(self, after_ms: int, *, reverse: bool = False) -> Iterator[int]:
        """The cron's ticks after ``after_ms`` (before it, with ``reverse``), in ms."""
        assert self.cron is not None
        start = datetime.fromtimestamp(after_ms / 1000, ZoneInfo(self.timezone))
        for when in CronSim(self.cron, start, reverse=reverse):
            tick = round(when.timestamp() * 1000)
            if (tick < after_ms) if reverse else (tick > after_ms):
                yield tick

    def next_after(self, after_ms: int) -> int | None:
        """The first tick after ``after_ms``; None past year 9999 (or when cron finds none)."""
        if self.every_ms is not None:
            tick = (after_ms // self.every_ms + 1) * self.every_ms
        else:
            tick = next(self._cron_after(after_ms), MAX_TIME_MS + 1)
        return tick if tick <= MAX_TIME_MS else None

    def ticks(self, start_ms: int, end_ms: int, limit: int) -> list[int]:
        """The ticks in ``[start_ms, end_ms]``, oldest first; at most ``limit`` + 1 (so a
        caller can tell that the window holds more than ``limit``)."""
        out: list[int] = []
        tick = self.next_after(start_ms - 1)
        while tick is not None and tick <= end_ms and len(out) <= limit:
            out.append(tick)
            tick = self.next_after(tick)
        return out

    def due(self, after_ms: int, upto_ms: int) -> tuple[int, int | None, int | None]:
        """How many ticks fall in ``(after_ms, upto_ms]``, the first and the latest (cron's
        counted up to ``MAX_COUNTED``)."""
        first = self.next_after(after_ms)
        if first is None or first > upto_ms:
            return 0, None, None
        if self.every_ms is not None:
            latest = upto_ms // self.every_ms * self.every_ms
            return (latest - first) // self.every_ms + 1, first, latest
        latest = next(self._cron_after(upto_ms + 1, reverse=True), first)
        count = 0
        for tick in self._cron_after(after_ms):
            if tick > upto_ms or count >= MAX_COUNTED:
                break
            count += 1
        return count, first, latest

    def plan(self, last_ms: int, now_ms: int) -> Plan:
        """Which ticks in ``(last_ms, now_ms]`` run now (see ``LATE_GRACE_MS``): those within
        ``catchup`` of ``now_ms``, else the latest alone if it is late by less than the
        grace; the others are missed."""
        window = max(last_ms, now_ms - self.catchup_ms)  # ticks after this may run
        if self.every_ms is not None:
            every = self.every_ms
            first, last = last_ms // every + 1, now_ms // every
            if last < first:
                return Plan([], 0, None)
            latest = last * every
            from_k = max(first, window // every + 1)
            older = max(0, min(from_k, last + 1) - first)
            runnable: list[int] = [k * every for k in range(max(from_k, last + 1 -
                                                                   MAX_CATCHUP_RUNS),
                                                              last + 1)]
            dropped = max(0, last + 1 - from_k - len(runnable))
        else:
            found = next(self._cron_after(now_ms + 1, reverse=True), None)
            if found is None or found <= last_ms:
                return Plan([], 0, None)
            latest = found
            older = 0
            for tick in self._cron_after(last_ms):
                if tick > window or older >= MAX_COUNTED:
                    break
                older += 1
            kept: deque[int] = deque(maxlen=MAX_CATCHUP_RUNS)
            seen = 0
            for tick in self._cron_after(window):
                if tick > now_ms:
                    break
                kept.append(tick)
                seen += 1
            runnable, dropped = list(kept), seen - len(kept)
        if not runnable and now_ms - latest <= LATE_GRACE_MS:
            runnable, older = [latest], max(0, older - 1)
        return Plan(runnable, older + dropped, latest)


def iso_utc(ms: int) -> str:
    """``ms`` as ISO 8601 UTC with a ``Z``: seconds, and milliseconds when not zero."""
    text = datetime_from_ms(ms).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{ms % 1000:03d}Z" if ms % 1000 else f"{text}Z"


def tick_id(schedule_id: str, tick_ms: int) -> str:
    """The execution id of the run a schedule starts at ``tick_ms``."""
    return f"{schedule_id}@{iso_utc(tick_ms)}"


def scheduled_at(state: ExecutionState) -> datetime | None:
    """``ctx.scheduled_at``: the tick of a run a schedule started (its id says it, and its
    recorded parent, which only the kernel writes, is a schedule); None otherwise."""
    parent = str((state.parent or {}).get("executionId") or "")
    found = TICK_SUFFIX.search(state.execution_id)
    if not parent.startswith(SCHEDULE_PREFIX) or found is None:
        return None
    return datetime.fromisoformat(found.group(1)).astimezone(UTC)


__all__ = ["LATE_GRACE_MS", "MAX_CATCHUP_RUNS", "MAX_COUNTED", "OVERLAPS", "SCHEDULE_FLOW_ID",
           "SCHEDULE_PREFIX", "Plan", "ScheduleSpec", "check_schedule_id", "field_error",
           "iso_utc", "scheduled_at", "tick_id"]
