"""Moving an execution to another registered version: ``resume_as``.

``resume_as`` migrates a running, parked or finished execution to a target
version of its flow. ``strategy="replay-check"`` (the default) refuses when
the target would orphan a recorded frame (ADR 0113 D4): a frame passes when
its id, its family (the part before the first ``#``) or one of the target's
``step_families`` is declared. A target that declares nothing passes no
frame: replay-check refuses it for any execution with recorded frames (use
``force`` to migrate anyway, or declare the steps). ``discard`` drops frames so they run again. A
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

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fleet.kernel.engine import Engine, RunFuture
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
from fleet.kernel.lease import Lease
from fleet.kernel.security import Principal
from fleet.kernel.writes import make_events

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

    A definition that declares no steps and no families recognises no frame:
    every recorded frame is an orphan (the record's rule read literally; issue
    13 item 5 and decision 0013: it used to accept every frame, so replay-check
    vouched for a migration it had checked nothing of).
    """
    steps = frozenset(definition.steps)
    families = definition.step_families
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


async def resume_as(engine: Engine, execution_id: str, *, version: int | None = None,
                    strategy: str = "replay-check", discard: Sequence[str] = (),
                    principal: Principal | None = None) -> RunFuture | None:
    """Migrate ``execution_id`` to ``version`` (default: the newest) and drive it.

    Returns the future of the run launched here, or None when the migrated
    execution is parked or finished (nothing to run).
    """
    if strategy not in ("replay-check", "force"):
        raise ConfigurationError(f"strategy must be 'replay-check' or 'force', got {strategy!r}")
    state = await engine.fold(execution_id)
    if state.sequence < 0:
        raise ExecutionNotFoundError(f"no execution {execution_id!r}")
    await engine.access.check(state, "resume", principal, audit=True)
    target = _target(engine, state, version)
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
            undeclared = "" if target.steps or target.step_families else (
                " (it declares no steps and no step_families, so replay-check can vouch for "
                "none of them)")
            raise MigrationRefusedError(
                f"version {target.version} of {target.flow_id!r} does not declare recorded "
                f"frames: {listed}{undeclared}. Declare them (steps= or step_families=), "
                "discard them, or pass strategy='force'")
    async with await engine.take(execution_id) as lease:
        # The migration supersedes a run of it here: that run is fenced out.
        await engine.stop_local(execution_id, "superseded")
        state = await engine.fold(execution_id)
        payload: dict[str, Any] = {
            "fromFlowHash": state.flow_hash or "",
            "toFlowHash": target.content_hash(engine.options.features),
            "toVersion": target.version, "toCodeHash": target.code_fingerprint or ""}
        if dropped:
            payload["discard"] = sorted(dropped)
        if state.terminal:
            payload["reopen"] = True
        state = await land_bootstrap(engine, state, lease,
                                     [(EventType.EXECUTION_MIGRATED, payload)])
        if state.parked or state.terminal:
            return None
        return await engine.drive(execution_id, lease)


def _target(engine: Engine, state: ExecutionState, version: int | None) -> FlowDefinition:
    versions = engine.flows.versions(state.flow_id or "")
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


async def land_bootstrap(engine: Engine, state: ExecutionState, lease: Lease,
                         bodies: list[tuple[EventType, dict[str, Any]]]) -> ExecutionState:
    """Make a reopen's bootstrap durable at the head, re-slotting over late outcomes.

    Written through the one write path (``LogWriter.write``), so ``on_event`` and
    ``on_durable_event`` report the bootstrap once it is stored (ADR 0116 round
    3 A). Returns the state with the bootstrap (and any adopted late outcomes)
    folded.
    """
    for attempt in range(REOPEN_RETRIES + 1):
        events = make_events(state.execution_id, state.sequence, engine.clock(), bodies)
        try:
            await engine.writer.write(lease, events)
        except DuplicateSequenceError:
            if attempt == REOPEN_RETRIES:
                raise
            above = await engine.store.read(state.execution_id, after=state.sequence)
            if not only_late_outcomes(above, state.sequence):
                raise
            state = fold_log(above, state)
            continue
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
