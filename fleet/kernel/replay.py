"""Dry replay: check recorded logs against the current code without writing.

``replay_check`` folds a recorded log, resolves the registered version its
structure names, compares code fingerprints, and re-runs the body against the
log with the divergence detector in ``fail`` mode. It stops at the first live
new work (a step, an in-doubt step, a decider, a timer, a park, the end), after
judging it, so no effect ever runs and nothing is written anywhere (a step
waiting out a retry backoff is a restart: the replay stops there instead of
sleeping). A flow that is healthy to deploy replays every recorded log to
``ok``.

``export_execution`` / ``read_export`` move a log (and its checkpoint, for a
compacted one) through a JSON file, and ``replay_check_store`` checks the
executions of a store; ``fleet replay export|check`` is a thin CLI over them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.kernel.context import Context
from fleet.kernel.errors import (
    ConfigurationError,
    ContinueAsNew,
    ExecutionNotFoundError,
    ExecutionParked,
    FleetError,
    FlowCodeMismatchError,
    FlowNotFoundError,
    FlowReplayDivergenceError,
    ReplayError,
    RunAborted,
    ValidationError,
)
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.flows import Features, FlowDefinition, FlowRegistry
from fleet.kernel.fold import ExecutionState, fold_log
from fleet.kernel.journal import Journal
from fleet.kernel.run import ReplayFrontier, Run
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore, SnapshotStore
from fleet.kernel.writes import append_events


@dataclass(frozen=True, slots=True)
class ReplayVerdict:
    """``status``: ok | diverged | code_mismatch | error."""

    execution_id: str
    flow_id: str | None
    status: str
    skipped: list[str] = field(default_factory=list)
    detail: str = ""
    frontier: str | None = None  # where an ok replay stopped

    @property
    def ok(self) -> bool:
        return self.status == "ok"


async def replay_check(events: Sequence[EventEnvelope], flows: Sequence[FlowDefinition], *,
                       state: ExecutionState | None = None,
                       features: Features = Features()) -> ReplayVerdict:
    """Replay one recorded log against ``flows``; never runs an effect.

    ``state`` is the folded state when the log was compacted (snapshot + tail).
    """
    if state is None:
        state = fold_log(events)
    eid = state.execution_id or (events[0].execution_id if events else "")
    if state.sequence < 0:
        return ReplayVerdict(eid, None, "error", detail="the log is empty")
    registry = FlowRegistry(flows)
    try:
        definition, _ = registry.pinned(eid, state.flow_id, state.flow_hash, state.flow_version,
                                        state.code_hash)
    except FlowCodeMismatchError as exc:
        return ReplayVerdict(eid, state.flow_id, "code_mismatch", detail=str(exc))
    except FlowNotFoundError as exc:
        return ReplayVerdict(eid, state.flow_id, "code_mismatch", detail=str(exc))
    # A private memory store holding a copy of the log: anything the replay
    # commits before it stops (an emit) lands there and is thrown away.
    store = MemoryEventStore()
    if events and events[0].sequence == 0 and all(
            b.sequence == a.sequence + 1 for a, b in itertools.pairwise(events)):
        await append_events(store, list(events), fence=None)  # a private copy
    runtime = Runtime(store, flows=[definition], divergence="fail", features=features,
                      local_timers=False, inline_sleep_max=0.0)
    live = ExecutionState.from_dict(state.to_dict())
    for frame in live.frames.values():
        # A step waiting out a retry backoff restarts live, which is the
        # frontier: a dry replay never sleeps until its retryAt.
        frame.retry_at = None
    journal = Journal(store, live, fence=None, clock=runtime.engine.clock, warner=runtime.warner)
    run = Run(runtime.engine, definition, journal)
    run.stop_at_frontier = True
    try:
        try:
            await definition.body(Context(run), live.input)
            await run.before_new_work(EventType.EXECUTION_COMPLETED, None)
        except ExecutionParked:
            await run.before_new_work(EventType.EXECUTION_SUSPENDED, None)
        except ContinueAsNew:
            pass
    except ReplayFrontier as frontier:
        return ReplayVerdict(eid, state.flow_id, "ok", frontier=str(frontier))
    except FlowReplayDivergenceError as exc:
        return ReplayVerdict(eid, state.flow_id, "diverged", skipped=exc.skipped,
                             detail=str(exc))
    except (RunAborted, asyncio.CancelledError) as exc:
        task = asyncio.current_task()
        if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
            raise  # the caller cancelled the check: not a verdict
        return ReplayVerdict(eid, state.flow_id, "error", detail=str(exc))
    except Exception as exc:  # noqa: BLE001 - the flow's own (recorded) failure replays
        # A log that ended failed replays its failure (a served StepFailedError,
        # or the body's own exception); a kernel-detected fault is never "ok".
        if state.status == "failed" and not isinstance(exc, (ValidationError, ReplayError)):
            return ReplayVerdict(eid, state.flow_id, "ok", frontier="recorded failure")
        return ReplayVerdict(eid, state.flow_id, "error",
                             detail=f"the body raised {type(exc).__name__}: {exc}")
    return ReplayVerdict(eid, state.flow_id, "ok", frontier="end")


# -- recorded logs in files and stores: what ``fleet replay`` reads ---------------------

async def export_execution(store: EventStore, execution_id: str, *,
                           snapshots: SnapshotStore | None = None) -> dict[str, Any]:
    """An execution's log as a JSON-ready document ``{"executionId", "log", "snapshot"?}``.

    ``log`` is every event the store holds; ``snapshot`` (``{"sequence",
    "state"}``) is there when a checkpoint exists, which a compacted log needs.

    Raises:
        ExecutionNotFoundError: the store holds neither events nor a checkpoint.
    """
    events = await store.read(execution_id)
    snap = await snapshots.load(execution_id) if snapshots is not None else None
    if not events and snap is None:
        raise ExecutionNotFoundError(f"no execution {execution_id!r}")
    doc: dict[str, Any] = {"executionId": execution_id, "log": [e.to_dict() for e in events]}
    if snap is not None:
        doc["snapshot"] = {"sequence": snap.sequence, "state": snap.state}
    return doc


def read_export(data: Any) -> tuple[list[EventEnvelope], ExecutionState | None]:
    """The events of an exported log, and the folded state when it needs its checkpoint.

    ``data`` is what ``export_execution`` writes (a divergence vector has the
    same ``log`` / ``snapshot`` keys) or a bare list of envelopes. A log from
    sequence 0 is replayed whole; otherwise the checkpoint plus the tail after it.

    Raises:
        ValidationError: not a recorded log, or a log with a gap and no checkpoint.
        CorruptLogError: an entry that is not a valid envelope.
    """
    snapshot: Any = None
    if isinstance(data, list):
        raw = data
    elif isinstance(data, dict) and isinstance(data.get("log"), list):
        raw, snapshot = data["log"], data.get("snapshot")
    else:
        raise ValidationError("not a recorded log: expected {\"log\": [events...]} (what "
                              "`fleet replay export` writes) or a list of events")
    events = [EventEnvelope.from_dict(e) for e in raw]
    if events and events[0].sequence == 0 and all(
            b.sequence == a.sequence + 1 for a, b in itertools.pairwise(events)):
        return events, None
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("state"), dict):
        raise ValidationError("the log does not start at sequence 0 (it was compacted) and "
                              "carries no snapshot: export it with its snapshot store")
    after = int(snapshot.get("sequence", -1))
    tail = [e for e in events if e.sequence > after]
    return tail, fold_log(tail, ExecutionState.from_dict(snapshot["state"]))


async def replay_check_store(store: EventStore, flows: Sequence[FlowDefinition], *,
                             execution_ids: Sequence[str] | None = None,
                             snapshots: SnapshotStore | None = None,
                             features: Features = Features(),
                             page: int = 500) -> list[ReplayVerdict]:
    """``replay_check`` of executions in a store: those named, or every execution of
    a flow id in ``flows`` (paged through the index, in id order). Writes nothing."""
    if execution_ids is None:
        ids: list[str] = []
        for flow_id in sorted({d.flow_id for d in flows}):
            after: str | None = None
            while True:
                rows = await store.list_executions(flow_id=flow_id, after_id=after, limit=page)
                ids.extend(r.execution_id for r in rows)
                if len(rows) < page:
                    break
                after = rows[-1].execution_id
        execution_ids = ids
    verdicts = []
    for execution_id in execution_ids:
        try:
            events, state = read_export(
                await export_execution(store, execution_id, snapshots=snapshots))
        except FleetError as exc:
            verdicts.append(ReplayVerdict(execution_id, None, "error", detail=str(exc)))
            continue
        verdicts.append(await replay_check(events, flows, state=state, features=features))
    return verdicts


def replay_check_sync(events: Sequence[EventEnvelope],
                      flows: Sequence[FlowDefinition]) -> ReplayVerdict:
    """``replay_check`` from sync code (refuses to run inside a running loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(replay_check(events, flows))
    raise ConfigurationError("replay_check_sync was called inside a running event loop; "
                             "await replay_check(...) instead")
