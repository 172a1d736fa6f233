"""The counters a worker reports (the bootstep that shows them is ``fleet.workers.bootstep``).

``celery inspect stats`` (and so Flower's worker page, tab "Other", and its
``/api/workers``) merges the ``info()`` of every worker bootstep into the
stats it answers; ``FleetStatsStep.info`` adds ``{"fleet": {...}}``:

=======================  ===================================================
drives                   runs started on this worker (the kernel's count)
completed / failed       runs that ended the execution
parked                   runs that parked it (gate, timer, receive, in-doubt)
stepped_aside            deliveries that found a live lease and left it alone
fenced_out               runs whose writes were refused (StaleFenceError)
recovered                drives that resumed a run a dead holder left
timers_fired             timers this worker fired
divergence_warnings      replay divergences reported (warn mode)
divergence_parked        runs parked on the divergence gate
handed_back              runs let go at shutdown (lease released, re-enqueued)
outcomes_attached        late outcomes attached (the reward attacher, if here)
outcomes_dead_lettered   reward messages dead-lettered (the attacher, if here)
dispatch_refused         fleet.dispatch messages refused (forged, unsigned,
                         expired, replayed, out of scope...; the log says why)
dispatch_accepted        fleet.dispatch messages verified and carried out
=======================  ===================================================

and ``deliveries``, ``idle`` (nothing to do: already parked or ended),
``aborted``, ``errors``, ``active`` (runs in flight now).

**The hook for the stream services.** The last two come from a service that
may run in the worker process (the reward attacher): such a service calls
``register_stats_source(name, fn)`` where ``fn()`` returns a mapping of those
keys; until one does, they read 0. (The events stream's lag is the relay's:
``fleet relay`` reports it, not the workers.)

**Prefork.** Tasks run in child processes, but ``inspect stats`` is answered by
the parent. Each child publishes its totals after every task into its own row
of a shared-memory table the parent allocated before forking (one writer per
row, no lock); the parent sums the rows. A child that replaces a dead one
continues its row. With the threads pool (fleet's choice, decision 0012) the
parent reads the live counters directly.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Mapping
from typing import Any

Number = int | float
StatsSource = Callable[[], Mapping[str, Number]]

COUNTERS: tuple[str, ...] = (
    "drives", "completed", "failed", "parked", "stepped_aside", "fenced_out", "recovered",
    "timers_fired", "divergence_warnings", "divergence_parked", "outcomes_attached",
    "outcomes_dead_lettered", "deliveries", "idle", "aborted", "errors", "handed_back",
    "dispatch_refused", "dispatch_accepted", "refused")
# Gauges: read as they are now, never summed over time.
GAUGES: tuple[str, ...] = ("active",)
FIELDS: tuple[str, ...] = COUNTERS + GAUGES

_sources: dict[str, StatsSource] = {}
_sources_lock = threading.Lock()


def register_stats_source(name: str, source: StatsSource) -> None:
    """Add counters from a service running in this process (replaces ``name``'s).

    ``source()`` returns a mapping with any of ``outcomes_attached``,
    ``outcomes_dead_lettered`` (or other numeric keys, which are reported as
    they are). It is called when stats are asked for
    and must not block.
    """
    with _sources_lock:
        _sources[name] = source


def unregister_stats_source(name: str) -> None:
    with _sources_lock:
        _sources.pop(name, None)


def source_values() -> dict[str, Number]:
    """What the registered sources report now; a failing source is skipped."""
    out: dict[str, Number] = {}
    with _sources_lock:
        sources = list(_sources.values())
    for source in sources:
        try:
            for key, value in source().items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out[key] = out.get(key, 0) + value if key in COUNTERS else value
        except Exception:  # noqa: BLE001 - a broken source must not break stats
            continue
    return out


def empty() -> dict[str, Number]:
    return dict.fromkeys(FIELDS, 0)


class SharedBoard:
    """Per-child rows of counters in shared memory (prefork only).

    Allocated by the parent before the pool forks; row ``i`` is written only
    by the child with pool index ``i``.
    """

    def __init__(self, slots: int) -> None:
        self.slots = max(1, slots)
        width = len(FIELDS)
        self._width = width
        self._cells: Any = multiprocessing.RawArray("d", self.slots * width)

    def read_row(self, slot: int) -> dict[str, Number]:
        base = (slot % self.slots) * self._width
        return {name: self._cells[base + i] for i, name in enumerate(FIELDS)}

    def write_row(self, slot: int, values: Mapping[str, Number]) -> None:
        base = (slot % self.slots) * self._width
        for i, name in enumerate(FIELDS):
            self._cells[base + i] = float(values.get(name, 0))

    def total(self) -> dict[str, Number]:
        out = empty()
        for slot in range(self.slots):
            row = self.read_row(slot)
            for name in COUNTERS:
                out[name] += row[name]
            out["active"] += row["active"]
        return {k: int(v) for k, v in out.items()}


_board: SharedBoard | None = None


def shared_board() -> SharedBoard | None:
    """The prefork table, in the parent and (inherited) in every child."""
    return _board


def install_board(board: SharedBoard | None) -> None:
    global _board
    _board = board


__all__ = ["COUNTERS", "FIELDS", "GAUGES", "Number", "SharedBoard", "StatsSource", "empty",
           "install_board", "register_stats_source", "shared_board", "source_values",
           "unregister_stats_source"]
