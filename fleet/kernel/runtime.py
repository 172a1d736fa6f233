"""The runtime: starts, drives, resumes and recovers executions.

A drive takes the execution's fence, folds its log and re-runs the flow body
from the top (``Context`` serves what the log holds). A run ends in one of
four ways: a terminal event, a park (gate, long timer, receive, in-doubt),
an abort (fenced out, a write failed, a kernel-detected programming error:
nothing more is written), or cancellation.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fleet.kernel.context import (
    RESERVED_PREFIX,
    Context,
    _ContinueAsNew,
)
from fleet.kernel.divergence import skipped_key
from fleet.kernel.errors import (
    AccessDeniedError,
    ConfigurationError,
    ExecutionBusyError,
    ExecutionCancelledError,
    ExecutionFailedError,
    ExecutionFinishedError,
    ExecutionNotFoundError,
    ExecutionNotParkedError,
    ExecutionParked,
    FleetError,
    FlowNotFoundError,
    FlowReplayDivergenceError,
    GateMismatchError,
    HandedBack,
    ReplayError,
    RunAborted,
    ValidationError,
)
from fleet.kernel.events import EventEnvelope, EventType, ensure_json
from fleet.kernel.flows import Features, FlowDefinition, FlowRegistry
from fleet.kernel.fold import (
    DIVERGED_GATE,
    INDOUBT_GATE,
    MESSAGE_GATE,
    ExecutionState,
    fold_log,
)
from fleet.kernel.journal import EventObserver, Journal, Warner, deliver
from fleet.kernel.migration import resume_as
from fleet.kernel.outcomes import OutcomeResult, record_outcome
from fleet.kernel.run import ReplayFrontier as ReplayFrontier
from fleet.kernel.run import Run as Run
from fleet.kernel.security import (
    AccessPolicy,
    Op,
    Principal,
    authorize,
)
from fleet.kernel.starts import StartRequest, start_many
from fleet.kernel.store.spi import EventStore, FenceGrant, SnapshotStore

# Errors the kernel raises before writing anything for a programming fault:
# the run stops where it is (the log is exactly as it was), it is not failed.
_ABORTS_RUN = (ValidationError, ReplayError)
# A log that ends on one of these has not been driven since it was (re)opened;
# any other last event means a holder stopped mid-run and a drive is a recovery.
_WAKE_EVENTS = frozenset({EventType.EXECUTION_STARTED, EventType.EXECUTION_RESUMED,
                          EventType.TIMER_FIRED, EventType.RECOVERED,
                          EventType.EXECUTION_MIGRATED})
# The divergence mode of a runtime built without ``divergence=`` and not strict
# (ADR 0113 D3: warn first). Tests can force it (FLEET_TEST_DIVERGENCE=fail).
DEFAULT_DIVERGENCE = "warn"


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    examined: int = 0
    recovered: int = 0
    skipped: int = 0
    failed: int = 0


class ExecutionHandle:
    """What ``start``, ``resume`` and ``drive`` return."""

    def __init__(self, runtime: Runtime, execution_id: str) -> None:
        self.runtime = runtime
        self.execution_id = execution_id

    async def result(self, timeout: float | None = None) -> Any:
        """The execution's output once it completes (following continuations)."""
        return await asyncio.wait_for(self.runtime.result(self.execution_id), timeout)

    async def state(self) -> ExecutionState:
        return await self.runtime.load_state(self.execution_id, system=True)

    def __repr__(self) -> str:
        return f"ExecutionHandle({self.execution_id!r})"


class Runtime:
    """Durable execution in one process, over any ``EventStore``."""

    def __init__(self, store: EventStore, *, flows: Sequence[FlowDefinition] = (),
                 snapshots: SnapshotStore | None = None,
                 access_policy: AccessPolicy = AccessPolicy(), strict: bool = False,
                 divergence: str | None = None, features: Features = Features(),
                 on_event: EventObserver | None = None,
                 on_durable_event: EventObserver | None = None,
                 on_warn: Callable[[str], Any] | None = None,
                 on_execution_denied: Callable[[dict[str, Any]], Any] | None = None,
                 clock: Callable[[], int] | None = None, holder: str | None = None,
                 lease_ms: int = 30_000, inline_sleep_max: float = 1.0,
                 local_timers: bool = True, allow_flow_code_mismatch: bool = False) -> None:
        if divergence not in (None, "off", "warn", "fail"):
            raise ConfigurationError(
                f"divergence must be 'off', 'warn' or 'fail', got {divergence!r}")
        if lease_ms < 100:
            raise ConfigurationError("lease_ms must be at least 100")
        self.store = store
        self.flows = FlowRegistry(flows)
        self.snapshots = snapshots
        self.access_policy = access_policy
        self.strict = strict
        self.divergence = divergence or ("fail" if strict else DEFAULT_DIVERGENCE)
        self.features = features
        # Drive an execution whose recorded code fingerprint the registered
        # version does not accept (warned, not refused): an operator's override.
        self.allow_flow_code_mismatch = allow_flow_code_mismatch
        self.on_event = on_event
        self.on_durable_event = on_durable_event
        self.on_execution_denied = on_execution_denied
        self.clock: Callable[[], int] = clock or wall_clock_ms
        self.warner = Warner(on_warn)
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lease_ms = lease_ms
        self.inline_sleep_max = inline_sleep_max
        self.local_timers = local_timers
        self._runs: dict[str, Run] = {}
        self._waiters: dict[str, list[asyncio.Future[ExecutionState]]] = {}
        # Why this runtime's last run of an execution stopped without an end, so a
        # result() asked after the stop raises it instead of waiting forever.
        self._aborts: dict[str, BaseException] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._background: set[asyncio.Task[Any]] = set()
        # Counters an operator reads (and the fleet exports to Flower).
        self.drives = 0
        self.completed = 0
        self.failed = 0
        self.parked = 0
        self.aborted = 0
        self.recovered = 0
        self.denied = 0
        self.timers_fired = 0
        self.divergence_warnings = 0
        self.divergence_parked = 0
        self.handed_back = 0
        self.fired_timers: list[str] = []
        # Hand-back (a worker shutting down): no new work; the ids of runs let go.
        self._handing_back = False
        self.handed_back_ids: set[str] = set()

    def register(self, definition: FlowDefinition) -> None:
        self.flows.register(definition)

    # ------------------------------------------------------------------ start
    async def start(self, flow_id: str | FlowDefinition, input: Any = None, *,
                    principal: Principal | None = None, execution_id: str | None = None,
                    drive: bool = True) -> ExecutionHandle:
        """Start an execution (idempotent by ``execution_id``) and drive it here.

        With ``drive=False`` the start is made durable and the lease released;
        a worker drives it (the fleet's dispatcher writes first, then enqueues).
        """
        if isinstance(flow_id, FlowDefinition):
            flow_id = flow_id.flow_id
        definition = self.flows.latest(flow_id)
        if definition is None:
            known = sorted({d.flow_id for d in self.flows})
            raise FlowNotFoundError(f"no flow {flow_id!r} is registered; known flows: {known}")
        verdict = authorize(self.access_policy, "start", principal, None, strict=self.strict)
        if not verdict.allowed:
            await self._denied(None, "start", principal, verdict.reason, audit=False)
        data = ensure_json(input, f"the input of flow {flow_id!r}")
        if execution_id is None:
            # A fresh random id cannot exist yet: no need to ask the store.
            execution_id = uuid.uuid4().hex
        elif not isinstance(execution_id, str) or not execution_id:
            raise ValidationError("execution_id must be a non-empty string")
        elif await self.store.head(execution_id) is not None:  # idempotent start
            return ExecutionHandle(self, execution_id)
        grant = await self._fence_for_start(execution_id)
        if grant is None:  # a concurrent start wrote it
            return ExecutionHandle(self, execution_id)
        now = self.clock()
        payload: dict[str, Any] = {
            "flowId": definition.flow_id, "flowVersion": definition.version,
            "flowHash": definition.content_hash(self.features), "input": data,
            "owner": principal.to_owner() if principal else None}
        if definition.code_fingerprint:
            payload["codeHash"] = definition.code_fingerprint
        if definition.deadline is not None:
            payload["deadlineAt"] = now + int(definition.deadline * 1000)
        return await self._begin(execution_id, definition, grant, payload, drive=drive)

    async def start_many(self, requests: Sequence[StartRequest]) -> list[ExecutionHandle]:
        """Start a batch durably in one store round trip (``fleet.kernel.starts``); none
        is driven here (as ``start(..., drive=False)``). A handle per request, in order;
        a bad request refuses the batch before anything is written."""
        return [ExecutionHandle(self, eid) for eid in await start_many(self, requests)]

    async def _fence_for_start(self, execution_id: str) -> FenceGrant | None:
        """The fence to write a new log under; ``None`` once another start has written it.

        A live lease over an empty log is a start in flight, or one whose write
        and release were both lost (a store outage) and that its caller is now
        retrying: answering for it could name an execution that never comes to
        exist. So wait for the log, or for the lease to lapse and take it.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lease_ms / 1000 + 1.0
        delay = 0.01
        while True:
            grant = await self.store.acquire_fence_if(execution_id, holder=self.holder,
                                                      lease_ms=self.lease_ms)
            if grant is not None:
                return grant
            if await self.store.head(execution_id) is not None:
                return None
            if loop.time() > deadline:
                raise ExecutionBusyError(f"a start of {execution_id!r} holds its fence and "
                                         "has written nothing yet; retry")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def _begin(self, execution_id: str, definition: FlowDefinition, grant: FenceGrant,
                     payload: dict[str, Any], *, drive: bool = True) -> ExecutionHandle:
        state = ExecutionState(execution_id=execution_id)
        journal = self._journal(state, grant)
        journal.commit(EventType.EXECUTION_STARTED, payload)
        try:
            await journal.barrier()
        except RunAborted as exc:
            await self.store.release_fence(execution_id, grant.token)
            if isinstance(exc.cause, FleetError) and exc.cause.code == "duplicate_sequence":
                return ExecutionHandle(self, execution_id)
            raise exc.cause from None
        if not drive:
            await self.store.release_fence(execution_id, grant.token)
            return ExecutionHandle(self, execution_id)
        self._launch(Run(self, definition, journal, grant))
        return ExecutionHandle(self, execution_id)

    # ------------------------------------------------------------------ drive
    async def drive(self, execution_id: str, *, grant: FenceGrant | None = None,
                    wait: bool = False) -> ExecutionHandle:
        """Drive an execution here, superseding any holder (the fleet uses leases)."""
        if grant is None:
            grant = await self.store.acquire_fence(execution_id, holder=self.holder,
                                                   lease_ms=self.lease_ms)
        run = await self._prepare(execution_id, grant)
        if run is not None:
            self._launch(run)
            if wait and run.task is not None:
                await asyncio.shield(run.task)
        return ExecutionHandle(self, execution_id)

    async def drive_if_free(self, execution_id: str) -> bool:
        """Drive only when no live lease is held; ``False`` when someone else holds it."""
        grant = await self.store.acquire_fence_if(execution_id, holder=self.holder,
                                                  lease_ms=self.lease_ms)
        if grant is None:
            return False
        await self.drive(execution_id, grant=grant)
        return True

    async def _prepare(self, execution_id: str, grant: FenceGrant) -> Run | None:
        """Fold the log under ``grant``; a Run to launch, or None (nothing to do)."""
        try:
            state, last_type = await self._load(execution_id)
        except BaseException:
            await self.store.release_fence(execution_id, grant.token)
            raise
        if state.sequence < 0:
            await self.store.release_fence(execution_id, grant.token)
            raise ExecutionNotFoundError(f"no execution {execution_id!r}")
        if state.terminal or state.parked:
            await self.store.release_fence(execution_id, grant.token)
            self._settle(state)
            return None
        try:
            # The structural hash picks the version, then its fingerprint is
            # compared (ADR 0113 D2); a refusal writes nothing.
            definition, allowed = self.flows.pinned(
                execution_id, state.flow_id, state.flow_hash, state.flow_version,
                state.code_hash, allow_code_mismatch=self.allow_flow_code_mismatch)
        except FleetError:
            await self.store.release_fence(execution_id, grant.token)
            raise
        if allowed is not None:
            self.warner.warn(f"{allowed.message} (driven anyway: allow_flow_code_mismatch)",
                             key=f"code-mismatch:{execution_id}")
        journal = self._journal(state, grant)
        run = Run(self, definition, journal, grant)
        if last_type not in _WAKE_EVENTS:
            # The log ends mid-run: an earlier holder stopped (died, was fenced out).
            journal.commit(EventType.RECOVERED, {"by": self.holder, "reason": "drive"})
            self.recovered += 1
        return run

    def _journal(self, state: ExecutionState, grant: FenceGrant) -> Journal:
        return Journal(self.store, state, fence=grant.token, clock=self.clock,
                       warner=self.warner, on_event=self.on_event,
                       on_durable_event=self.on_durable_event)

    def _launch(self, run: Run) -> None:
        execution_id = run.state.execution_id
        task = asyncio.get_running_loop().create_task(self._run(run),
                                                      name=f"fleet-run:{execution_id}")
        run.task = task
        self._runs[execution_id] = run
        self._aborts.pop(execution_id, None)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _run(self, run: Run) -> None:
        self.drives += 1
        state = run.state
        journal = run.journal
        heartbeat = self._heartbeat(run)
        try:
            if state.deadline_at is not None and self.clock() > state.deadline_at:
                journal.commit(EventType.EXECUTION_FAILED, {"error": {
                    "type": "DeadlineExceeded", "message": "the flow's deadline passed",
                    "retryable": False}})
                await journal.barrier()
                self.failed += 1
                return
            ctx = Context(run)
            try:
                output = await run.definition.body(ctx, state.input)
                output = ensure_json(output, f"the output of flow {state.flow_id!r}")
                await run.before_new_work(EventType.EXECUTION_COMPLETED, None)
                journal.commit(EventType.EXECUTION_COMPLETED, {"output": output})
                await journal.barrier()
                self.completed += 1
            except ExecutionParked as park:
                try:
                    await run.before_new_work(EventType.EXECUTION_SUSPENDED, None)
                except FlowReplayDivergenceError as diverged:
                    await self._park_diverged(run, diverged)
                    return
                journal.commit(EventType.EXECUTION_SUSPENDED, {"condition": park.condition})
                await journal.barrier()
                self.parked += 1
                self._arm_local_timer(state)
            except FlowReplayDivergenceError as diverged:
                await self._park_diverged(run, diverged)
                return
            except _ContinueAsNew as cont:
                # The successor exists before the CONTINUED that names it: a crash in
                # between re-drives this run, which finds the successor and only
                # writes CONTINUED; a reader following the chain never finds a gap.
                await journal.barrier()
                await self._start_successor(run, cont)
                journal.commit(EventType.EXECUTION_CONTINUED,
                               {"nextExecutionId": cont.next_execution_id, "input": cont.input})
                await journal.barrier()
            except _ABORTS_RUN as exc:
                # What the run committed before the faulty call is true and
                # stays; the faulty call itself wrote nothing.
                await journal.barrier()
                self.aborted += 1
                self._fail_waiters(state.execution_id, exc)
                self.warner.warn(f"run of {state.execution_id!r} stopped, nothing written: "
                                 f"{type(exc).__name__}: {exc}")
                return
            except (RunAborted, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - the flow's own failure
                if run.refused is not None:
                    # The body caught the refusal and failed instead: the refusal
                    # stands (it latches, and never fails the execution: note 2).
                    await self._park_diverged(run, run.refused)
                    return
                error = exc.to_dict() if isinstance(exc, FleetError) else {
                    "type": type(exc).__name__, "message": str(exc)[:4000], "retryable": False}
                journal.commit(EventType.EXECUTION_FAILED, {"error": error})
                await journal.barrier()
                self.failed += 1
        except RunAborted as aborted:
            self.aborted += 1
            self._fail_waiters(state.execution_id, aborted.cause)
            return
        except HandedBack:
            # Stopped before new work: write what it committed, then let go.
            try:
                await journal.barrier()
            except RunAborted as aborted:
                self.aborted += 1
                self._fail_waiters(state.execution_id, aborted.cause)
                return
            self._note_handed_back(state.execution_id)
            return
        except asyncio.CancelledError:
            await journal.close()
            task = asyncio.current_task()
            if run.cut and task is not None:
                # hand_back_now: stopped where it was (a step running is left in
                # doubt for the next holder); the lease is released below.
                task.uncancel()
                self._note_handed_back(state.execution_id)
                return
            self.aborted += 1
            raise
        finally:
            heartbeat.cancel()
            if self._runs.get(state.execution_id) is run:
                del self._runs[state.execution_id]
            if journal.failed is None:
                try:
                    await self.store.release_fence(state.execution_id, run.grant.token)
                except Exception as exc:  # noqa: BLE001 - the lease expires on its own
                    self.warner.warn(f"could not release the lease of {state.execution_id!r}: "
                                     f"{exc}", key="release")
            # Every way out settles (the deadline branch returns early); only a
            # terminal state wakes result() waiters, an abort already failed them.
            self._settle(state)

    async def _park_diverged(self, run: Run, error: FlowReplayDivergenceError) -> None:
        """Park a refused re-run on the reserved gate; nothing else is appended.

        The execution is left as a crash would leave it, but parked, so neither
        recovery nor timers re-drive it; ``retry_diverged`` resumes it once the
        code is fixed, pinned, listed in ``compatible_with`` or migrated.
        """
        state, journal = run.state, run.journal
        eid = state.execution_id
        reason = ""
        try:
            journal.commit(EventType.EXECUTION_SUSPENDED, {"condition": {
                "on": DIVERGED_GATE, "kind": "diverged",
                "correlationKey": skipped_key(error.skipped)}})
            await journal.barrier()
            error.parked = True
        except RunAborted as aborted:
            reason = f"{type(aborted.cause).__name__}: {aborted.cause}"
        self.divergence_parked += 1
        if error.parked:
            self.warner.warn(f"execution {eid!r} PARKED on {DIVERGED_GATE}: {error}")
        else:
            self.warner.warn(f"execution {eid!r} REFUSED and NOT parked ({reason}): {error}")
        self._fail_waiters(eid, error)

    async def retry_diverged(self, execution_id: str, *, principal: Principal | None = None,
                             drive: bool = True) -> ExecutionHandle:
        """Re-drive an execution parked by the divergence detector.

        Authorised and fenced exactly as ``resume``; the answer is status-only
        and never reaches the flow. A re-run that still diverges parks again.
        """
        return await self.resume(execution_id, DIVERGED_GATE, None, principal=principal,
                                 drive=drive)

    def _heartbeat(self, run: Run) -> asyncio.TimerHandle:
        loop = asyncio.get_running_loop()
        interval = self.lease_ms / 3000

        def beat() -> None:
            if run.journal.failed is not None or (run.task is not None and run.task.done()):
                return
            task = loop.create_task(self.store.renew_lease(
                run.state.execution_id, run.grant.token, lease_ms=self.lease_ms))
            self._background.add(task)
            task.add_done_callback(renewed)
            run_handle[0] = loop.call_later(interval, beat)

        def renewed(task: asyncio.Task[bool]) -> None:
            self._background.discard(task)
            # A renewal lost to a store outage is not fatal: the run's next write
            # fails too, or the lease lapses and the next holder fences it out.
            if not task.cancelled() and (exc := task.exception()) is not None:
                self.warner.warn(f"could not renew the lease of {run.state.execution_id!r}: "
                                 f"{type(exc).__name__}: {exc}", key="renew")

        run_handle = [loop.call_later(interval, beat)]

        class _Cancel:
            def cancel(self) -> None:
                run_handle[0].cancel()
        return _Cancel()  # type: ignore[return-value]

    async def _start_successor(self, run: Run, cont: _ContinueAsNew) -> None:
        definition = self.flows.latest(run.definition.flow_id) or run.definition
        grant = await self.store.acquire_fence_if(cont.next_execution_id, holder=self.holder,
                                                  lease_ms=self.lease_ms)
        if grant is None or await self.store.head(cont.next_execution_id) is not None:
            if grant is not None:
                await self.store.release_fence(cont.next_execution_id, grant.token)
            return
        payload: dict[str, Any] = {
            "flowId": definition.flow_id, "flowVersion": definition.version,
            "flowHash": definition.content_hash(self.features), "input": cont.input,
            "owner": run.state.owner, "continuedFrom": run.state.execution_id}
        if definition.code_fingerprint:
            payload["codeHash"] = definition.code_fingerprint
        await self._begin(cont.next_execution_id, definition, grant, payload)

    # --------------------------------------------------------------- results
    async def result(self, execution_id: str) -> Any:
        """Wait for an execution (and its continuations) to finish; its output."""
        while True:
            # Wait first, read second: a run that ends while the read is in
            # flight settles this future instead of being missed.
            fut: asyncio.Future[ExecutionState] = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(execution_id, []).append(fut)
            try:
                run = self._runs.get(execution_id)
                if run is not None and run.task is not None and not run.task.done():
                    # Driven here: the run settles the future; no need to read the log.
                    state = await self._await_end(execution_id, fut)
                else:
                    state = await self._fold(execution_id)
                if state.sequence < 0:
                    raise ExecutionNotFoundError(f"no execution {execution_id!r}")
                if not state.terminal:
                    aborted = self._aborts.get(execution_id)
                    if aborted is not None and execution_id not in self._runs:
                        raise aborted
                    state = await self._await_end(execution_id, fut)
            finally:
                if fut.done() and not fut.cancelled():
                    fut.exception()  # an abort that raced the read is raised above
                waiters = self._waiters.get(execution_id)
                if waiters is not None and fut in waiters:
                    waiters.remove(fut)
                    if not waiters:
                        del self._waiters[execution_id]
            if state.status == "completed":
                return state.output
            if state.status == "continued" and state.next_execution_id:
                execution_id = state.next_execution_id
                continue
            if state.status == "cancelled":
                raise ExecutionCancelledError(f"execution {execution_id!r} was cancelled")
            error = state.error or {}
            raise ExecutionFailedError(
                f"execution {execution_id!r} failed: {error.get('type', '')}: "
                f"{error.get('message', '')}", error=error)

    async def _await_end(self, execution_id: str,
                         fut: asyncio.Future[ExecutionState]) -> ExecutionState:
        """Wait for a local run to settle ``fut``, re-reading the log now and then:
        an execution another runtime drives (a worker) must be seen to end too."""
        delay = 0.05
        while True:
            done, _ = await asyncio.wait({fut}, timeout=delay)
            if done:
                return fut.result()
            state = await self._fold(execution_id)
            if state.terminal:
                return state
            delay = min(delay * 2, 1.0)

    def _settle(self, state: ExecutionState) -> None:
        if not state.terminal:
            return
        for fut in self._waiters.pop(state.execution_id, []):
            if not fut.done():
                fut.set_result(state)

    def _fail_waiters(self, execution_id: str, exc: BaseException) -> None:
        self._aborts[execution_id] = exc
        if len(self._aborts) > 10_000:
            # A long-lived worker must not grow without bound: forget the oldest
            # (a later result() of it then reads the log, which is still true).
            del self._aborts[next(iter(self._aborts))]
        for fut in self._waiters.pop(execution_id, []):
            if not fut.done():
                fut.set_exception(exc)

    # --------------------------------------------------------------- reading
    async def _fold(self, execution_id: str) -> ExecutionState:
        return (await self._load(execution_id))[0]

    async def _load(self, execution_id: str) -> tuple[ExecutionState, EventType | None]:
        """Snapshot + tail, and the type of the last event read (None: none read)."""
        base: ExecutionState | None = None
        after = -1
        if self.snapshots is not None:
            snap = await self.snapshots.load(execution_id)
            if snap is not None:
                base = ExecutionState.from_dict(snap.state)
                after = snap.sequence
        events = await self.store.read(execution_id, after=after)
        state = fold_log(events, base) if base is not None else fold_log(events)
        if not state.execution_id:
            state.execution_id = execution_id
        return state, (events[-1].type if events else None)

    async def record_outcome(self, execution_id: str, *, decision_id: str, key: str,
                             score: float | None = None, success: bool | None = None,
                             principal: Principal | None = None,
                             system: bool = False) -> OutcomeResult:
        """Attach a reward to a decision of a finished execution (ADR 0116).

        Authorised as ``annotate`` against the recorded owner. Idempotent by
        ``(decision_id, key)``: the same value again is ``appended=False``, a
        different one is refused (``OutcomeRefusedError``).
        """
        return await record_outcome(self, execution_id, decision_id=decision_id, key=key,
                                    score=score, success=success, principal=principal,
                                    system=system)

    async def resume_as(self, execution_id: str, *, version: int | None = None,
                        strategy: str = "replay-check", discard: Sequence[str] = (),
                        principal: Principal | None = None) -> ExecutionHandle:
        """Migrate an execution to another registered version and drive it.

        ``strategy="replay-check"`` refuses a target that would orphan recorded
        frames (``MigrationRefusedError``); ``discard`` drops frames so they run
        again; a finished execution is reopened. Authorised as ``resume``.
        """
        return await resume_as(self, execution_id, version=version, strategy=strategy,
                               discard=discard, principal=principal)

    async def load_state(self, execution_id: str, *, principal: Principal | None = None,
                         system: bool = False) -> ExecutionState:
        """The folded state (snapshot + tail). Authorised as ``read``."""
        state = await self._fold(execution_id)
        if state.sequence < 0:
            raise ExecutionNotFoundError(f"no execution {execution_id!r}")
        if not system:
            await self._authorize(state, "read", principal, audit=False)
        return state

    # ------------------------------------------------------- resume and send
    async def resume(self, execution_id: str, gate: str, payload: Any = None, *,
                     principal: Principal | None = None,
                     drive: bool = True) -> ExecutionHandle:
        """Answer the gate a parked execution waits on, then drive it."""
        state = await self._fold(execution_id)
        if state.sequence < 0:
            raise ExecutionNotFoundError(f"no execution {execution_id!r}")
        await self._authorize(state, "resume", principal, audit=True)
        data = ensure_json(payload, f"the payload for gate {gate!r}")
        self._check_resumable(state, gate)
        grant = await self.store.acquire_fence_if(execution_id, holder=self.holder,
                                                  lease_ms=self.lease_ms)
        if grant is None:
            raise ExecutionBusyError(
                f"execution {execution_id!r} is held by a live lease; retry shortly")
        try:
            state = await self._fold(execution_id)  # re-judge under the fence
            self._check_resumable(state, gate)
            if gate == INDOUBT_GATE:
                data = self._indoubt_answer(state, data)
            elif gate == DIVERGED_GATE:
                data = None  # status-only: the answer never reaches the flow
        except FleetError:
            await self.store.release_fence(execution_id, grant.token)
            raise
        body: dict[str, Any] = {"gate": gate, "payload": data}
        if principal is not None:
            body["by"] = principal.actor
        return await self._append_and_drive(state, grant, [(EventType.EXECUTION_RESUMED, body)],
                                            drive=drive)

    def _check_resumable(self, state: ExecutionState, gate: str) -> None:
        eid = state.execution_id
        if state.terminal:
            raise ExecutionFinishedError(
                f"execution {eid!r} already ended ({state.status}); nothing waits on {gate!r}")
        if not state.parked:
            raise ExecutionNotParkedError(
                f"execution {eid!r} is running, not parked; resume it once it waits on {gate!r}")
        waiting = (state.waiting or {}).get("on")
        if waiting != gate:
            raise GateMismatchError(
                f"execution {eid!r} waits on {waiting!r}, not {gate!r}; resume that gate")
        kind = (state.waiting or {}).get("kind")
        if kind in ("timer", "message"):
            # A timer or a receive is not a gate: resuming it would only log a
            # spurious EXECUTION_RESUMED and park again.
            how = "fire_due_timers fires it" if kind == "timer" else "runtime.send wakes it"
            raise GateMismatchError(
                f"execution {eid!r} waits on a {kind} ({waiting!r}), not a gate; {how}")

    @staticmethod
    def _indoubt_answer(state: ExecutionState, data: Any) -> dict[str, Any]:
        step_id = (state.waiting or {}).get("correlationKey")
        if not isinstance(data, dict) or data.get("action") not in ("retry", "complete"):
            raise ValidationError(
                "answer the in-doubt gate with {'action': 'retry'} to run the step again or "
                "{'action': 'complete', 'output': ...} to record what it did")
        return {**data, "stepId": step_id}

    async def _append_and_drive(self, state: ExecutionState, grant: FenceGrant,
                                events: list[tuple[EventType, dict[str, Any]]], *,
                                drive: bool = True) -> ExecutionHandle:
        execution_id = state.execution_id
        if drive or self.flows.versions(state.flow_id or ""):
            # Judge the code before the answer is written: a refused drive must
            # leave the log exactly as it was (ADR 0113 D2), not hold an answer
            # nobody can consume.
            try:
                self.flows.pinned(execution_id, state.flow_id, state.flow_hash,
                                  state.flow_version, state.code_hash,
                                  allow_code_mismatch=self.allow_flow_code_mismatch)
            except FleetError:
                await self.store.release_fence(execution_id, grant.token)
                raise
        made = []
        seq = state.sequence
        now = self.clock()
        for type_, body in events:
            seq += 1
            made.append(EventEnvelope.make(execution_id, seq, type_, now, body))
        try:
            await self.store.append_batch(made, fence=grant.token)
        except BaseException:
            await self.store.release_fence(execution_id, grant.token)
            raise
        for event in made:
            deliver(self.on_durable_event, event, self.warner, "on_durable_event")
        if not drive:
            await self.store.release_fence(execution_id, grant.token)
            return ExecutionHandle(self, execution_id)
        run = await self._prepare(execution_id, grant)
        if run is not None:
            self._launch(run)
        return ExecutionHandle(self, execution_id)

    async def send(self, execution_id: str, key: str, payload: Any = None, *,
                   principal: Principal | None = None, drive: bool = True) -> bool:
        """Deliver a message to ``ctx.receive(key)``; wakes the execution if it waits.

        Returns True when the message woke a parked execution (with
        ``drive=False`` the caller then enqueues its drive).
        """
        if not isinstance(key, str) or not key:
            raise ValidationError("a message key must be a non-empty string")
        state = await self._fold(execution_id)
        if state.sequence < 0:
            raise ExecutionNotFoundError(f"no execution {execution_id!r}")
        await self._authorize(state, "send", principal, audit=False)
        data = ensure_json(payload, f"the message {key!r}")
        for _ in range(50):
            run = self._runs.get(execution_id)
            if run is not None and run.journal.failed is None and not run.state.parked \
                    and not run.state.terminal:
                run.journal.commit(EventType.MESSAGE_RECEIVED, {"key": key, "payload": data})
                await run.journal.barrier()
                return False
            if run is not None and run.task is not None and not run.task.done():
                await asyncio.wait({run.task})
                continue
            grant = await self.store.acquire_fence_if(execution_id, holder=self.holder,
                                                      lease_ms=self.lease_ms)
            if grant is None:
                raise ExecutionBusyError(
                    f"execution {execution_id!r} is held by a live lease elsewhere; retry")
            state = await self._fold(execution_id)
            if state.terminal:
                await self.store.release_fence(execution_id, grant.token)
                raise ExecutionFinishedError(
                    f"execution {execution_id!r} already ended ({state.status})")
            events: list[tuple[EventType, dict[str, Any]]] = [
                (EventType.MESSAGE_RECEIVED, {"key": key, "payload": data})]
            waiting = state.waiting or {}
            if state.parked and waiting.get("on") == MESSAGE_GATE \
                    and waiting.get("correlationKey") == key:
                events.append((EventType.EXECUTION_RESUMED, {"gate": MESSAGE_GATE}))
                await self._append_and_drive(state, grant, events, drive=drive)
                return True
            made = [EventEnvelope.make(execution_id, state.sequence + 1, events[0][0],
                                       self.clock(), events[0][1])]
            try:
                await self.store.append_batch(made, fence=grant.token)
            finally:
                await self.store.release_fence(execution_id, grant.token)
            deliver(self.on_durable_event, made[0], self.warner, "on_durable_event")
            return False
        raise ExecutionBusyError(f"execution {execution_id!r} stayed busy; retry")

    # ---------------------------------------------------------------- cancel
    async def cancel(self, execution_id: str, *, principal: Principal | None = None,
                     reason: str = "") -> None:
        """Cancel an execution wherever it runs: its holder is fenced out."""
        state = await self._fold(execution_id)
        if state.sequence < 0:
            raise ExecutionNotFoundError(f"no execution {execution_id!r}")
        await self._authorize(state, "cancel", principal, audit=True)
        if state.terminal:
            raise ExecutionFinishedError(
                f"execution {execution_id!r} already ended ({state.status})")
        grant = await self.store.acquire_fence(execution_id, holder=self.holder,
                                               lease_ms=self.lease_ms)
        run = self._runs.get(execution_id)
        if run is not None and run.task is not None and not run.task.done():
            run.task.cancel()
            await asyncio.wait({run.task})
        state = await self._fold(execution_id)
        if state.terminal:
            await self.store.release_fence(execution_id, grant.token)
            raise ExecutionFinishedError(
                f"execution {execution_id!r} already ended ({state.status})")
        seq = state.sequence
        made: list[EventEnvelope] = []
        now = self.clock()
        for step_id, frame in state.frames.items():
            if frame.status in ("started", "retrying", "indoubt"):
                seq += 1
                made.append(EventEnvelope.make(execution_id, seq, EventType.STEP_CANCELLED, now,
                                               {"stepId": step_id, "reason": "cancelled"}))
        made.append(EventEnvelope.make(execution_id, seq + 1, EventType.EXECUTION_CANCELLED, now,
                                       {"reason": reason}))
        try:
            await self.store.append_batch(made, fence=grant.token)
        finally:
            await self.store.release_fence(execution_id, grant.token)
        for event in made:
            deliver(self.on_durable_event, event, self.warner, "on_durable_event")
        handle = self._timers.pop(execution_id, None)
        if handle is not None:
            handle.cancel()
        self._settle(fold_log(made, state))

    # ------------------------------------------------------ timers, recovery
    async def fire_due_timers(self, now: int | None = None, *, limit: int = 100,
                              drive: bool = True) -> int:
        """Fire every due timer: ``TIMER_FIRED``, then drive. Returns how many fired.

        With ``drive=False`` the timer is fired (claimed by a conditional fence,
        so replicas never fire one twice) and the lease released; the caller
        enqueues the drive (the fleet's timer service). ``fired_timers`` then
        lists what fired.
        """
        now = self.clock() if now is None else now
        fired = 0
        self.fired_timers = []
        for due in await self.store.due_timers(now, limit=limit):
            if await self._fire_timer(due.execution_id, due.timer_id, drive=drive):
                fired += 1
                self.fired_timers.append(due.execution_id)
        return fired

    async def _fire_timer(self, execution_id: str, timer_id: str, *,
                          drive: bool = True) -> bool:
        grant = await self.store.acquire_fence_if(execution_id, holder=self.holder,
                                                  lease_ms=self.lease_ms)
        if grant is None:
            return False
        state = await self._fold(execution_id)
        timer = state.timers.get(timer_id)
        waiting = state.waiting or {}
        if (timer is None or timer.get("fired") or not state.parked
                or waiting.get("on") != timer_id):
            await self.store.release_fence(execution_id, grant.token)
            return False
        if drive:
            await self._append_and_drive(state, grant,
                                         [(EventType.TIMER_FIRED, {"timerId": timer_id})])
        else:
            event = EventEnvelope.make(execution_id, state.sequence + 1, EventType.TIMER_FIRED,
                                       self.clock(), {"timerId": timer_id})
            try:
                await self.store.append(event, fence=grant.token)
            finally:
                await self.store.release_fence(execution_id, grant.token)
            deliver(self.on_durable_event, event, self.warner, "on_durable_event")
        self.timers_fired += 1
        return True

    def _arm_local_timer(self, state: ExecutionState) -> None:
        waiting = state.waiting or {}
        if not self.local_timers or waiting.get("kind") != "timer":
            return
        timer = state.timers.get(waiting.get("on", ""))
        if timer is None:
            return
        execution_id, timer_id = state.execution_id, waiting["on"]
        delay = max(0.0, (int(timer.get("dueAt") or 0) - self.clock()) / 1000)
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.pop(execution_id, None)
            task = loop.create_task(self._fire_timer(execution_id, timer_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            task.add_done_callback(report)

        def report(task: asyncio.Task[bool]) -> None:
            if not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                self.warner.warn(f"local timer {timer_id!r} of {execution_id!r} could not fire: "
                                 f"{type(exc).__name__}: {exc}")

        old = self._timers.pop(execution_id, None)
        if old is not None:
            old.cancel()
        self._timers[execution_id] = loop.call_later(delay, fire)

    async def recover_abandoned(self, *, now: int | None = None,
                                limit: int = 100) -> RecoveryReport:
        """Re-drive running executions whose lease expired (their holder died)."""
        now = self.clock() if now is None else now
        examined = recovered = skipped = failed = 0
        for summary in await self.store.list_executions(status="running",
                                                        lease_expired_at=now, limit=limit):
            examined += 1
            if summary.execution_id in self._runs:
                skipped += 1
                continue
            try:
                if await self.drive_if_free(summary.execution_id):
                    recovered += 1
                else:
                    skipped += 1
            except FleetError as exc:
                failed += 1
                self.warner.warn(f"recovery of {summary.execution_id!r} failed: {exc}")
        return RecoveryReport(examined, recovered, skipped, failed)

    # -------------------------------------------------------------- security
    async def _authorize(self, state: ExecutionState, op: Op, principal: Principal | None, *,
                         audit: bool) -> None:
        verdict = authorize(self.access_policy, op, principal, state.owner, strict=self.strict)
        if not verdict.allowed:
            await self._denied(state, op, principal, verdict.reason, audit=audit)

    async def _denied(self, state: ExecutionState | None, op: Op, principal: Principal | None,
                      reason: str, *, audit: bool) -> None:
        self.denied += 1
        execution_id = state.execution_id if state is not None else None
        info = {"executionId": execution_id, "op": op,
                "actor": principal.actor if principal else None,
                "tenant": principal.tenant if principal else None, "reason": reason}
        if audit and state is not None:
            await self._audit_denial(state, info)
        if self.on_execution_denied is not None:
            try:
                self.on_execution_denied(info)
            except Exception as exc:  # noqa: BLE001
                self.warner.warn(f"on_execution_denied raised {exc}", key="on_execution_denied")
        raise AccessDeniedError(f"access denied: {reason}", op=op)

    async def _audit_denial(self, state: ExecutionState, info: dict[str, Any]) -> None:
        """Best effort: append EXECUTION_DENIED unless a live holder owns the next slot."""
        tip = (await self.store.append_if_unchanged(state.execution_id, None)).tip
        if tip.head is None or (tip.lease_expires_at is not None
                                and tip.lease_expires_at > self.clock()):
            return
        event = EventEnvelope.make(state.execution_id, tip.head + 1, EventType.EXECUTION_DENIED,
                                   self.clock(), {"op": info["op"], "actor": info["actor"],
                                                  "tenant": info["tenant"],
                                                  "reason": info["reason"]})
        result = await self.store.append_if_unchanged(state.execution_id, event, tip)
        if result.appended:
            deliver(self.on_durable_event, event, self.warner, "on_durable_event")

    def _note_handed_back(self, execution_id: str) -> None:
        self.handed_back += 1
        self.handed_back_ids.add(execution_id)

    # ------------------------------------------------------------- hand-back
    @property
    def handing_back(self) -> bool:
        """Whether this runtime is letting its runs go (``hand_back``)."""
        return self._handing_back

    def hand_back(self) -> int:
        """Let every run go at its next durable point (a worker shutting down).

        From now on a run stops where it would start new work (a step, a
        decision, a timer, a message...): what it committed is written, its
        lease is released, and whoever drives the execution next continues from
        there. A drive started later stops at its first new work. The ids of
        the runs let go collect in ``handed_back_ids`` (counted in
        ``handed_back``); their executions stay ``running``, for a caller to
        re-enqueue (or for the recovery sweeper to find).

        Returns:
            How many runs are in flight now.
        """
        self._handing_back = True
        return len(self._runs)

    def hand_back_now(self) -> int:
        """Stop the runs still in flight where they are, and release their leases.

        The deadline after ``hand_back``: a run inside a long step is cancelled.
        That step is left in doubt, as a crash would leave it (an idempotent step
        runs again under the next holder, an ``idempotent=False`` one parks on
        the in-doubt gate), but the lease is released at once instead of
        expiring. A run whose write was interrupted keeps its lease until it
        expires (the write may have landed).

        Returns:
            How many runs were cancelled.
        """
        self._handing_back = True
        cut = 0
        for run in list(self._runs.values()):
            if run.task is not None and not run.task.done():
                run.cut = True
                run.task.cancel()
                cut += 1
        return cut

    # ------------------------------------------------------------- lifecycle
    async def close(self) -> None:
        """Stop local timers and wait for the runs this runtime drives."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        tasks = [t for t in self._background if not t.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def active(self) -> int:
        return len(self._runs)


__all__ = ["RESERVED_PREFIX", "ExecutionHandle", "RecoveryReport", "Run", "Runtime"]
