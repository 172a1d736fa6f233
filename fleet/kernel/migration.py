"""Moving an execution to another registered version: ``resume_as``.

``resume_as`` migrates a running, parked or finished execution to a target
version of its flow. ``strategy="replay-check"`` (the default) refuses when
the target would orphan a recorded frame (ADR 0113 D4): a frame passes when
its id, its family (the part before the first ``#``) or one of the target's
``step_families`` is declared. ``discard`` drops frames so they run again. A
finished execution is reopened (ADR 0104's REOPEN).

The bootstrap (the ``EXECUTION_MIGRATED`` that re-points the execution) is
made durable before the run starts, as one ``append_batch``. A late outcome
(``record_outcome``) may take the reopener's slot; on that conflict the
bootstrap folds what sits above its head and re-slots, but only when every
event there is a kernel-stamped, ``late`` ``OUTCOME_RECORDED`` in the very
next slots (ADR 0116 round 3 A, round 4 item 1), at most 3 times. Anything
else is a real writer: the ordinary error stands and nothing was written.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleet.kernel.errors import (
    ConfigurationError,
    DuplicateSequenceError,
    ExecutionNotFoundError,
    FlowNotFoundError,
    MigrationRefusedError,
)
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.fold import ExecutionState, fold_log
from fleet.kernel.journal import deliver
from fleet.kernel.security import Principal
from fleet.kernel.store.spi import FenceGrant

if TYPE_CHECKING:
    from fleet.kernel.runtime import ExecutionHandle, Runtime

REOPEN_RETRIES = 3


@dataclass(frozen=True, slots=True)
class OrphanedFamily:
    """Recorded frames a definition does not declare, grouped by family."""

    family: str
    count: int
    examples: tuple[str, ...]

    def __str__(self) -> str:
        if self.count == 1 and self.examples == (self.family,):
            return self.family
        return f"{self.family}#* ({self.count} frame{'s' if self.count != 1 else ''})"


def step_family(step_id: str) -> str:
    """The family of a dynamic id: ``"agent#turn:3:tool:1"`` → ``"agent"``."""
    return step_id.split("#", 1)[0]


def _declared(step_id: str, steps: frozenset[str],
              families: Sequence[str | re.Pattern[str]]) -> bool:
    if step_id in steps or step_family(step_id) in steps:
        return True
    for family in families:
        if isinstance(family, re.Pattern):
            if family.fullmatch(step_id):
                return True
        elif step_id == family or step_id.startswith(family):
            return True
    return False


def orphaned_frames(frames: Iterable[str], definition: FlowDefinition) -> list[OrphanedFamily]:
    """Frames ``definition`` would not recognise, one entry per family with a count.

    A definition that declares no steps and no families accepts every frame
    (there is nothing to check against).
    """
    steps = frozenset(definition.steps)
    families = definition.step_families
    if not steps and not families:
        return []
    counts: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    for step_id in frames:
        if _declared(step_id, steps, families):
            continue
        family = step_family(step_id)
        counts[family] += 1
        bucket = examples.setdefault(family, [])
        if len(bucket) < 3:
            bucket.append(step_id)
    return [OrphanedFamily(f, n, tuple(examples[f])) for f, n in sorted(counts.items())]


async def resume_as(runtime: Runtime, execution_id: str, *, version: int | None = None,
                    strategy: str = "replay-check", discard: Sequence[str] = (),
                    principal: Principal | None = None) -> ExecutionHandle:
    """Migrate ``execution_id`` to ``version`` (default: the newest) and drive it."""
    from fleet.kernel.runtime import ExecutionHandle

    if strategy not in ("replay-check", "force"):
        raise ConfigurationError(f"strategy must be 'replay-check' or 'force', got {strategy!r}")
    state = await runtime._fold(execution_id)
    if state.sequence < 0:
        raise ExecutionNotFoundError(f"no execution {execution_id!r}")
    await runtime._authorize(state, "resume", principal, audit=True)
    target = _target(runtime, state, version)
    if state.status == "continued":
        raise MigrationRefusedError(
            f"execution {execution_id!r} continued as {state.next_execution_id!r}; migrate "
            "the head of the chain instead")
    dropped = set(discard)
    unknown = sorted(dropped - set(state.frames))
    if unknown:
        raise MigrationRefusedError(f"cannot discard {unknown}: the log holds no such frames")
    if strategy == "replay-check":
        orphans = orphaned_frames((f for f in state.frames if f not in dropped), target)
        if orphans:
            listed = ", ".join(str(o) for o in orphans)
            raise MigrationRefusedError(
                f"version {target.version} of {target.flow_id!r} does not declare recorded "
                f"frames: {listed}. Declare them (steps= or step_families=), discard them, or "
                "pass strategy='force'")
    grant = await runtime.store.acquire_fence(execution_id, holder=runtime.holder,
                                              lease_ms=runtime.lease_ms)
    run = runtime._runs.get(execution_id)
    if run is not None and run.task is not None and not run.task.done():
        run.task.cancel()
        await asyncio.wait({run.task})
    state = await runtime._fold(execution_id)
    payload: dict[str, Any] = {
        "fromFlowHash": state.flow_hash or "",
        "toFlowHash": target.content_hash(runtime.features),
        "toVersion": target.version, "toCodeHash": target.code_fingerprint or ""}
    if dropped:
        payload["discard"] = sorted(dropped)
    if state.terminal:
        payload["reopen"] = True
    try:
        state = await land_bootstrap(runtime, state, grant,
                                     [(EventType.EXECUTION_MIGRATED, payload)])
    except BaseException:
        await runtime.store.release_fence(execution_id, grant.token)
        raise
    if state.parked or state.terminal:
        await runtime.store.release_fence(execution_id, grant.token)
        return ExecutionHandle(runtime, execution_id)
    prepared = await runtime._prepare(execution_id, grant)
    if prepared is not None:
        runtime._launch(prepared)
    return ExecutionHandle(runtime, execution_id)


def _target(runtime: Runtime, state: ExecutionState, version: int | None) -> FlowDefinition:
    versions = runtime.flows.versions(state.flow_id or "")
    if version is None:
        if versions:
            return versions[0]
    else:
        for definition in versions:
            if definition.version == version:
                return definition
    raise FlowNotFoundError(
        f"flow {state.flow_id!r} has no registered version "
        f"{'at all' if version is None else version}; register it before resume_as")


async def land_bootstrap(runtime: Runtime, state: ExecutionState, grant: FenceGrant,
                         bodies: list[tuple[EventType, dict[str, Any]]]) -> ExecutionState:
    """Make a reopen's bootstrap durable at the head, re-slotting over late outcomes.

    Returns the state with the bootstrap (and any adopted late outcomes) folded.
    """
    store = runtime.store
    for attempt in range(REOPEN_RETRIES + 1):
        now = runtime.clock()
        events = [EventEnvelope.make(state.execution_id, state.sequence + 1 + i, t, now, body)
                  for i, (t, body) in enumerate(bodies)]
        try:
            await store.append_batch(events, fence=grant.token)
        except DuplicateSequenceError:
            if attempt == REOPEN_RETRIES:
                raise
            above = await store.read(state.execution_id, after=state.sequence)
            if not only_late_outcomes(above, state.sequence):
                raise
            state = fold_log(above, state)
            continue
        for event in events:
            deliver(runtime.on_durable_event, event, runtime.warner, "on_durable_event")
        return fold_log(events, state)
    raise AssertionError("unreachable")  # pragma: no cover


def only_late_outcomes(events: Sequence[EventEnvelope], head: int) -> bool:
    """True iff ``events`` are kernel-stamped late outcomes in slots head+1, head+2, ..."""
    if not events:
        return False
    for offset, event in enumerate(events, start=1):
        if event.sequence != head + offset:
            return False
        if event.type is not EventType.OUTCOME_RECORDED or not event.kernel:
            return False
        if event.payload.get("late") is not True:
            return False
    return True
