"""What one worker process owns: an event loop thread, a store, a Runtime.

Created once per process that runs tasks (with the threads pool: the worker
process itself, at ``worker_init``; with prefork: each child, at
``worker_process_init``) and closed at shutdown. Celery task threads hand
their coroutines to the loop (``EventLoopThread.run_coroutine``), so every
drive of the process shares one connection pool and runs concurrently on one
loop.

``drive`` is what the ``fleet.drive`` task does: read the log and drive the
run; its first write takes the execution's fence only if no live lease is held
(``Runtime.drive(if_free=True)``, decision 0032: no round trip of its own for
the fence). If one is held, the run steps aside before writing anything or
running any step (a duplicate delivery, counted); otherwise it is driven until
it stops (parks, ends, or is aborted). Either way the answer says how it
stopped: the run's own ``RunOutcome``.

The loop also runs the process's ``Heartbeat`` (``fleet health`` reads it),
and ``begin_drain`` is the graceful shutdown (``fleet.workers.shutdown``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fleet.assembly.roles import Role, open_worker
from fleet.config import FleetSettings
from fleet.dispatcher.signing import DispatchVerifier
from fleet.host.keys import KeySource
from fleet.host.loop import EventLoopThread
from fleet.host.tracing import tracing
from fleet.kernel.errors import (
    DuplicateSequenceError,
    ExecutionNotFoundError,
    FleetError,
    StoreUnavailableError,
)
from fleet.kernel.events import EventEnvelope
from fleet.kernel.fold import DIVERGED_GATE, INDOUBT_GATE
from fleet.kernel.journal import EventObserver
from fleet.kernel.run_outcome import OutcomeKind, RunOutcome
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.spi import EventStore
from fleet.services.base import Service, start_order
from fleet.services.counters import PARKS_KEPT, process_name
from fleet.services.health import consuming_problem
from fleet.workers import shutdown, stats
from fleet.workers.marks import DriveMarks

log = logging.getLogger("fleet.workers")

# How a drive ended, as the ``fleet.drive`` task returns it.
COMPLETED, FAILED, PARKED, DIVERGENCE_PARKED = "completed", "failed", "parked", "divergence_parked"
CANCELLED, CONTINUED, STEPPED_ASIDE, FENCED_OUT = "cancelled", "continued", "stepped_aside", \
    "fenced_out"
ABORTED, IDLE, NOT_FOUND, REFUSED = "aborted", "idle", "not_found", "refused"
#: A prefork child's Postgres pool when ``FLEET_PG_POOL_MAX`` is not set.
PREFORK_POOL_MAX = 2
# The worker is shutting down and let the run go (lease released): drive it elsewhere.
HANDED_BACK = "handed_back"

# The task's answer for each way a run can end (``RunOutcome.kind``).
_REPORTED: dict[OutcomeKind, str] = {
    "completed": COMPLETED, "failed": FAILED, "parked": PARKED,
    "diverged_parked": DIVERGENCE_PARKED, "continued": CONTINUED, "cancelled": CANCELLED,
    "fenced_out": FENCED_OUT, "handed_back": HANDED_BACK, "aborted": ABORTED,
    "nothing_to_do": IDLE, "stepped_aside": STEPPED_ASIDE}


class DriveResult(str):
    """How a drive ended: equal to its kind (``"parked"``, ``"handed_back"``...), with
    ``detail``, the sentence the ``fleet.drive`` task returns (what Flower shows as its
    result): ``completed``, ``parked on approval (gate)``, ``parked on
    __fleet_diverged__ (skipped 1: a)``, ``fenced out: ...``, ``handed back``."""

    detail: str

    def __new__(cls, kind: str, detail: str | None = None) -> DriveResult:
        made = super().__new__(cls, kind)
        made.detail = detail or kind.replace("_", " ")
        return made


def describe(outcome: RunOutcome) -> str:
    """One line for an operator: how the run ended."""
    waiting = outcome.waiting
    where = ""
    if waiting is not None:
        where = f" on {waiting.on} ({waiting.kind}"
        where += f": {waiting.correlation_key})" if waiting.correlation_key else ")"
    cause = outcome.cause
    why = f": {type(cause).__name__}: {cause}" if cause is not None else ""
    if outcome.kind == "diverged_parked":
        return f"parked{where}: the replay diverged; fix the code, then retry it"
    if outcome.kind in ("parked", "nothing_to_do"):
        text = "parked" if outcome.kind == "parked" else f"nothing to do ({outcome.status})"
        return text + (where if outcome.status == "parked" else "")
    if outcome.kind == "failed":
        error = outcome.error or {}
        return f"failed: {error.get('type', '')}: {error.get('message', '')}".rstrip(": ")
    if outcome.kind == "continued":
        return f"continued as {outcome.next_execution_id}"
    if outcome.kind == "fenced_out":
        return f"fenced out (a later holder took it; nothing more written){why}"
    if outcome.kind == "handed_back":
        return "handed back (the worker is shutting down; re-enqueued)"
    if outcome.kind == "aborted":
        return f"aborted{why}"
    if outcome.kind == "stepped_aside":
        if isinstance(cause, DuplicateSequenceError):
            return "stepped aside (another writer wrote first; it drives the run)"
        return "stepped aside (another drive holds its lease)"
    return outcome.kind.replace("_", " ")


@dataclass(slots=True)
class WorkerCounters:
    """What the worker counts beside the kernel's own counters."""

    deliveries: int = 0
    stepped_aside: int = 0
    fenced_out: int = 0
    idle: int = 0
    errors: int = 0
    handed_back: int = 0  # deliveries handed on unopened while draining


class WorkerProcess:
    """The per-process state of a fleet worker.

    Args:
        settings: Read once at process start.
        slot: The prefork pool index of this child (its row in the shared
            stats table), or None in a process that is not a prefork child.
    """

    def __init__(self, settings: FleetSettings, *, slot: int | None = None) -> None:
        if slot is not None and settings.pg_pool_max is None and "pool_max=" not in (
                settings.database_url or ""):
            # A prefork child: one of many pools on one Postgres. It drives the
            # executions of one message at a time (a fleet.drives message carries up
            # to drive_batch): a few connections serve them (decision 0030).
            settings = settings.model_copy(update={"pg_pool_max": max(
                PREFORK_POOL_MAX, settings.pg_pool_min or 0)})
        self.settings = settings
        self.slot = slot
        self.loop = EventLoopThread(f"fleet-loop-{os.getpid()}",
                                    event_loop=settings.event_loop)
        self.counters = WorkerCounters()
        # Forwarded every durable event this process writes.
        self.event_observer: EventObserver | None = None
        self._role: Role | None = None
        self._runtime: Runtime | None = None
        self._store: EventStore | None = None
        self._base: dict[str, stats.Number] = {}
        #: Recent parks on the divergence or in-doubt gate: (executionId, gate, at).
        self.parks: collections.deque[dict[str, Any]] = collections.deque(maxlen=PARKS_KEPT)
        self._draining = False
        # At most worker_drives runs at once in this process, however many drives the
        # messages it holds carry (a fleet.drives message carries several).
        self._slots: asyncio.Semaphore | None = None
        #: Verifies this process's fleet.dispatch messages (its key file watched: one that
        #: cannot be read accepts nothing, issue 25 item 4).
        self.verifier = DispatchVerifier.from_settings(settings)
        #: The operators' keys, watched for the report (the worker's consumer checks them).
        self.control_keys = KeySource.of(settings.control_keys, settings.control_keys_file,
                                         setting="FLEET_CONTROL_KEYS")
        # Taken / done / live marks for the recovery sweeper (decision 0048).
        self.marks: DriveMarks | None = None

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            raise FleetError("the worker process is not open")
        return self._runtime

    def open(self) -> None:
        """Start the loop thread and open the store and the Runtime on it."""
        tracing("worker")  # this process's traces are the worker's (off unless configured)
        self.loop.start()
        try:
            self.loop.run_coroutine(self._open())
        except BaseException:
            self.loop.stop()
            raise
        board = stats.shared_board()
        if board is not None and self.slot is not None:
            self._base = board.read_row(self.slot)
        stats.register_stats_source("dispatch", self.verifier.stats)

    async def _open(self) -> None:
        # The store, the runtime and the heartbeat: built as
        # every role's are (fleet.assembly.roles), started here on the loop.
        worker = (_node or process_name()) + (f"#{self.slot}" if self.slot is not None else "")
        self.marks = DriveMarks.for_settings(self.settings, worker)
        role = await open_worker(self.settings, slot=self.slot,
                                 on_durable_event=self._observe, on_beat=self._poll_drain,
                                 collect=self.report, name=_node)
        started: list[Service] = []
        try:
            for service in start_order(role.services):
                await service.start()
                started.append(service)
        except BaseException:
            for service in reversed(started):
                await service.stop()
            await role.aclose()
            raise
        self._role = role
        self._store = role.store
        self._runtime = role.require_runtime()

    def close(self) -> None:
        """Wait for the runs driven here, close the store, stop the loop."""
        if self.loop.running:
            try:
                self.loop.run_coroutine(self._close(), timeout=60)
            except Exception as exc:  # noqa: BLE001 - shutting down regardless
                log.warning("fleet worker shutdown: %s: %s", type(exc).__name__, exc)
        self.loop.stop()

    async def _close(self) -> None:
        if self._runtime is not None:
            await self._runtime.close()
        marks, self.marks = self.marks, None
        if marks is not None:
            await marks.aclose()
        role, self._role = self._role, None
        if role is None:
            return
        # The heartbeat stops (its file removed), then the store closes.
        for service in reversed(start_order(role.services)):
            try:
                await service.stop()
            except Exception as exc:  # noqa: BLE001 - stopping the rest regardless
                log.warning("stopping %s: %s: %s", service.name, type(exc).__name__, exc)
        await role.aclose()

    # -------------------------------------------------------------- shutdown
    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self, deadline_s: float | None = None) -> None:
        """Let the runs go: at their next durable point, or cut after ``deadline_s``.

        Thread- and signal-safe, idempotent (``fleet.workers.shutdown``).
        ``deadline_s`` defaults to ``settings.worker_drain_s``.
        """
        if self._draining:
            return
        self._draining = True
        deadline = self.settings.worker_drain_s if deadline_s is None else deadline_s
        with contextlib.suppress(RuntimeError):  # the loop has already closed
            self.loop.loop.call_soon_threadsafe(self._drain, deadline)

    def _drain(self, deadline_s: float) -> None:
        runtime = self._runtime
        if runtime is None:
            return
        held = runtime.hand_back()
        log.warning("fleet worker %s shutting down: %d run(s) in flight are handed back at "
                    "their next durable point, any left in %g s where they are", os.getpid(),
                    held, deadline_s)
        asyncio.get_running_loop().call_later(deadline_s, self._cut)

    def _cut(self) -> None:
        runtime = self._runtime
        if runtime is not None and (cut := runtime.hand_back_now()):
            log.warning("fleet worker %s: drain deadline (%g s) passed: %d run(s) handed back "
                        "mid-step (their step is in doubt)", os.getpid(),
                        self.settings.worker_drain_s, cut)

    def _poll_drain(self) -> None:
        # A prefork child learns of the parent's SIGTERM here (once a second).
        if not self._draining and shutdown.drain_requested():
            self.begin_drain()
        if self.marks is not None and not self._draining:
            self.marks.beat()

    # ----------------------------------------------------------------- drive
    def drive(self, execution_id: str, *, traces: Mapping[str, str] | None = None,
              ) -> DriveResult:
        """Drive ``execution_id`` to the end of its run; how it stopped (sync).
        ``traces``: the message's traceparents (``fleet.host.tracing``)."""
        try:
            result: DriveResult = self.loop.run_coroutine(
                self._marked([execution_id], traces=traces))[0]
            return result
        finally:
            self.write_stats_row()

    def drive_many(self, execution_ids: list[str], *,
                   traces: Mapping[str, str] | None = None,
                   on_done: Callable[[], Any] | None = None,
                   ) -> list[str | StoreUnavailableError]:
        """Drive each of ``execution_ids`` at once on the loop (a ``fleet.drives`` message);
        how each run stopped, or the ``StoreUnavailableError`` that stopped its drive (the
        task retries those). Any other error of one drive is logged and reported as
        ``refused``; the others are driven regardless (sync). ``on_done()`` is called on
        the loop as each drive stops (the worker's reservation counts it free)."""
        try:
            return self.loop.run_coroutine(self._marked(execution_ids, many=True,
                                                        traces=traces, on_done=on_done))
        finally:
            self.write_stats_row()

    async def _marked(self, execution_ids: list[str], *, many: bool = False,
                      traces: Mapping[str, str] | None = None,
                      on_done: Callable[[], Any] | None = None) -> list[Any]:
        """The drives of one message, its records marked taken before and done after."""
        marks = self.marks
        if marks is not None:
            marks.taken(execution_ids)
        try:
            if many:
                return await self._drive_many(execution_ids, traces or {}, on_done)
            return [await self.drive_async(execution_ids[0],
                                           (traces or {}).get(execution_ids[0]))]
        finally:
            if marks is not None:
                marks.done(execution_ids)

    async def _drive_many(self, execution_ids: list[str], traces: Mapping[str, str],
                          on_done: Callable[[], Any] | None = None,
                          ) -> list[str | StoreUnavailableError]:
        async def one(execution_id: str) -> DriveResult:
            try:
                return await self.drive_async(execution_id, traces.get(execution_id))
            finally:
                if on_done is not None:
                    on_done()

        answers = await asyncio.gather(*(one(i) for i in execution_ids),
                                       return_exceptions=True)
        out: list[str | StoreUnavailableError] = []
        for execution_id, answer in zip(execution_ids, answers, strict=True):
            if isinstance(answer, (StoreUnavailableError, str)):
                out.append(answer)
            elif isinstance(answer, Exception):
                self.counters.errors += 1
                log.error("drive of %s failed: %s: %s", execution_id, type(answer).__name__,
                          answer)
                out.append(DriveResult(REFUSED, f"refused: {type(answer).__name__}: "
                                                f"{answer}"))
            else:  # a BaseException (cancelled, interrupted): not ours to swallow
                raise answer
        return out

    async def drive_async(self, execution_id: str, trace: str | None = None) -> DriveResult:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.settings.worker_drives)
        async with self._slots:
            with tracing("worker").drive(execution_id, trace):
                return await self._drive_async(execution_id)

    async def _drive_async(self, execution_id: str) -> DriveResult:
        runtime = self.runtime
        self.counters.deliveries += 1
        if self._draining or runtime.handing_back:
            # Shutting down: take nothing; the task hands the message on.
            self.counters.handed_back += 1
            return DriveResult(HANDED_BACK, "handed back (the worker is shutting down; "
                               "re-enqueued)")
        try:
            # The fence is taken by the run's first write, if no live lease holds it.
            handle = await runtime.drive(execution_id, if_free=True, wait=True)
            outcome = await handle.outcome()
        except ExecutionNotFoundError:
            self.counters.errors += 1
            log.warning("drive of %s: no such execution", execution_id)
            return DriveResult(NOT_FOUND, f"no execution {execution_id!r}")
        except StoreUnavailableError:
            raise  # not a refusal: the task retries it (and the sweeper finds it)
        except FleetError as exc:
            # The run was refused before it began (flow not registered here,
            # code mismatch): nothing was written, no fence was taken.
            self.counters.errors += 1
            log.error("drive of %s refused: %s: %s", execution_id, type(exc).__name__, exc)
            return DriveResult(REFUSED, f"refused: {type(exc).__name__}: {exc}")
        assert outcome is not None  # a drive always says how its run ended
        return self._report(outcome)

    def _report(self, outcome: RunOutcome) -> DriveResult:
        execution_id, cause = outcome.execution_id, outcome.cause
        if outcome.kind == "fenced_out":
            self.counters.fenced_out += 1
            log.warning("drive of %s fenced out: a later holder took the execution (%s); "
                        "this drive wrote nothing more", execution_id,
                        f"{type(cause).__name__}: {cause}" if cause else "superseded here")
        elif outcome.kind == "aborted":
            # A write failed, or the kernel stopped the run on a programming fault
            # (it warned through on_warn); nothing more was written.
            log.warning("drive of %s aborted: %s: %s", execution_id, type(cause).__name__,
                        cause)
        elif outcome.kind == "handed_back":
            log.info("drive of %s handed back (the worker is shutting down)", execution_id)
        elif outcome.kind == "nothing_to_do":
            self.counters.idle += 1  # already parked or ended: nothing to do
        elif outcome.kind == "stepped_aside":
            # A live lease: another drive (here or elsewhere) holds the run.
            self.counters.stepped_aside += 1
            log.info("drive of %s stepped aside: %s", execution_id, describe(outcome))
        waiting = outcome.waiting
        if outcome.kind in ("diverged_parked", "parked") and waiting is not None and \
                waiting.on in (DIVERGED_GATE, INDOUBT_GATE):
            self.parks.append({"executionId": execution_id, "gate": waiting.on,
                               "at": round(time.time(), 3)})
        return DriveResult(_REPORTED[outcome.kind], describe(outcome))

    def _observe(self, event: EventEnvelope) -> Any:
        tracer = tracing("worker")
        if tracer.enabled:
            tracer.observe(event)  # steps and the run's end as spans (fleet.host.tracing)
        observer = self.event_observer
        if observer is not None:
            return observer(event)
        return None

    # ----------------------------------------------------------------- stats
    def snapshot(self) -> dict[str, stats.Number]:
        """This process's counters now (kernel's, worker's, registered sources')."""
        values = stats.empty()
        runtime = self._runtime
        if runtime is not None:
            for name in ("drives", "completed", "failed", "parked", "recovered",
                         "timers_fired", "divergence_warnings", "divergence_parked", "aborted",
                         "refused"):
                values[name] = int(getattr(runtime, name))
            values["active"] = runtime.active
        for name in ("deliveries", "stepped_aside", "fenced_out", "idle", "errors"):
            values[name] = getattr(self.counters, name)
        values["handed_back"] = self.counters.handed_back + (
            runtime.handed_back if runtime is not None else 0)
        values.update(stats.source_values())
        return values

    def totals(self) -> dict[str, float]:
        """This process's counters, continuing its prefork row's."""
        values = self.snapshot()
        for name in stats.COUNTERS:
            values[name] = values.get(name, 0) + self._base.get(name, 0)
        return {k: float(v) for k, v in values.items()}

    def problems(self) -> list[str]:
        """What makes this worker unhealthy now: it consumes no fleet queue (its consumer's
        state, ``fleet.workers.consuming``), a key file that cannot be read."""
        found: list[str] = []
        idle = consuming_problem(self.settings)
        if idle is not None:
            found.append(idle)
        for source in (self.verifier.keys, self.control_keys):
            problem = source.check() if source is not None else None
            if problem is not None:
                found.append(problem)
        return found

    def report(self) -> dict[str, Any]:
        """What it reports to Redis: its totals, its recent parks on an operator's gate
        (the Fleet page's "worker" of a diverged execution) and its problems (red)."""
        pool = self.settings.worker_pool
        return {**self.totals(), "parks": list(self.parks), "problems": self.problems(),
                # What `fleet status` shows without inspecting (remote control is the
                # operator console's alone, decision 0042): Celery's names for the pool.
                "pool": "thread" if pool == "threads" else pool,
                "slots": self.settings.worker_drives if pool == "threads" else 1}

    def write_stats_row(self) -> None:
        """Write this child's totals to its row of the prefork stats table (if any)."""
        board = stats.shared_board()
        if board is None or self.slot is None:
            return
        board.write_row(self.slot, self.totals())


# --------------------------------------------------------------------------
# The process's one WorkerProcess.
# --------------------------------------------------------------------------

_process: WorkerProcess | None = None
_process_lock = threading.Lock()
_node: str | None = None


def set_node_name(name: str | None) -> None:
    """The worker's Celery node name (set before a prefork pool forks: children inherit it),
    which names its report to Redis (``fleet:stats:worker:<node>``)."""
    global _node
    _node = name


def local_process() -> WorkerProcess | None:
    """This process's WorkerProcess, if it was opened."""
    return _process


def open_process(settings: FleetSettings, *, slot: int | None = None) -> WorkerProcess:
    """Open this process's WorkerProcess once (later calls return the same one)."""
    global _process
    with _process_lock:
        if _process is None:
            process = WorkerProcess(settings, slot=slot)
            process.open()
            _process = process
            log.info("fleet worker process %s open: flows %s, lease %d ms", os.getpid(),
                     settings.flows, settings.lease_ms)
        return _process


def close_process() -> None:
    """Close this process's WorkerProcess (if open)."""
    global _process
    with _process_lock:
        process, _process = _process, None
    if process is not None:
        process.close()
