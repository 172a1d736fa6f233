"""A worker's graceful shutdown: stop taking drives, hand the running ones back.

On SIGTERM (a pod deleted, a rollout, a scale-down, a node drain) Celery starts
a warm shutdown: it stops consuming and waits for the tasks it runs. A drive
runs until its run parks or ends, which can take longer than the pod's
``terminationGracePeriodSeconds``; the kubelet's SIGKILL would then leave the
execution to its lease expiry and the recovery sweeper, as after a crash. So on
Celery's ``worker_shutting_down`` a fleet worker:

1. hands its runs back (``Runtime.hand_back``): each stops where it would
   start new work, a durable point; it writes what it committed and releases
   its lease;
2. after ``FLEET_WORKER_DRAIN_S`` (20 s) cancels the runs still inside a long
   step (``Runtime.hand_back_now``): that step is left in doubt, and the lease
   is released all the same;
3. each ``fleet.drive`` task whose run was let go publishes a new drive of the
   execution (same route) before it returns and its message is acknowledged,
   so another worker takes it over at once rather than after the lease TTL.

A delivery that arrives while the worker drains is handed on the same way,
without taking the fence.

Prefork: the signal reaches the parent only. The parent sets a flag in shared
memory that it allocated before the pool forked, and the heartbeat of each
child's loop polls it every second.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

_flag: Any = None


def install() -> None:
    """Allocate the drain flag (in the worker's parent, before the pool forks)."""
    global _flag
    if _flag is None:
        _flag = multiprocessing.RawValue("b", 0)


def request_drain() -> None:
    """Ask this worker and its children to drain (signal-safe: one store to memory)."""
    if _flag is not None:
        _flag.value = 1


def drain_requested() -> bool:
    """Whether the worker this process belongs to is shutting down."""
    return _flag is not None and bool(_flag.value)


def reset() -> None:
    """Forget the flag (tests that open several workers in one process)."""
    global _flag
    _flag = None


__all__ = ["drain_requested", "install", "request_drain", "reset"]
