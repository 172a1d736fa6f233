"""Dry replay: check recorded logs against the current code without writing.

``replay_check`` folds a recorded log, resolves the registered version its
structure names, compares code fingerprints, and re-runs the body against the
log with the divergence detector in ``fail`` mode. It stops at the first live
new work (a step, an in-doubt step, a decider, a timer, a park, the end), after
judging it, so no effect ever runs and nothing is written anywhere. A flow
that is healthy to deploy replays every recorded log to ``ok``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleet.kernel.context import Context, _ContinueAsNew
from fleet.kernel.errors import (
    ConfigurationError,
    ExecutionParked,
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
from fleet.kernel.runtime import ReplayFrontier, Run, Runtime
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import FenceGrant


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
        await store.append_batch(list(events))
    runtime = Runtime(store, flows=[definition], divergence="fail", features=features,
                      local_timers=False, inline_sleep_max=0.0)
    live = ExecutionState.from_dict(state.to_dict())
    journal = Journal(store, live, fence=None, clock=runtime.clock, warner=runtime.warner)
    run = Run(runtime, definition, journal, FenceGrant(eid, 0, "replay-check", 0))
    run.stop_at_frontier = True
    try:
        try:
            await definition.body(Context(run), live.input)
            await run.before_new_work(EventType.EXECUTION_COMPLETED, None)
        except ExecutionParked:
            await run.before_new_work(EventType.EXECUTION_SUSPENDED, None)
        except _ContinueAsNew:
            pass
    except ReplayFrontier as frontier:
        return ReplayVerdict(eid, state.flow_id, "ok", frontier=str(frontier))
    except FlowReplayDivergenceError as exc:
        return ReplayVerdict(eid, state.flow_id, "diverged", skipped=exc.skipped,
                             detail=str(exc))
    except (RunAborted, asyncio.CancelledError) as exc:
        return ReplayVerdict(eid, state.flow_id, "error", detail=str(exc))
    except Exception as exc:  # noqa: BLE001 - the flow's own (recorded) failure replays
        # A log that ended failed replays its failure (a served StepFailedError,
        # or the body's own exception); a kernel-detected fault is never "ok".
        if state.status == "failed" and not isinstance(exc, (ValidationError, ReplayError)):
            return ReplayVerdict(eid, state.flow_id, "ok", frontier="recorded failure")
        return ReplayVerdict(eid, state.flow_id, "error",
                             detail=f"the body raised {type(exc).__name__}: {exc}")
    return ReplayVerdict(eid, state.flow_id, "ok", frontier="end")


def replay_check_sync(events: Sequence[EventEnvelope],
                      flows: Sequence[FlowDefinition]) -> ReplayVerdict:
    """``replay_check`` from sync code (refuses to run inside a running loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(replay_check(events, flows))
    raise ConfigurationError("replay_check_sync was called inside a running event loop; "
                             "await replay_check(...) instead")
