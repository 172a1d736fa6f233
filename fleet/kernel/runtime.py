"""The runtime: starts, drives, resumes and recovers executions.

``Runtime`` is the public face of the kernel. A drive takes the execution's
fence, folds its log and re-runs the flow body from the top (``Context`` serves
what the log holds); the run says how it ended (``RunOutcome``, through
``ExecutionHandle.outcome()``). The working parts live beside it, each behind
public names: ``engine`` (reads, leases, runs in flight, the writes that wake
them), ``writes`` (the one write path outside a run), ``lease`` (fences held
with ``async with``), ``run`` (one drive), ``timers``, ``recovery``,
``handback``, ``results``, ``access``, ``migration`` and ``outcomes``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime, timedelta
from typing import Any

from fleet.kernel.admissions import Admissions
from fleet.kernel.cancellation import cancel_execution
from fleet.kernel.context import RESERVED_PREFIX
from fleet.kernel.delivery import resume_gate, send_message
from fleet.kernel.engine import Engine
from fleet.kernel.errors import (
    ConfigurationError,
    ExecutionBusyError,
    ExecutionNotFoundError,
    FlowNotFoundError,
    ValidationError,
)
from fleet.kernel.family import Family
from fleet.kernel.flows import Features, FlowDefinition, FlowRegistry
from fleet.kernel.fold import DIVERGED_GATE, ExecutionState
from fleet.kernel.fork import fork
from fleet.kernel.handle import ExecutionHandle
from fleet.kernel.ids import check_explicit_id, idempotent_execution_id
from fleet.kernel.later import asks_later, start_later
from fleet.kernel.migration import resume_as
from fleet.kernel.observers import EventObserver, Warner, WarnSink
from fleet.kernel.options import (
    Clock,
    DeniedObserver,
    DivergenceMode,
    RuntimeOptions,
    RuntimeStats,
)
from fleet.kernel.outcomes import OutcomeResult, record_outcome
from fleet.kernel.queries import get_value, update
from fleet.kernel.queues import Queue
from fleet.kernel.recovery import RecoveryReport, recover_abandoned
from fleet.kernel.results import Until
from fleet.kernel.run import ReplayFrontier as ReplayFrontier
from fleet.kernel.run import Run as Run
from fleet.kernel.run_outcome import RunOutcome
from fleet.kernel.runtime_counters import StatsAttributes
from fleet.kernel.schedule_flow import with_schedule_flow
from fleet.kernel.schedules import ScheduleMethods
from fleet.kernel.security import AccessPolicy, Principal
from fleet.kernel.starts import StartRequest, start_many
from fleet.kernel.store.spi import EventStore, FenceGrant, SnapshotStore
from fleet.kernel.timers import FiredTimer, Timers
from fleet.kernel.typed import encode_input, from_log, return_adapter
from fleet.kernel.values import datetime_from_ms, ms_from_datetime

# The divergence mode of a runtime built without ``divergence=`` and not strict
# (ADR 0113 D3: warn first). Tests can force it (FLEET_TEST_DIVERGENCE=fail).
DEFAULT_DIVERGENCE: DivergenceMode = "warn"
_DEFAULTS = {f.name: f.default for f in fields(RuntimeOptions)}


class Runtime(StatsAttributes, ScheduleMethods):
    """Durable execution in one process, over any ``EventStore``.

    Args:
        store: Where the logs live (memory, SQLite, Postgres, or a decorator).
        flows: The flow versions this runtime can drive (more with ``register``).
        snapshots: Checkpoints of compacted logs (``LogLifecycle.compact``).
        options: Every other setting, grouped and documented in
            ``fleet.kernel.options.RuntimeOptions``. Each is also a keyword
            argument of its own (``access_policy``, ``strict``, ``divergence``,
            ``features``, ``on_event``, ``on_durable_event``, ``on_warn``,
            ``on_execution_denied``, ``clock``, ``holder``, ``lease_ms``,
            ``inline_sleep_max``, ``local_timers``, ``allow_flow_code_mismatch``,
            ``queues``): pass one spelling or the other, not both.

    ``on_event`` reports an event as the run folds it, before its write, so it
    can report an event that never became durable (a failed, refused or lost
    write); anything that acts on events should use ``on_durable_event``, which
    reports only what the log holds (ADR 0147). Counters are in ``stats`` and
    readable as attributes (``runtime.divergence_warnings``).
    """

    def __init__(self, store: EventStore, *, flows: Sequence[FlowDefinition] = (),
                 snapshots: SnapshotStore | None = None,
                 access_policy: AccessPolicy = AccessPolicy(), strict: bool = False,
                 divergence: DivergenceMode | None = None, features: Features = Features(),
                 on_event: EventObserver | None = None,
                 on_durable_event: EventObserver | None = None,
                 on_warn: WarnSink | None = None,
                 on_execution_denied: DeniedObserver | None = None,
                 clock: Clock | None = None, holder: str | None = None,
                 lease_ms: int = 30_000, inline_sleep_max: float = 1.0,
                 local_timers: bool = True, allow_flow_code_mismatch: bool = False,
                 queues: Sequence[Queue] = (), options: RuntimeOptions | None = None) -> None:
        given: dict[str, Any] = {
            "access_policy": access_policy, "strict": strict, "divergence": divergence,
            "features": features, "on_event": on_event, "on_durable_event": on_durable_event,
            "on_warn": on_warn, "on_execution_denied": on_execution_denied, "clock": clock,
            "holder": holder, "lease_ms": lease_ms, "inline_sleep_max": inline_sleep_max,
            "local_timers": local_timers, "allow_flow_code_mismatch": allow_flow_code_mismatch,
            "queues": queues}
        if options is None:
            options = RuntimeOptions(**given)
        else:
            both = sorted(k for k, v in given.items() if v != _DEFAULTS[k])
            if both:
                raise ConfigurationError(
                    f"Runtime got options= and the keyword argument(s) {both}: pass the "
                    "settings one way, e.g. options=RuntimeOptions(..., "
                    f"{both[0]}=...)")
        self.options = options
        self.store = store
        self.flows = FlowRegistry(with_schedule_flow(flows))  # fleet.kernel.schedules
        self.snapshots = snapshots
        self.warner = Warner(options.on_warn)
        self.holder = options.holder or \
            f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.engine = Engine(store, flows=self.flows, snapshots=snapshots, options=options,
                             divergence=options.divergence_mode(DEFAULT_DIVERGENCE),
                             holder=self.holder, warner=self.warner)
        self.timers = Timers(self.engine, local=options.local_timers)
        # Child flows and messages between executions (fleet.kernel.family).
        self.family = Family(self.engine)
        # Declared queues, their passes and wakes (decision 0056).
        self.queues = Admissions(self.engine, self.timers, options.queues,
                                 local=options.local_timers)
        self.stats: RuntimeStats = self.engine.stats
        # The settings in force, as attributes (as before RuntimeOptions): set once
        # here, read by the fleet and by tests; ``options`` holds them all.
        self.divergence: DivergenceMode = self.engine.divergence
        self.strict = options.strict
        self.features = options.features
        self.access_policy = options.access_policy
        self.lease_ms = options.lease_ms
        self.local_timers = options.local_timers
        self.inline_sleep_max = options.inline_sleep_max
        self.allow_flow_code_mismatch = options.allow_flow_code_mismatch
        # The engine's runs in flight and background tasks (tests wait on them).
        self._runs = self.engine.runs
        self._background = self.engine.background

    def register(self, definition: FlowDefinition) -> None:
        self.flows.register(definition)

    # ------------------------------------------------------------------ start
    async def start(self, flow_id: str | FlowDefinition, input: Any = None, *,
                    principal: Principal | None = None, execution_id: str | None = None,
                    idempotency_key: str | None = None, drive: bool = True,
                    start_at: datetime | None = None, start_in: timedelta | None = None,
                    queue: str | None = None, key: str | None = None,
                    priority: int | None = None,
                    debounce: timedelta | None = None) -> ExecutionHandle:
        """Start an execution (idempotent by ``execution_id`` or ``idempotency_key``), drive it.

        A start that finds its execution already there returns a handle to it,
        but only to a principal who may read it and only for the same flow;
        anyone else gets ``ExecutionConflictError`` (decision 0024). An
        ``idempotency_key`` names an id derived from the principal's tenant, the
        flow and the key (``fleet.kernel.ids``); an explicit ``execution_id`` may
        not take a derived form (``idem-...``, ``...~<n>``: ``ReservedNameError``).

        With ``drive=False`` the start is made durable and the lease released;
        a worker drives it (the fleet's dispatcher writes first, then enqueues).

        ``start_at`` (an aware datetime) / ``start_in`` (a timedelta) start it later
        (decision 0055); ``queue`` (a declared ``Queue``, with ``key`` and ``priority``)
        starts it within the queue's limits (0056); ``debounce`` with ``key`` collapses
        the starts of a window into one run with the last input (0057). Those starts
        write the execution at once, parked, and run it later (``fleet.kernel.later``).
        """
        if asks_later(start_at, start_in, queue, key, priority, debounce):
            later = await start_later(
                self, flow_id, input, principal=principal, execution_id=execution_id,
                idempotency_key=idempotency_key, drive=drive, start_at=start_at,
                start_in=start_in, queue=queue, key=key, priority=priority, debounce=debounce)
            if later is not None:
                return ExecutionHandle(self, later.execution_id, later.run)
        if isinstance(flow_id, FlowDefinition):
            flow_id = flow_id.flow_id
        definition = self.flows.latest(flow_id)
        if definition is None:
            known = sorted({d.flow_id for d in self.flows})
            raise FlowNotFoundError(f"no flow {flow_id!r} is registered; known flows: {known}")
        await self.engine.access.check(None, "start", principal, audit=False)
        data = encode_input(definition.body, input, f"the input of flow {flow_id!r}")
        if execution_id is not None and idempotency_key is not None:
            raise ValidationError("give execution_id or idempotency_key, not both")
        # A fresh random id cannot exist yet: no need to ask the store.
        fresh = execution_id is None and idempotency_key is None
        if idempotency_key is not None:
            execution_id = idempotent_execution_id(
                definition.flow_id, idempotency_key, principal.tenant if principal else None)
        elif execution_id is None:
            execution_id = uuid.uuid4().hex
        else:
            check_explicit_id(execution_id)
        if not fresh and await self.store.head(execution_id) is not None:
            await self.engine.existing(execution_id, definition.flow_id, principal)
            return ExecutionHandle(self, execution_id)  # an idempotent start
        now = self.engine.clock()
        payload: dict[str, Any] = {
            "flowId": definition.flow_id, "flowVersion": definition.version,
            "flowHash": definition.content_hash(self.features), "input": data,
            "owner": principal.to_owner() if principal else None}
        if definition.code_fingerprint:
            payload["codeHash"] = definition.code_fingerprint
        if definition.deadline is not None:
            payload["deadlineAt"] = now + int(definition.deadline * 1000)
        # The first write takes the fence (decision 0029); a live lease over the id
        # (another start in flight) is waited for as before.
        try:
            run = await self.engine.begin(execution_id, definition,
                                          self.engine.deferred(execution_id), payload,
                                          drive=drive)
        except ExecutionBusyError:
            lease = await self.engine.lease_for_start(execution_id)
            if lease is None:  # a concurrent start wrote it
                await self.engine.existing(execution_id, definition.flow_id, principal)
                return ExecutionHandle(self, execution_id)
            run = await self.engine.begin(execution_id, definition, lease, payload,
                                          drive=drive)
        if run is None and drive:  # a concurrent start wrote it
            await self.engine.existing(execution_id, definition.flow_id, principal)
            return ExecutionHandle(self, execution_id)
        return ExecutionHandle(self, execution_id, run)

    async def start_many(self, requests: Sequence[StartRequest]) -> list[ExecutionHandle]:
        """Start a batch durably in one store round trip (``fleet.kernel.starts``); none
        is driven here (as ``start(..., drive=False)``). A handle per request, in order;
        a bad request refuses the batch before anything is written."""
        return [ExecutionHandle(self, eid) for eid in await start_many(self, requests)]

    # ------------------------------------------------------------------ drive
    async def drive(self, execution_id: str, *, grant: FenceGrant | None = None,
                    wait: bool = False, if_free: bool = False) -> ExecutionHandle:
        """Drive an execution here; the handle's ``outcome()`` says how the run ended.

        Args:
            grant: A fence the caller already took; None takes it, superseding any holder.
            wait: Return only once the run has stopped.
            if_free: Only if no live lease holds it, with no round trip for the fence:
                the run's first write takes it (decision 0032: the fleet's workers);
                else the outcome is ``stepped_aside``, nothing written. Not with grant.
                Whether it drove: ``(await handle.outcome()).drove`` (decision 0051).
        """
        engine = self.engine
        if if_free and grant is not None:
            raise ConfigurationError("drive(if_free=True) takes no grant: its run's writes do")
        if if_free:
            run = await engine.drive_deferred(execution_id)
        else:
            lease = await engine.take(execution_id) if grant is None else engine.lease(grant)
            run = await engine.drive(execution_id, lease)
        if wait:
            await asyncio.shield(run)
        return ExecutionHandle(self, execution_id, run)

    def now(self) -> datetime:
        """The runtime's time (its ``clock``), an aware UTC ``datetime`` (decision 0051)."""
        return datetime_from_ms(self.engine.clock())

    async def fork(self, execution_id: str, *, from_step: str, version: int | None = None,
                   principal: Principal | None = None, new_execution_id: str | None = None,
                   drive: bool = True) -> ExecutionHandle:
        """A new execution that reuses the recorded outputs before ``from_step`` and runs
        the rest live, on ``version`` (None: the source's); its origin is in its log
        (``fleet.kernel.fork``, decision 0052). The handle is the new execution's."""
        forked = await fork(self.engine, self.flows, self.features, execution_id,
                            from_step=from_step, version=version, principal=principal,
                            new_execution_id=new_execution_id)
        if not drive:
            return ExecutionHandle(self, forked)
        return await self.drive(forked, if_free=True)

    # ------------------------------------------------------- resume and send
    async def resume(self, execution_id: str, gate: str, payload: Any = None, *,
                     principal: Principal | None = None,
                     drive: bool = True) -> ExecutionHandle:
        """Answer the gate a parked execution waits on, then drive it.

        An execution that continued as new is answered in the newest run of its chain
        (the handle names that one).
        """
        answered, run = await resume_gate(self.engine, execution_id, gate, payload,
                                          principal=principal, drive=drive)
        return ExecutionHandle(self, answered, run)

    async def retry_diverged(self, execution_id: str, *, principal: Principal | None = None,
                             drive: bool = True) -> ExecutionHandle:
        """Re-drive an execution parked by the divergence detector.

        Authorised and fenced exactly as ``resume``; the answer is status-only
        and never reaches the flow. A re-run that still diverges parks again.
        """
        return await self.resume(execution_id, DIVERGED_GATE, None, principal=principal,
                                 drive=drive)

    async def send(self, execution_id: str, key: str, payload: Any = None, *,
                   principal: Principal | None = None, drive: bool = True) -> bool:
        """Deliver a message to ``ctx.receive(key)``; wakes the execution if it waits.

        Returns True when the message woke a parked execution (with ``drive=False``
        the caller then enqueues its drive). An execution that continued as new gets
        it in the newest run of its chain.
        """
        _, woke = await send_message(self.engine, execution_id, key, payload,
                                     principal=principal, drive=drive)
        return woke

    # ---------------------------------------------------------------- cancel
    async def cancel(self, execution_id: str, *, reason: str = "",
                     principal: Principal | None = None, force: bool = False,
                     drive: bool = True) -> ExecutionHandle:
        """Cancel an execution wherever it runs (``fleet.kernel.cancellation``).

        The flow gets ``asyncio.CancelledError`` at the await it is parked or running
        on; its ``except``/``finally`` may run more steps (compensation), and it ends
        ``cancelled`` if it lets the error out. Cancelling again changes nothing.
        ``force=True`` ends it at once with no cleanup (Temporal's terminate). A
        finished execution: ``ExecutionFinishedError``. With ``drive=False`` the
        request is made durable and the caller enqueues the drive (the fleet's
        dispatcher). Authorised as ``cancel``.
        """
        _, run = await cancel_execution(self.engine, execution_id, reason=reason,
                                        principal=principal, force=force, drive=drive)
        self.timers.disarm(execution_id)
        return ExecutionHandle(self, execution_id, run)

    # ------------------------------------------------------ outcomes, migration
    async def record_outcome(self, execution_id: str, *, decision_id: str, key: str,
                             score: float | None = None, success: bool | None = None,
                             principal: Principal | None = None,
                             system: bool = False) -> OutcomeResult:
        """Attach a reward to a decision of a finished execution (ADR 0116).

        Authorised as ``annotate`` against the recorded owner. Idempotent by
        ``(decision_id, key)``: the same value again is ``appended=False``, a
        different one is refused (``OutcomeRefusedError``).
        """
        return await record_outcome(self.engine, execution_id, decision_id=decision_id,
                                    key=key, score=score, success=success,
                                    principal=principal, system=system)

    async def resume_as(self, execution_id: str, *, version: int | None = None,
                        strategy: str = "replay-check", discard: Sequence[str] = (),
                        principal: Principal | None = None) -> ExecutionHandle:
        """Migrate an execution to another registered version and drive it.

        ``strategy="replay-check"`` refuses a target that would orphan recorded
        frames (``MigrationRefusedError``); ``discard`` drops frames so they run
        again; a finished execution is reopened. Authorised as ``resume``.
        """
        run = await resume_as(self.engine, execution_id, version=version, strategy=strategy,
                              discard=discard, principal=principal)
        return ExecutionHandle(self, execution_id, run)

    # --------------------------------------------------------------- reading
    async def load_state(self, execution_id: str, *, principal: Principal | None = None,
                         system: bool = False) -> ExecutionState:
        """The folded state (snapshot + tail). Authorised as ``read``."""
        state = await self.engine.fold(execution_id)
        if state.sequence < 0:
            raise ExecutionNotFoundError(f"no execution {execution_id!r}")
        if not system:
            await self.engine.access.check(state, "read", principal, audit=False)
        return state

    async def get_value(self, execution_id: str, key: str, *,
                        timeout: float | timedelta | None = None, type: Any = None,
                        principal: Principal | None = None, system: bool = False) -> Any:
        """A value the flow published with ``ctx.set_value`` (the latest; as ``type`` when
        given: a pydantic model, a dataclass...); with ``timeout`` it waits that long for
        it (``WaitTimeoutError`` after). Writes nothing; answers after the execution ended
        too. Authorised as ``read``."""
        return await get_value(self.engine, execution_id, key, timeout=timeout,
                               principal=principal, system=system, type=type)

    async def update(self, execution_id: str, key: str, payload: Any = None, *,
                     timeout: float | timedelta | None = None, update_id: str | None = None,
                     type: Any = None, principal: Principal | None = None) -> Any:
        """Send an update the flow takes with ``ctx.receive(key)`` and answers with
        ``ctx.reply``; its reply (``UpdateFailedError`` for the flow's error or its
        validator's refusal). A retry with the same ``update_id`` gets the first answer
        and delivers nothing new (``fleet.kernel.queries``). Authorised as ``send``."""
        return await update(self.engine, execution_id, key, payload, timeout=timeout,
                            update_id=update_id, principal=principal, type=type)

    async def result(self, execution_id: str) -> Any:
        """Wait for an execution (and its continuations) to finish; its output (as the
        flow's return annotation types it, for a flow this runtime has registered)."""
        return await self.engine.results.result(execution_id, self._typed_output)

    def _typed_output(self, state: ExecutionState) -> Any:
        definition = self.flows.latest(state.flow_id or "")
        if definition is None:
            return state.output
        return from_log(state.output, return_adapter(definition.body),
                        f"the output of {state.execution_id!r}")

    async def wait(self, execution_id: str, *, until: Until = "terminal",
                   timeout: float | None = None, principal: Principal | None = None,
                   system: bool = False) -> ExecutionState:
        """``ExecutionHandle.wait`` by id: its state once parked or ended (authorised as
        ``read``, like ``load_state``); past ``timeout`` seconds ``WaitTimeoutError``."""
        await self.load_state(execution_id, principal=principal, system=system)
        return await self.engine.results.wait(execution_id, until, timeout)

    # ------------------------------------------------------ timers, recovery
    async def fire_due_timers(self, now: datetime | None = None, *, limit: int = 100,
                              drive: bool = True) -> list[FiredTimer]:
        """Fire every timer due at ``now``: ``TIMER_FIRED``, then drive. The timers fired.

        Delayed starts fire here too (their ``__fleet_start__`` timer), and every
        declared queue gets a pass: the runs it admits now are among those returned
        (their queue's timer, fired).

        Args:
            now: An aware ``datetime`` (default: the runtime's clock). A later
                ``now`` fires timers early: ``datetime.now(timezone.utc) +
                timedelta(hours=1)`` fires what falls due within the hour. A
                number or a naive datetime is refused (``ValidationError``): is
                ``1700000000`` seconds or milliseconds?
            limit: At most this many timers.
            drive: With False the timer is fired (claimed by a conditional
                fence, so replicas never fire one twice) and the lease released;
                the caller enqueues the drive of each execution returned (the
                fleet's timer service).
        """
        at = None if now is None else ms_from_datetime(now, "fire_due_timers(now=...)")
        fired = await self.timers.fire_due(at, limit=limit, drive=drive)
        # Then one pass of every declared queue: what waits for a slot freed anywhere.
        return fired + await self.queues.run_all(at, limit=limit - len(fired), drive=drive)

    async def recover_abandoned(self, *, now: datetime | None = None, limit: int = 100,
                                updated_before: datetime | None = None,
                                after_id: str | None = None) -> RecoveryReport:
        """Re-drive running executions whose lease expired by ``now`` (their holder died).

        ``now`` and ``updated_before`` are aware datetimes (``now`` defaults to
        the runtime's clock; ``updated_before`` skips executions touched since, a
        grace period); ``after_id`` pages (``RecoveryReport.last_id``). A re-drive
        refused for its code or for a diverged replay is counted as failed and
        named, with its reason, in ``RecoveryReport.failures``.
        """
        at = None if now is None else ms_from_datetime(now, "recover_abandoned(now=...)")
        before = None if updated_before is None else ms_from_datetime(
            updated_before, "recover_abandoned(updated_before=...)")
        return await recover_abandoned(self.engine, now=at, limit=limit, updated_before=before,
                                       after_id=after_id)

    # ------------------------------------------------------------- hand-back
    @property
    def handing_back(self) -> bool:
        """Whether this runtime is letting its runs go (``hand_back``)."""
        return self.engine.hand_back.active

    def hand_back(self) -> int:
        """Let every run go at its next durable point (a worker shutting down).

        Each run let go ends with the outcome ``handed_back`` (counted in
        ``handed_back``); its execution stays ``running`` for a caller to
        re-enqueue (see ``fleet.kernel.handback``). Returns how many runs are in
        flight now.
        """
        return self.engine.hand_back.begin(self.engine.runs)

    def hand_back_now(self) -> int:
        """Stop the runs still in flight where they are, releasing their leases.

        The deadline after ``hand_back`` (see ``fleet.kernel.handback``).
        Returns how many runs were cancelled.
        """
        return self.engine.hand_back.cut(self.engine.runs)

    # ------------------------------------------------------------- observers
    @property
    def on_event(self) -> EventObserver | None:
        return self.engine.observers.on_event

    @on_event.setter
    def on_event(self, observer: EventObserver | None) -> None:
        self.engine.observers.on_event = observer

    @property
    def on_durable_event(self) -> EventObserver | None:
        return self.engine.observers.on_durable_event

    @on_durable_event.setter
    def on_durable_event(self, observer: EventObserver | None) -> None:
        self.engine.observers.on_durable_event = observer

    # ------------------------------------------------------------- lifecycle
    async def close(self) -> None:
        """Stop local timers and wait for the runs this runtime drives."""
        self.timers.close()
        self.queues.close()
        await self.engine.close()

    @property
    def active(self) -> int:
        """How many runs are in flight here."""
        return len(self.engine.runs)


__all__ = ["DEFAULT_DIVERGENCE", "RESERVED_PREFIX", "ExecutionHandle", "FiredTimer",
           "RecoveryReport", "Run", "RunOutcome", "Runtime", "RuntimeOptions", "RuntimeStats"]
