"""A fence held for one piece of work: ``async with lease:`` releases it on every exit.

``Lease.take`` supersedes any holder (``acquire_fence``: drive, cancel,
resume_as, the lifecycle's repair); ``Lease.take_if_free`` takes the fence only
when no live lease is held (start, resume, send, timers, the sweeper);
``Lease.deferred`` is taken by its first write under the same rule (a start that
drives, the fleet's workers: decisions 0029, 0032). The block that took it
releases it when it leaves, by
return, exception or cancellation, with two exceptions (decision 0004):

- **A write under it failed and its fate is unknown** (the store became
  unavailable, the write was cancelled mid-flight): the write may have landed,
  so the lease is left to expire and the next holder finds out what did.
- **The writer was fenced out** (``StaleFenceError``): the lease is not ours any
  more; a release would be refused anyway.

A write the store refused outright (a taken slot, a hole, a shape it rejects)
wrote nothing, so the lease is released as usual. ``LogWriter`` and a run's
journal report failed writes with ``write_failed``; ``pass_on`` hands the fence
to whoever continues the work (a run), and that one's ``async with`` releases it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any

from fleet.kernel.errors import (
    DuplicateSequenceError,
    SequenceGapError,
    StaleFenceError,
    ValidationError,
)
from fleet.kernel.observers import Warner
from fleet.kernel.store.spi import EventStore, FenceGrant

# A store that raises one of these refused the write before writing anything.
_REFUSED_OUTRIGHT = (DuplicateSequenceError, SequenceGapError, ValidationError)


def keeps_lease(exc: BaseException) -> bool:
    """Whether a writer whose write raised ``exc`` must leave its lease to expire.

    True when the write was fenced out (not our lease any more) or interrupted
    (it may have landed); False when the store refused it outright.
    """
    if isinstance(exc, StaleFenceError):
        return True
    return not isinstance(exc, _REFUSED_OUTRIGHT)


class Lease:
    """The fence of one execution, held by one block of work (an async context manager).

    Args:
        store: The store the fence lives in.
        grant: What ``acquire_fence`` / ``acquire_fence_if`` returned.
        warner: Where a failed release is reported (the lease then expires on its own).
    """

    __slots__ = ("_done", "_wanted", "grant", "kept", "renewal", "store", "warner")

    def __init__(self, store: EventStore, grant: FenceGrant | None, *, warner: Warner,
                 wanted: tuple[str, str, int] | None = None) -> None:
        if grant is None and wanted is None:
            raise ValueError("a lease is a grant, or the fence its first write takes")
        self.store = store
        # None: not taken yet; the first write under this lease takes it (``deferred``).
        self.grant = grant
        self.warner = warner
        # (execution id, holder, lease_ms) of a deferred lease.
        self._wanted = wanted
        # Why the lease is left to expire (a write under it failed that way), or None.
        self.kept: BaseException | None = None
        self._done = False
        # The run's renewal (``keep_alive``): a heartbeat step narrows it (decision 0053).
        self.renewal: Renewal | None = None

    @classmethod
    def deferred(cls, store: EventStore, execution_id: str, *, holder: str, lease_ms: int,
                 warner: Warner) -> Lease:
        """A lease whose first write takes the fence (``append_acquiring``, decision 0029):
        one round trip for the fence and the write. Until then it holds nothing."""
        return cls(store, None, warner=warner, wanted=(execution_id, holder, lease_ms))

    @property
    def wanted(self) -> tuple[str, str, int]:
        """(execution id, holder, lease_ms) for the write that takes a deferred lease."""
        assert self._wanted is not None
        return self._wanted

    def granted(self, grant: FenceGrant, *, released: bool = False) -> None:
        """The first write took the fence (and, with ``released``, ended the lease too)."""
        self.grant = grant
        self._done = self._done or released

    async def take_deferred(self) -> bool:
        """Take a deferred lease now, alone (``acquire_fence_if``): for a run that must
        hold its fence before code that acts outside a step runs and has nothing to
        write yet (decision 0032). False when a live lease is held (nothing taken)."""
        execution_id, holder, lease_ms = self.wanted
        grant = await self.store.acquire_fence_if(execution_id, holder=holder,
                                                  lease_ms=lease_ms)
        if grant is None:
            return False
        self.grant = grant
        return True

    def released_by_write(self) -> None:
        """The last write under this lease ended it (``append_releasing``)."""
        self._done = True

    @classmethod
    async def take(cls, store: EventStore, execution_id: str, *, holder: str, lease_ms: int,
                   warner: Warner) -> Lease:
        """Take the fence, superseding whoever holds it."""
        grant = await store.acquire_fence(execution_id, holder=holder, lease_ms=lease_ms)
        return cls(store, grant, warner=warner)

    @classmethod
    async def take_if_free(cls, store: EventStore, execution_id: str, *, holder: str,
                           lease_ms: int, warner: Warner) -> Lease | None:
        """Take the fence only when no live lease is held; ``None`` when one is."""
        grant = await store.acquire_fence_if(execution_id, holder=holder, lease_ms=lease_ms)
        return None if grant is None else cls(store, grant, warner=warner)

    @property
    def execution_id(self) -> str:
        return self.grant.execution_id if self.grant is not None else self.wanted[0]

    @property
    def token(self) -> int:
        if self.grant is None:
            raise RuntimeError(f"the lease of {self.execution_id!r} is not taken yet: its "
                               "first write takes it")
        return self.grant.token

    @property
    def released(self) -> bool:
        """Whether this lease has let go (released, kept to expire, or passed on)."""
        return self._done

    def write_failed(self, exc: BaseException) -> None:
        """A write under this lease raised ``exc``: keep the lease if its fate is unknown."""
        if self.kept is None and keeps_lease(exc):
            self.kept = exc

    def pass_on(self) -> Lease:
        """Hand the fence to whoever continues the work; this lease then lets go of nothing."""
        self._done = True
        return Lease(self.store, self.grant, warner=self.warner, wanted=self._wanted)

    async def release(self) -> None:
        """Release the fence now (once), unless a failed write keeps it (see the module)."""
        if self._done:
            return
        self._done = True
        if self.kept is not None or self.grant is None:
            return  # kept to expire, or never taken
        try:
            await self.store.release_fence(self.grant.execution_id, self.grant.token)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            self.warner.warn(f"could not release the lease of {self.grant.execution_id!r}: "
                             f"{type(exc).__name__}: {exc} (it expires on its own)",
                             key="release")

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.release()

    def keep_alive(self, *, lease_ms: int, alive: Callable[[], bool],
                   tasks: set[asyncio.Task[Any]],
                   on_lost: Callable[[], None] | None = None) -> Renewal:
        """Renew this lease every ``lease_ms / 3`` while ``alive()``; ``stop()`` the result.
        ``on_lost`` is called when a renewal finds the fence taken by another holder."""
        self.renewal = Renewal(self, lease_ms=lease_ms, alive=alive, tasks=tasks,
                               on_lost=on_lost)
        return self.renewal

    def __repr__(self) -> str:
        token = "deferred" if self.grant is None else self.grant.token
        return f"Lease({self.execution_id!r}, token={token})"


class Renewal:
    """Renews a lease on a loop timer (no task per run) until ``stop``.

    A renewal lost to a store outage is warned, not fatal: the run's next write
    fails too, or the lease lapses and the next holder fences the run out. A
    renewal the store refuses (another holder took the fence: a cancel, a recovery)
    calls ``on_lost``, so the run stops now instead of at its next write.

    While a step with ``heartbeat=`` runs, ``narrow`` holds the lease to its
    heartbeat timeout (when shorter), so a dead worker's lease lapses that soon
    (decision 0053); ``widen`` gives it its own length back. Both renew at once.
    """

    __slots__ = ("_alive", "_handle", "_interval", "_lease", "_lease_ms", "_loop", "_narrowed",
                 "_on_lost", "_own_ms", "_tasks")

    def __init__(self, lease: Lease, *, lease_ms: int, alive: Callable[[], bool],
                 tasks: set[asyncio.Task[Any]],
                 on_lost: Callable[[], None] | None = None) -> None:
        self._on_lost = on_lost
        self._lease = lease
        self._lease_ms = self._own_ms = lease_ms
        self._narrowed: list[int] = []
        self._alive = alive
        self._tasks = tasks
        self._interval = lease_ms / 3000
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.Handle | None = self._loop.call_later(self._interval, self._beat)

    def narrow(self, lease_ms: int) -> None:
        """Hold the lease to at most ``lease_ms`` until ``widen(lease_ms)``."""
        self._narrowed.append(lease_ms)
        self._resize()

    def widen(self, lease_ms: int) -> None:
        """Undo one ``narrow(lease_ms)``."""
        self._narrowed.remove(lease_ms)
        self._resize()

    def _resize(self) -> None:
        length = min(self._own_ms, *self._narrowed) if self._narrowed else self._own_ms
        if length == self._lease_ms:
            return
        self._lease_ms = length
        self._interval = length / 3000
        if self._handle is not None:  # renew at once with the new length, then every third
            self._handle.cancel()
            self._handle = self._loop.call_soon(self._beat)

    def _beat(self) -> None:
        if self._handle is None or not self._alive():
            return
        grant = self._lease.grant
        if grant is None or self._lease.released:  # not taken yet, or ended by a write
            self._handle = self._loop.call_later(self._interval, self._beat)
            return
        task = self._loop.create_task(self._lease.store.renew_lease(
            grant.execution_id, grant.token, lease_ms=self._lease_ms))
        self._tasks.add(task)
        task.add_done_callback(self._renewed)
        self._handle = self._loop.call_later(self._interval, self._beat)

    def _renewed(self, task: asyncio.Task[bool]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        if (exc := task.exception()) is not None:
            self._lease.warner.warn(
                f"could not renew the lease of {self._lease.execution_id!r}: "
                f"{type(exc).__name__}: {exc}", key="renew")
        elif task.result() is False and self._handle is not None \
                and not self._lease.released and self._on_lost is not None:
            self._on_lost()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._lease.renewal is self:
            self._lease.renewal = None  # no cycle left for the collector (lease <-> renewal)
