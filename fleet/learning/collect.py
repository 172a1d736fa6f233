"""Gather the learning evidence of many executions from a store.

With a snapshot store, each execution's evidence is ``evidence_events(folded
state, log)``, exact whether or not it was compacted. Without one, a log that
looks compacted (a hole after sequence 0) cannot be read as evidence: it is
counted and named, never read quietly as "no decisions" (ADR 0116 round 4
item 3).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fleet.kernel.events import EventEnvelope
from fleet.kernel.fold import ExecutionState, fold_log
from fleet.kernel.store.spi import EventStore, SnapshotStore
from fleet.learning.evidence import evidence_events
from fleet.learning.trajectories import Trajectory, trajectories

_FINISHED = ("completed", "failed", "cancelled", "continued")


@dataclass(slots=True)
class Collected:
    """What ``collect_trajectories`` found."""

    trajectories: list[Trajectory] = field(default_factory=list)
    executions: int = 0
    compacted_unread: list[str] = field(default_factory=list)


def looks_compacted(events: list[EventEnvelope]) -> bool:
    """A hole in the sequences: events below a checkpoint were dropped."""
    return any(b.sequence != a.sequence + 1 for a, b in itertools.pairwise(events))


async def collect_evidence(store: EventStore, snapshots: SnapshotStore | None = None, *,
                           flow_id: str | None = None, page: int = 500,
                           limit: int | None = None,
                           found: Collected | None = None) -> AsyncIterator[list[EventEnvelope]]:
    """Each finished execution's evidence events (optionally of one flow), one list each.

    ``found`` (when given) counts the executions read and names the compacted
    ones that could not be (no snapshot store); their evidence is not yielded.
    """
    out = found if found is not None else Collected()
    read = 0
    for status in _FINISHED:
        after: str | None = None
        while True:
            rows = await store.list_executions(status=status, flow_id=flow_id,
                                               after_id=after, limit=page)
            for row in rows:
                if limit is not None and read >= limit:
                    return
                read += 1
                out.executions += 1
                log = await store.read(row.execution_id)
                snap = await snapshots.load(row.execution_id) if snapshots else None
                if snap is not None:
                    base = ExecutionState.from_dict(snap.state)
                    state = fold_log([e for e in log if e.sequence > snap.sequence], base)
                    yield evidence_events(state, log)
                elif looks_compacted(log):
                    out.compacted_unread.append(row.execution_id)
                else:
                    yield log
            if len(rows) < page:
                break
            after = rows[-1].execution_id


async def collect_trajectories(store: EventStore, snapshots: SnapshotStore | None = None, *,
                               flow_id: str | None = None, page: int = 500,
                               limit: int | None = None) -> Collected:
    """Trajectories of every finished execution (optionally of one flow)."""
    out = Collected()
    async for events in collect_evidence(store, snapshots, flow_id=flow_id, page=page,
                                         limit=limit, found=out):
        out.trajectories.extend(trajectories(events))
    return out
