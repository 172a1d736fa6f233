"""Acting on what diverged: the executions parked on the divergence and in-doubt gates,
and a retry made as the configured operator principal (the Fleet page, ``fleet diverged``).

``list_parked`` reads the store's index (``waiting_on``) and each execution's
folded state: its flow and version, when it parked, the last lease holder (the
worker that drove it), and the recorded reason (the park's correlation key,
``skipped <n>: <ids>`` for a divergence).

``Operator.retry`` re-drives an execution parked on ``__fleet_diverged__``:
``retry_diverged`` is ``resume`` of that gate, written as ``FLEET_OPERATOR``
(the log's ``EXECUTION_RESUMED`` says ``by`` whom: the audit), then a worker
drives it. Before the code is fixed the re-run diverges again and parks again;
``retry`` waits for that drive and says which (decision 0028).

The operator principal is not the execution's owner, so the runtime it writes
through lets ``resume`` by anyone (``AccessPolicy(rules={"resume": "any"})``);
who may ask for it is decided before: the Fleet page's operator role
(``FLEET_OPERATORS``), the CLI's shell access.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleet.config import FleetSettings
from fleet.dispatcher.broker import producer_app
from fleet.dispatcher.dispatcher import Dispatcher
from fleet.host.kernel import build_runtime, open_store
from fleet.host.loop import EventLoopThread
from fleet.kernel.errors import (
    ConfigurationError,
    ExecutionNotFoundError,
    GateMismatchError,
)
from fleet.kernel.events import EventEnvelope, wall_clock_ms
from fleet.kernel.fold import DIVERGED_GATE, INDOUBT_GATE
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import AccessPolicy, Principal
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.spi_queues import HoldsQueues, QueueDepth, holds_queues

GATES: tuple[str, ...] = (DIVERGED_GATE, INDOUBT_GATE)


@dataclass(frozen=True, slots=True)
class ParkedExecution:
    """One execution parked on an operator's gate."""

    execution_id: str
    gate: str
    flow_id: str
    flow_version: int | None
    reason: str
    worker: str | None
    parked_at: int  # ms since the epoch (the index's updated_at)
    tenant: str | None

    @property
    def kind(self) -> str:
        return "diverged" if self.gate == DIVERGED_GATE else "in-doubt"

    def to_dict(self) -> dict[str, Any]:
        return {"executionId": self.execution_id, "gate": self.gate, "kind": self.kind,
                "flow": self.flow_id, "version": self.flow_version, "reason": self.reason,
                "worker": self.worker, "parkedAt": self.parked_at, "tenant": self.tenant}


@dataclass(frozen=True, slots=True)
class RetryResult:
    """What a retry led to, once a worker drove it (or ``waited`` ran out)."""

    execution_id: str
    status: str          # the index's status after the drive ("parked", "completed", ...)
    waiting_on: str | None
    reason: str
    settled: bool        # a drive after the retry was seen

    @property
    def reparked(self) -> bool:
        return self.status == "parked" and self.waiting_on == DIVERGED_GATE

    @property
    def message(self) -> str:
        eid = self.execution_id
        if not self.settled:
            return (f"{eid}: retried as the operator; no worker has driven it yet (it runs "
                    "when one takes its drive)")
        if self.reparked:
            return (f"{eid}: retried, and the re-run diverged again: parked again on "
                    f"{DIVERGED_GATE} ({self.reason}). The code still skips recorded steps: "
                    "fix, pin or migrate it (compatible_with, resume_as), deploy the workers, "
                    "then retry")
        if self.status == "parked":
            return f"{eid}: retried; it ran on and is parked on {self.waiting_on}"
        return f"{eid}: retried; it ran on and is {self.status}"

    def to_dict(self) -> dict[str, Any]:
        return {"executionId": self.execution_id, "status": self.status,
                "waitingOn": self.waiting_on, "reason": self.reason, "settled": self.settled,
                "reparked": self.reparked, "message": self.message}


async def list_parked(store: EventStore, runtime: Runtime, *,
                      gates: Sequence[str] = GATES, limit: int = 200) -> list[ParkedExecution]:
    """The executions parked on ``gates``, oldest park first (at most ``limit`` per gate)."""
    out: list[ParkedExecution] = []
    for gate in gates:
        rows = await store.list_executions(status="parked", waiting_on=gate, limit=limit)
        for row in rows:
            try:
                state = await runtime.load_state(row.execution_id, system=True)
            except ExecutionNotFoundError:
                continue
            waiting = state.waiting or {}
            out.append(ParkedExecution(
                row.execution_id, gate, row.flow_id, state.flow_version,
                str(waiting.get("correlationKey") or waiting.get("reason") or ""),
                row.holder, row.updated_at, row.tenant))
    out.sort(key=lambda p: (p.parked_at, p.execution_id))
    return out


class Operator:
    """Lists and retries parked executions as ``settings.operator`` (sync; own loop thread).

    Args:
        settings: The store, the broker, ``operator`` (the principal's actor).
        settle_s: How long ``retry`` waits for the worker's drive.
    """

    def __init__(self, settings: FleetSettings, *, settle_s: float = 15.0) -> None:
        self.settings = settings
        self.settle_s = settle_s
        self.principal = Principal(settings.operator) if settings.operator else None
        self._thread = EventLoopThread("fleet-operator", event_loop=settings.event_loop)
        self._thread.start()
        self._store: EventStore | None = None
        self._runtime: Runtime | None = None
        self._dispatcher: Dispatcher | None = None
        self._app: Any = None

    async def _open(self) -> tuple[EventStore, Runtime]:
        if self._store is None or self._runtime is None:
            store = open_store(self.settings)
            self._store = store
            self._runtime = build_runtime(self.settings, store, role="operator",
                                          access_policy=AccessPolicy(rules={"resume": "any"}))
        return self._store, self._runtime

    def parked(self, *, gates: Sequence[str] = GATES, limit: int = 200
               ) -> list[ParkedExecution]:
        """``list_parked`` on the store."""
        async def go() -> list[ParkedExecution]:
            store, runtime = await self._open()
            return await list_parked(store, runtime, gates=gates, limit=limit)
        return self._thread.run_coroutine(go(), timeout=60)

    def queue_depths(self) -> list[QueueDepth]:
        """Every queue's waiting runs, oldest wait, running and delayed runs, read from the
        store now (decision 0056); none when the store keeps no queues."""
        async def go() -> list[QueueDepth]:
            store, _ = await self._open()
            if not holds_queues(store) or not isinstance(store, HoldsQueues):
                return []
            return await store.queue_depths(wall_clock_ms())
        return self._thread.run_coroutine(go(), timeout=60)

    def events(self, execution_id: str, *, limit: int = 500) -> list[EventEnvelope]:
        """The execution's log (the log view): its last ``limit`` events."""
        async def go() -> list[EventEnvelope]:
            store, _ = await self._open()
            events = await store.read(execution_id)
            return events[-limit:]
        return self._thread.run_coroutine(go(), timeout=60)

    def retry(self, execution_id: str) -> RetryResult:
        """Retry a diverged execution as the operator; wait for its next drive.

        Raises:
            ConfigurationError: no ``FLEET_OPERATOR`` is configured.
            ExecutionNotFoundError: no such execution.
            GateMismatchError: it is not parked on the divergence gate (nothing written).
        """
        if self.principal is None:
            raise ConfigurationError("retrying needs an operator principal: set FLEET_OPERATOR "
                                     "(e.g. operator:oncall); it is recorded on the log as "
                                     "who resumed")
        principal = self.principal
        return self._thread.run_coroutine(self._retry(execution_id, principal),
                                          timeout=self.settle_s + 60)

    async def _retry(self, execution_id: str, principal: Principal) -> RetryResult:
        store, runtime = await self._open()
        row = await store.get_execution(execution_id)
        if row is None:
            raise ExecutionNotFoundError(f"no execution {execution_id!r}")
        if row.status != "parked" or row.waiting_on != DIVERGED_GATE:
            raise GateMismatchError(
                f"execution {execution_id!r} is {row.status}"
                + (f" on {row.waiting_on}" if row.waiting_on else "")
                + f", not parked on {DIVERGED_GATE}: there is nothing to retry")
        if self._dispatcher is None:
            self._app = producer_app(self.settings, main="fleet-operator")
            self._dispatcher = Dispatcher(self.settings, runtime=runtime, app=self._app)
        await self._dispatcher.resume(execution_id, DIVERGED_GATE, None, principal=principal)
        resumed = await store.get_execution(execution_id)
        head = resumed.head if resumed is not None else row.head
        deadline = time.monotonic() + self.settle_s
        while True:
            now = await store.get_execution(execution_id)
            if now is not None and now.head > head and now.status != "running":
                reason = ""
                if now.status == "parked":
                    state = await runtime.load_state(execution_id, system=True)
                    reason = str((state.waiting or {}).get("correlationKey") or "")
                return RetryResult(execution_id, now.status, now.waiting_on, reason, True)
            if time.monotonic() > deadline:
                status = now.status if now is not None else "unknown"
                return RetryResult(execution_id, status, None, "", False)
            await asyncio.sleep(0.1)

    def close(self) -> None:
        async def shut() -> None:
            if self._dispatcher is not None:
                await self._dispatcher.aclose()
            if self._store is not None:
                await self._store.close()
        try:
            self._thread.run_coroutine(shut(), timeout=30)
        finally:
            if self._app is not None:
                self._app.close()
            self._thread.stop()


__all__ = ["GATES", "Operator", "ParkedExecution", "RetryResult", "list_parked"]
