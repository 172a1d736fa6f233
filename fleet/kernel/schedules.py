"""Schedules, as callers see them: ``runtime.schedule`` and the calls around it.

A schedule is a run of the kernel's flow ``__fleet_schedule``
(``fleet.kernel.schedule_flow``) under ``__fleet_schedule__:<schedule id>/<n>``
(``n``: its generation, 1 unless an earlier one was deleted; ``~<k>`` after each
continue_as_new). These calls find its live run through the store's index (the
one run of that prefix that is running or parked: a continued or deleted run is
neither), never by walking the chain of continued runs, which grows without end.

- ``schedule`` checks every setting first (nothing written on a bad one), then
  starts the schedule's run, or finds it: the same settings again are accepted
  (idempotent), other settings refused with ``ConfigurationError`` naming them;
- ``pause_schedule``, ``resume_schedule``, ``trigger_schedule`` and
  ``backfill_schedule`` send it a message (``runtime.send``: authorised as
  ``send``, owner-only by default); ``delete_schedule`` ends its run at once
  (``runtime.cancel(force=True)``, authorised as ``cancel``): the runs it started go
  on, and the id may be scheduled again;
- ``schedules`` lists what the caller may read (``read``), as ``ScheduleInfo``.

Decision 0058.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from fleet.kernel.cancellation import cancel_execution
from fleet.kernel.delivery import send_message
from fleet.kernel.engine import Engine
from fleet.kernel.errors import (
    AccessDeniedError,
    ConfigurationError,
    ExecutionBusyError,
    ExecutionConflictError,
    ExecutionFinishedError,
    ExecutionNotFoundError,
    FlowNotFoundError,
    ValidationError,
)
from fleet.kernel.flows import FlowDefinition, FlowRegistry
from fleet.kernel.fold import ExecutionState
from fleet.kernel.schedule_flow import CONTROL, INFO, MAX_BACKFILL, SCHEDULE_FLOW, Progress
from fleet.kernel.schedule_spec import (
    SCHEDULE_FLOW_ID,
    SCHEDULE_PREFIX,
    ScheduleSpec,
    check_schedule_id,
    field_error,
    tick_id,
)
from fleet.kernel.security import Principal, authorize
from fleet.kernel.starts import start_payload
from fleet.kernel.store.spi import ExecutionSummary
from fleet.kernel.typed import encode_input
from fleet.kernel.values import datetime_from_ms, ms_from_datetime

T = TypeVar("T")
_LIVE = ("running", "parked")
_PAGE = 500
#: How long a call retries while a live lease elsewhere holds the schedule's run (a
#: worker driving its tick).
BUSY_S = 5.0


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    """A schedule as ``runtime.schedules()`` reports it (and ``runtime.schedule`` returns).

    ``missed`` counts ticks skipped for being older than ``catchup`` after an outage,
    ``overlapped`` those the overlap policy skipped; ``skipped`` is both.
    ``last_run_status`` is the last run's status in the store's index.
    """

    schedule_id: str
    flow_id: str
    input: Any
    cron: str | None
    every: timedelta | None
    timezone: str
    overlap: str
    catchup: timedelta
    paused: bool
    next_tick: datetime | None
    last_run: str | None
    last_run_at: datetime | None
    last_run_status: str | None
    runs: int
    missed: int
    overlapped: int
    duplicates: int
    execution_id: str
    tenant: str | None = None

    @property
    def skipped(self) -> int:
        return self.missed + self.overlapped

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``fleet schedule list --json``, the Fleet page)."""
        def iso(when: datetime | None) -> str | None:
            return None if when is None else when.isoformat()
        return {"scheduleId": self.schedule_id, "flow": self.flow_id, "input": self.input,
                "cron": self.cron, "every": None if self.every is None else
                self.every.total_seconds(), "timezone": self.timezone,
                "overlap": self.overlap, "catchup": self.catchup.total_seconds(),
                "paused": self.paused, "nextTick": iso(self.next_tick),
                "lastRun": self.last_run, "lastRunAt": iso(self.last_run_at),
                "lastRunStatus": self.last_run_status, "runs": self.runs,
                "missed": self.missed, "overlapped": self.overlapped,
                "skipped": self.skipped, "duplicates": self.duplicates,
                "executionId": self.execution_id, "tenant": self.tenant}


def root_id(schedule_id: str, generation: int) -> str:
    """The id of the first run of a schedule's ``generation``."""
    return f"{SCHEDULE_PREFIX}{schedule_id}/{generation}"


def run_order(execution_id: str) -> tuple[str, int, int]:
    """``(schedule id, generation, continuation)`` of a schedule run's id."""
    sid, _, rest = execution_id[len(SCHEDULE_PREFIX):].rpartition("/")
    generation, _, continued = rest.partition("~")
    try:
        return sid, int(generation), int(continued or 0)
    except ValueError:
        return sid, -1, -1  # not a schedule's id (the flow refuses to run under it)


async def find_live(engine: Engine, schedule_id: str) -> ExecutionSummary | None:
    """The running or parked run of ``schedule_id`` (the newest, should two be)."""
    prefix = f"{SCHEDULE_PREFIX}{schedule_id}/"
    found: list[ExecutionSummary] = []
    for status in _LIVE:
        rows = await engine.store.list_executions(flow_id=SCHEDULE_FLOW_ID, status=status,
                                                  after_id=prefix, limit=8)
        found += [r for r in rows if r.execution_id.startswith(prefix)]
    return max(found, key=lambda r: run_order(r.execution_id)[1:], default=None)


async def require_live(engine: Engine, schedule_id: str) -> ExecutionSummary:
    check_schedule_id(schedule_id)
    live = await find_live(engine, schedule_id)
    if live is None:
        raise ExecutionNotFoundError(f"no schedule {schedule_id!r} (never made, or deleted)")
    return live


async def while_busy(call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, again while the schedule's run is held elsewhere or has just moved on
    (continued as new) under the caller."""
    deadline = time.monotonic() + BUSY_S
    delay = 0.02
    while True:
        try:
            return await call()
        except (ExecutionBusyError, ExecutionFinishedError):
            if time.monotonic() + delay > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)


def describe(state: ExecutionState, now_ms: int, last_run_status: str | None = None,
             ) -> ScheduleInfo:
    """The ``ScheduleInfo`` of a schedule's run at ``now_ms``: its settings (the run's
    input) and what it last published (``ctx.set_value``), or its starting point when it
    has published nothing yet. While a skip or buffer_one schedule waits for its run to
    end it does not wake at each tick (it counts them at the end): the ticks that have
    fallen since are counted here as skipped already, and the next tick is the next
    one from now."""
    data = state.input if isinstance(state.input, dict) else {}
    spec = ScheduleSpec.from_log(data.get("spec"))
    progress = Progress.from_log(data.get("progress"))
    shown = state.published.get(INFO)
    if not isinstance(shown, dict):
        shown = {"paused": progress.paused, "runs": progress.runs, "missed": progress.missed,
                 "overlapped": progress.overlapped, "duplicates": progress.duplicates,
                 "lastRun": progress.last_run, "lastRunTick": progress.last_run_tick,
                 "nextTick": None if progress.paused else spec.next_after(progress.last)}

    def when(key: str) -> datetime | None:
        value = shown.get(key)
        return datetime_from_ms(value) if isinstance(value, int) else None

    overlapped, next_tick = int(shown.get("overlapped") or 0), when("nextTick")
    accounted = shown.get("accounted")
    if shown.get("tracking") and not shown.get("paused") and isinstance(accounted, int):
        fallen, _, _ = spec.due(accounted, now_ms)
        if fallen and spec.overlap == "buffer_one" and shown.get("buffered") is None:
            fallen -= 1  # the first waits for the run to end, to run then
        overlapped += fallen
        upcoming = spec.next_after(max(accounted, now_ms))
        next_tick = None if upcoming is None else datetime_from_ms(upcoming)

    return ScheduleInfo(
        schedule_id=spec.schedule_id, flow_id=spec.flow_id, input=spec.input, cron=spec.cron,
        every=spec.every, timezone=spec.timezone, overlap=spec.overlap, catchup=spec.catchup,
        paused=bool(shown.get("paused")), next_tick=next_tick,
        last_run=shown.get("lastRun"), last_run_at=when("lastRunTick"),
        last_run_status=last_run_status, runs=int(shown.get("runs") or 0),
        missed=int(shown.get("missed") or 0), overlapped=overlapped,
        duplicates=int(shown.get("duplicates") or 0), execution_id=state.execution_id,
        tenant=(state.owner or {}).get("tenant"))


async def info_of(engine: Engine, state: ExecutionState) -> ScheduleInfo:
    info = describe(state, engine.clock())
    if info.last_run is None:
        return info
    row = await engine.store.get_execution(info.last_run)
    return describe(state, engine.clock(), None if row is None else str(row.status))


async def create(engine: Engine, flows: FlowRegistry, schedule_id: str,
                 flow: FlowDefinition | str, input: Any, *, cron: Any, every: Any,
                 timezone: Any, overlap: Any, catchup: Any, principal: Principal | None,
                 drive: bool) -> ScheduleInfo:
    """``Runtime.schedule`` (see the module)."""
    flow_id = flow.flow_id if isinstance(flow, FlowDefinition) else flow
    definition = flows.latest(flow_id) if isinstance(flow_id, str) else None
    if definition is None or flow_id == SCHEDULE_FLOW_ID:
        known = sorted({d.flow_id for d in flows} - {SCHEDULE_FLOW_ID})
        raise FlowNotFoundError(f"flow: no flow {flow_id!r} is registered to schedule; known "
                                f"flows: {known}", field="flow")
    await engine.access.check(None, "start", principal, audit=False)
    data = encode_input(definition.body, input, f"the input of flow {flow_id!r}")
    spec = ScheduleSpec.build(schedule_id, definition.flow_id, data, cron=cron, every=every,
                              timezone=timezone, overlap=overlap, catchup=catchup)
    for _ in range(5):
        live = await find_live(engine, schedule_id)
        if live is not None:
            return await _existing(engine, live.execution_id, spec, principal)
        generation = 1
        while await engine.store.head(root_id(schedule_id, generation)) is not None:
            generation += 1
        eid, now = root_id(schedule_id, generation), engine.clock()
        payload = start_payload(SCHEDULE_FLOW, {
            "spec": spec.to_log(),
            "progress": Progress(last=now, generation=generation).to_log()},
            principal, now, engine.options.features)
        try:
            await engine.begin(eid, SCHEDULE_FLOW, engine.deferred(eid), payload, drive=drive)
        except ExecutionBusyError:
            await asyncio.sleep(0.05)  # another start of this generation is in flight
        # Whoever wrote it (this call or a concurrent one), the live run now says which
        # settings stand.
    raise ExecutionBusyError(f"schedule {schedule_id!r} kept changing while it was made; "
                             "retry")


async def _existing(engine: Engine, execution_id: str, spec: ScheduleSpec,
                    principal: Principal | None) -> ScheduleInfo:
    """A schedule of this id runs: the same settings are fine (idempotent), others not."""
    state = await engine.fold(execution_id)
    try:
        await engine.access.check(state, "read", principal, audit=False)
    except (AccessDeniedError, ExecutionNotFoundError) as exc:  # not the caller's to read
        raise ExecutionConflictError(f"schedule id {spec.schedule_id!r} is taken; choose "
                                     "another id (nothing was written)") from exc
    theirs = ScheduleSpec.from_log((state.input or {}).get("spec"))
    differ = theirs.differences(spec)
    if differ:
        shown = "; ".join(f"{name} {_setting(theirs, name)!r} (asked "
                          f"{_setting(spec, name)!r})" for name in differ)
        raise ConfigurationError(
            f"{differ[0]}: schedule {spec.schedule_id!r} exists with other settings: {shown}. "
            "Delete it first (delete_schedule) or pick another id; nothing was written",
            field=differ[0], fields=differ)
    return await info_of(engine, state)


def _setting(spec: ScheduleSpec, name: str) -> Any:
    return {"flow": spec.flow_id, "input": spec.input, "cron": spec.cron,
            "every": spec.every, "timezone": spec.timezone, "overlap": spec.overlap,
            "catchup": spec.catchup}[name]


async def control(engine: Engine, schedule_id: str, message: dict[str, Any], *,
                  principal: Principal | None, drive: bool) -> tuple[str, bool]:
    """Send a control message to the schedule's run; the run it reached and whether it
    woke (with ``drive=False`` the caller then enqueues its drive)."""
    async def send() -> tuple[str, bool]:
        live = await require_live(engine, schedule_id)
        return await send_message(engine, live.execution_id, CONTROL, message,
                                  principal=principal, drive=drive)
    return await while_busy(send)


async def backfill_message(engine: Engine, schedule_id: str, start: Any, end: Any,
                           principal: Principal | None) -> tuple[dict[str, Any], list[str]]:
    """The backfill message for ``[start, end]`` and the ids of its ticks' runs, checked
    (``ValidationError`` naming ``start`` or ``end``; nothing written)."""
    live = await require_live(engine, schedule_id)
    state = await engine.fold(live.execution_id)
    await engine.access.check(state, "read", principal, audit=False)
    spec = ScheduleSpec.from_log((state.input or {}).get("spec"))
    bounds = []
    for name, value in (("start", start), ("end", end)):
        try:
            bounds.append(ms_from_datetime(value, f"backfill_schedule({name}=...)"))
        except ValidationError as exc:
            raise field_error(name, exc.message) from exc
    first, last = bounds
    if last < first:
        raise field_error("end", "is before start")
    if last > engine.clock():
        raise field_error("end", "is in the future: backfill runs the ticks of a past window "
                          "(the ticks to come run on schedule)")
    ticks = spec.ticks(first, last, MAX_BACKFILL)
    if len(ticks) > MAX_BACKFILL:
        raise field_error("end", f"the window holds more than {MAX_BACKFILL} ticks; backfill "
                          "it in parts")
    return {"op": "backfill", "start": first, "end": last}, [
        tick_id(schedule_id, tick) for tick in ticks]


async def delete(engine: Engine, schedule_id: str, *, principal: Principal | None) -> str:
    """End the schedule's run at once (the runs it started go on); the run ended."""
    async def end() -> str:
        live = await require_live(engine, schedule_id)
        await cancel_execution(engine, live.execution_id, reason=f"schedule {schedule_id!r} "
                               "deleted", principal=principal, force=True, drive=False)
        return live.execution_id
    return await while_busy(end)


async def list_all(engine: Engine, *, principal: Principal | None,
                   system: bool) -> list[ScheduleInfo]:
    """Every live schedule ``principal`` may read, by schedule id."""
    newest: dict[str, ExecutionSummary] = {}
    for status in _LIVE:
        after: str | None = SCHEDULE_PREFIX
        while True:
            page = await engine.store.list_executions(flow_id=SCHEDULE_FLOW_ID, status=status,
                                                      after_id=after, limit=_PAGE)
            for row in page:
                sid, generation, _ = run_order(row.execution_id)
                seen = newest.get(sid)
                if generation >= 1 and (seen is None or run_order(seen.execution_id)
                                        < run_order(row.execution_id)):
                    newest[sid] = row
            if len(page) < _PAGE:
                break
            after = page[-1].execution_id
    out = []
    for sid in sorted(newest):
        state = await engine.fold(newest[sid].execution_id)
        if state.sequence < 0 or not authorize(engine.access.policy, "read", principal,
                                               state.owner, strict=engine.access.strict,
                                               system=system).allowed:
            continue
        try:
            out.append(await info_of(engine, state))
        except ValidationError:
            continue  # not a schedule's run (its flow refuses to run it)
    return out


class ScheduleMethods:
    """``Runtime``'s schedule calls (the runtime takes this mixin; see the module)."""

    engine: Engine
    flows: FlowRegistry

    async def schedule(self, schedule_id: str, flow: FlowDefinition | str, input: Any = None,
                       *, cron: str | None = None, every: timedelta | None = None,
                       timezone: str = "UTC", overlap: str = "skip",
                       catchup: timedelta = timedelta(0), principal: Principal | None = None,
                       drive: bool = True) -> ScheduleInfo:
        """Run ``flow`` with ``input`` at each tick of ``cron`` (5 fields, in ``timezone``)
        or ``every`` (a ``timedelta``; multiples since the epoch), exactly once per tick.

        Each tick's run has the id ``<schedule_id>@<tick, ISO 8601 UTC>`` and reads its
        tick as ``ctx.scheduled_at``. ``overlap``: ``"skip"`` (a tick while the last run is
        still running, or parked on a gate, does nothing), ``"buffer_one"`` (it runs when
        the last run ends; one at most waits) or ``"allow"``. After an outage the missed
        ticks within ``catchup`` run once each, older ones are counted as missed (the
        latest runs if it is under a minute late). The same settings again return the
        schedule (idempotent); other settings raise ``ConfigurationError``; a bad setting
        ``ValidationError`` naming it, nothing written. Authorised as ``start``; the runs
        are the principal's.
        """
        return await create(self.engine, self.flows, schedule_id, flow, input, cron=cron,
                            every=every, timezone=timezone, overlap=overlap, catchup=catchup,
                            principal=principal, drive=drive)

    async def schedules(self, *, principal: Principal | None = None,
                        system: bool = False) -> list[ScheduleInfo]:
        """Every schedule ``principal`` may read (``read``), by id: settings, next tick,
        last run, counts of runs and skipped ticks."""
        return await list_all(self.engine, principal=principal, system=system)

    async def pause_schedule(self, schedule_id: str, *, principal: Principal | None = None,
                             drive: bool = True) -> None:
        """Stop firing ticks until ``resume_schedule`` (authorised as ``send``)."""
        await control(self.engine, schedule_id, {"op": "pause"}, principal=principal,
                      drive=drive)

    async def resume_schedule(self, schedule_id: str, *, principal: Principal | None = None,
                              drive: bool = True) -> None:
        """Fire ticks again from now on (the ticks of the pause are not run)."""
        await control(self.engine, schedule_id, {"op": "resume"}, principal=principal,
                      drive=drive)

    async def trigger_schedule(self, schedule_id: str, *, principal: Principal | None = None,
                               drive: bool = True) -> str:
        """Start a run now, whatever the overlap policy says (an explicit ask); the id it
        will have (``<schedule_id>@<now>``)."""
        at = self.engine.clock()
        await control(self.engine, schedule_id, {"op": "trigger", "at": at},
                      principal=principal, drive=drive)
        return tick_id(schedule_id, at)

    async def backfill_schedule(self, schedule_id: str, start: datetime, end: datetime, *,
                                principal: Principal | None = None,
                                drive: bool = True) -> list[str]:
        """Run the ticks of the past window ``[start, end]`` (aware datetimes; at most
        1,000 ticks), whatever the overlap policy; the ids of their runs. A tick that ran
        already is not run again (the store refuses its id)."""
        message, ids = await backfill_message(self.engine, schedule_id, start, end, principal)
        await control(self.engine, schedule_id, message, principal=principal, drive=drive)
        return ids

    async def delete_schedule(self, schedule_id: str, *,
                              principal: Principal | None = None) -> None:
        """End the schedule now (authorised as ``cancel``); its runs go on. The id may be
        scheduled again, with any settings."""
        await delete(self.engine, schedule_id, principal=principal)


__all__ = ["BUSY_S", "ScheduleInfo", "ScheduleMethods", "backfill_message", "control",
           "create", "delete", "describe", "find_live", "list_all", "require_live",
           "root_id", "run_order", "while_busy"]
