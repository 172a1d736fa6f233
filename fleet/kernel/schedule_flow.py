"""The schedule flow: each schedule is a durable flow of the kernel's own (decision 0058).

``runtime.schedule(...)`` starts ``__fleet_schedule`` under the reserved id
``__fleet_schedule__:<schedule id>/<generation>``; every runtime registers it, so
every worker can drive it. Its body loops:

1. publish its state with ``ctx.set_value("schedule", ...)`` (next tick, last run,
   counters: what ``runtime.schedules()`` and the Fleet page read);
2. race a control message (``ctx.receive("schedule.control")``: pause, resume,
   trigger, backfill) against the next tick's durable timer and, while the last
   run counts for the overlap policy, that run's end (a child's result is a wait);
3. at a tick, ``plan`` the ticks due since the last one (the catch-up rule) and
   start each as a child flow with the id ``<schedule id>@<tick>``
   (``on_parent_close="abandon"``): started exactly once, across replays and crashes,
   and a second start of a tick's id is refused by the store (counted as a
   duplicate).

The tick timer is never waited out inside the run, however near it is: the run
parks, so no worker is held between ticks, and the timer service (or
``fire_due_timers(now=)``) fires it. Every ``TICKS_PER_RUN`` wakes the run
continues as new, carrying its state (and any control message not yet taken), so
its log stays short; it waits for the run it tracks to end first, so the end
always reaches the run that started it. A skip or buffer_one schedule does not
wake at the ticks a run in flight would skip: it counts them when the run ends.
Deleting a schedule cancels its run (``runtime.cancel``); the runs it started go on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fleet.kernel.children import ChildHandle, start_child
from fleet.kernel.context import Context
from fleet.kernel.errors import (
    ChildFailedError,
    ExecutionConflictError,
    ReservedNameError,
    ValidationError,
)
from fleet.kernel.flows import FlowDefinition, flow
from fleet.kernel.schedule_spec import SCHEDULE_FLOW_ID, SCHEDULE_PREFIX, ScheduleSpec, tick_id
from fleet.kernel.values import printable
from fleet.kernel.waits import TimerWait, Wait

#: The message key of a schedule's controls, and the value key of its published state.
CONTROL = "schedule.control"
INFO = "schedule"
#: Wakes (and runs started) before a schedule's run continues as new.
TICKS_PER_RUN = 50
#: The most ticks one backfill starts.
MAX_BACKFILL = 1_000
_OWN_SUFFIX = re.compile(r"[0-9]+(~[0-9]+)?\Z")


class TickTimer(TimerWait):
    """A schedule's next tick: a durable timer the run parks on however near it is (a
    ``ctx.sleep`` this short would be waited out in the run, holding its worker)."""

    __slots__ = ()

    def remaining(self) -> float | None:
        return None


@dataclass(slots=True)
class Progress:
    """What a schedule carries from run to run (``continue_as_new``'s input)."""

    last: int                     # ticks up to here (ms) are accounted for
    generation: int = 1
    paused: bool = False
    buffered: int | None = None   # buffer_one: the tick waiting for the run in flight
    runs: int = 0
    missed: int = 0               # past the catch-up window
    overlapped: int = 0           # skipped by the overlap policy
    duplicates: int = 0           # a tick whose id another execution holds
    refused: int = 0              # control messages that were not understood
    last_run: str | None = None
    last_run_tick: int | None = None

    def to_log(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_log(cls, data: Any) -> Progress:
        fields = cls.__dataclass_fields__
        if not isinstance(data, dict) or set(data) - set(fields) or not all(
                isinstance(data.get(k), int) and not isinstance(data.get(k), bool)
                for k in ("last", "generation")):
            raise ValidationError(f"not a schedule's progress: {printable(data, 200)}")
        return cls(**data)


def check_own_id(execution_id: str, schedule_id: str) -> None:
    """A schedule runs only under its own reserved id: a start of this flow by any other
    means (an id no caller may take is the proof) is refused before it starts a run."""
    prefix = f"{SCHEDULE_PREFIX}{schedule_id}/"
    if not (execution_id.startswith(prefix)
            and _OWN_SUFFIX.match(execution_id[len(prefix):])):
        raise ReservedNameError(
            f"flow {SCHEDULE_FLOW_ID!r} runs the schedules runtime.schedule makes, under ids "
            f"{prefix}<n>; execution {printable(execution_id, 80)!r} is not one")


class ScheduleLoop:
    """One run of a schedule's body (see the module)."""

    def __init__(self, ctx: Context, spec: ScheduleSpec, progress: Progress,
                 data: dict[str, Any]) -> None:
        self.ctx = ctx
        self.spec = spec
        self.progress = progress
        self.data = data
        control = ctx.receive(CONTROL)
        assert isinstance(control, Wait)
        self.where = control.where  # the body's place: where its timers and children go
        self.tracked: ChildHandle | None = None  # the run the overlap policy waits for
        self.work = 0

    def info(self) -> dict[str, Any]:
        p = self.progress
        return {"paused": p.paused, "nextTick": None if p.paused else
                self.spec.next_after(p.last), "lastRun": p.last_run,
                "lastRunTick": p.last_run_tick, "runs": p.runs, "missed": p.missed,
                "overlapped": p.overlapped, "duplicates": p.duplicates, "refused": p.refused,
                "buffered": p.buffered, "generation": p.generation, "accounted": p.last,
                "tracking": self.tracked is not None}

    async def run(self) -> dict[str, Any]:
        p, spec = self.progress, self.spec
        while True:
            await self.ctx.set_value(INFO, self.info())
            if self.work >= TICKS_PER_RUN and self.tracked is None:
                await self.ctx.continue_as_new({"spec": self.data.get("spec"),
                                                "progress": p.to_log()})
            waits: list[Wait] = [self.ctx.receive(CONTROL)]
            tick = None if p.paused or self.tracked is not None else spec.next_after(p.last)
            if tick is not None:
                waits.append(TickTimer(self.where, kind="tick", due=tick))
            if self.tracked is not None:
                waits.append(self.tracked.result())
            try:
                index, message = await self.ctx.first(*waits)
            except ChildFailedError:  # the tracked run ended failed or cancelled
                index, message = len(waits) - 1, None
            self.work += 1
            if index == 0:
                await self.control(message)
            elif self.tracked is not None:
                await self.ended()
            elif tick is not None:
                await self.fired(tick)

    def now(self) -> int:
        return round(self.ctx.now() * 1000)

    async def fired(self, tick: int) -> None:
        """The tick's timer fired: run what the catch-up rule says is due."""
        p = self.progress
        plan = self.spec.plan(p.last, max(self.now(), tick))
        p.missed += plan.missed
        for due in plan.run:
            await self.on_tick(due)
        if plan.latest is not None:
            p.last = plan.latest

    async def on_tick(self, tick: int) -> None:
        p, overlap = self.progress, self.spec.overlap
        if self.tracked is None or overlap == "allow":
            await self.start(tick, track=overlap != "allow")
        elif overlap == "buffer_one" and p.buffered is None:
            p.buffered = tick
        else:
            p.overlapped += 1

    async def ended(self) -> None:
        """The tracked run ended: count the ticks that fell while it ran (skip), or keep
        the first for now (buffer_one); start the buffered one."""
        p, spec = self.progress, self.spec
        self.tracked = None
        if p.paused:
            return
        count, first, latest = spec.due(p.last, self.now())
        if count:
            if spec.overlap == "buffer_one" and p.buffered is None and first is not None:
                p.buffered, count = first, count - 1
            p.overlapped += count
            p.last = latest if latest is not None else p.last
        if p.buffered is not None:
            tick, p.buffered = p.buffered, None
            await self.start(tick, track=True)

    async def start(self, tick: int, *, track: bool) -> None:
        """Start the run of ``tick`` (once: its id is the tick's)."""
        p, spec = self.progress, self.spec
        ident = tick_id(spec.schedule_id, tick)
        try:
            handle = await start_child(self.where, spec.flow_id, spec.input, id=ident,
                                       on_parent_close="abandon", kernel_id=True)
        except ExecutionConflictError:
            p.duplicates += 1  # the store holds this tick's id already: not run twice
            return
        p.runs += 1
        p.last_run, p.last_run_tick = ident, tick
        self.work += 1
        if track:
            self.tracked = handle

    async def control(self, message: Any) -> None:
        p = self.progress
        op = message.get("op") if isinstance(message, dict) else None
        if op == "pause":
            p.paused = True
        elif op == "resume":
            if p.paused:
                p.paused = False
                p.last = max(p.last, self.now())  # the ticks of the pause are not owed
        elif op == "trigger" and _is_ms(message.get("at")):
            track = self.tracked is None and self.spec.overlap != "allow"
            await self.start(message["at"], track=track)
        elif op == "backfill" and _is_ms(message.get("start")) and _is_ms(message.get("end")):
            for tick in self.spec.ticks(message["start"], message["end"],
                                        MAX_BACKFILL)[:MAX_BACKFILL]:
                await self.start(tick, track=False)
        else:
            p.refused += 1


def _is_ms(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53


async def run_schedule(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """The body of ``__fleet_schedule`` (see the module)."""
    spec = ScheduleSpec.from_log(data.get("spec"))
    check_own_id(ctx.execution_id, spec.schedule_id)
    loop = ScheduleLoop(ctx, spec, Progress.from_log(data.get("progress")), data)
    return await loop.run()


#: The flow every runtime registers (``Runtime.__init__``).
SCHEDULE_FLOW: FlowDefinition = flow(SCHEDULE_FLOW_ID)(run_schedule)


def with_schedule_flow(flows: Sequence[FlowDefinition]) -> list[FlowDefinition]:
    """``flows`` and the schedule flow (once: a list taken from another runtime has it)."""
    return [*flows, *(() if SCHEDULE_FLOW in flows else (SCHEDULE_FLOW,))]

__all__ = ["CONTROL", "INFO", "MAX_BACKFILL", "SCHEDULE_FLOW", "TICKS_PER_RUN", "Progress",
           "ScheduleLoop", "TickTimer", "check_own_id", "run_schedule", "with_schedule_flow"]
