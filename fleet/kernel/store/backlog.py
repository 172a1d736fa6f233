"""The store's backlog: what waits for a worker and for the timer service (decision 0046).

``ReportsBacklog`` is an optional capability of an ``EventStore`` (``spi``): the
runnable executions no live lease holds and the timers due, per flow and tenant,
and how many executions are parked on each gate asked for, read from the index
(never a fold). Memory, SQLite and Postgres have it, and the forwarding decorators
pass it on; ``conformance_backlog`` is its kit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from fleet.kernel.errors import ValidationError
from fleet.kernel.values import check_ms, check_text

__all__ = ["Backlog", "BacklogGroup", "ReportsBacklog", "backlog_groups", "check_backlog"]


@dataclass(frozen=True, slots=True)
class BacklogGroup:
    """What waits, for one flow and tenant (``ReportsBacklog.backlog``).

    ``unowned``: runnable executions (status ``running``) with no live lease: queued
    for a worker, taken by none yet, or left by a holder whose lease expired.
    ``unowned_since``: since when the oldest of them has waited (ms; its last write,
    or its lease's expiry if that is later). ``timers_due``: scheduled timers due and
    not fired; ``due_since``: the oldest one's due time (ms).
    """

    flow_id: str
    tenant: str | None
    unowned: int = 0
    unowned_since: int | None = None
    timers_due: int = 0
    due_since: int | None = None


@dataclass(frozen=True, slots=True)
class Backlog:
    """``ReportsBacklog.backlog``'s answer: the groups with anything waiting, and how many
    executions are parked now on each gate asked for (0 included)."""

    groups: tuple[BacklogGroup, ...]
    parked: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class ReportsBacklog(Protocol):
    """Optional: a store that reads its backlog from the index, without a fold.

    The fleet's metrics and autoscaling use it (decision 0046): its cost grows with
    the executions waiting (index rows), never with their logs.
    """

    async def backlog(self, now_ms: int, *, gates: Sequence[str] = ()) -> Backlog:
        """What waits at ``now_ms`` (groups with nothing waiting are left out), and
        ``{gate: executions parked on it}`` for each of ``gates``."""
        ...


def check_backlog(now_ms: int, gates: Sequence[str]) -> tuple[str, ...]:
    """``backlog``'s arguments checked alike on every store; the gates, each once."""
    check_ms(now_ms, "now_ms")
    if isinstance(gates, str):
        raise ValidationError("gates is a sequence of gate names, not one string")
    for gate in gates:
        check_text(gate, "gate")
    return tuple(dict.fromkeys(gates))


def backlog_groups(rows: Iterable[tuple[str, str | None, int, int | None, int, int | None]]
                   ) -> tuple[BacklogGroup, ...]:
    """``(flow, tenant, unowned, since, due, due since)`` rows (several per group allowed)
    merged into groups, ordered by flow and tenant."""
    merged: dict[tuple[str, str | None], list[Any]] = {}
    for flow_id, tenant, unowned, since, due, due_since in rows:
        group = merged.setdefault((flow_id, tenant), [0, None, 0, None])
        group[0] += unowned
        group[2] += due
        if since is not None:
            group[1] = since if group[1] is None else min(group[1], since)
        if due_since is not None:
            group[3] = due_since if group[3] is None else min(group[3], due_since)
    return tuple(BacklogGroup(flow, tenant, int(g[0]), g[1], int(g[2]), g[3])
                 for (flow, tenant), g in sorted(merged.items(),
                                                 key=lambda kv: (kv[0][0], kv[0][1] or ""))
                 if g[0] or g[2])
