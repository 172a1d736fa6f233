"""The conformance kit of ``ReportsBacklog`` (an optional capability; decision 0046).

A store that reads its backlog (``backlog``) adds ``BacklogConformance`` to its
test class beside ``EventStoreConformance`` (the same ``store`` fixture and
``pass_time``). What is unowned (runnable, no live lease), since when, which
timers are due, how many executions are parked on each gate asked for, and the
refusals of bad arguments are the same on every store.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest

from fleet.kernel.errors import ValidationError
from fleet.kernel.events import EventType
from fleet.kernel.store.backlog import Backlog, BacklogGroup, ReportsBacklog
from fleet.kernel.store.conformance_events import HOSTILE_STRINGS, T0, make_event, started
from fleet.kernel.store.spi import EventStore

__all__ = ["BacklogConformance"]

E = EventType


def _backlog(store: EventStore) -> ReportsBacklog:
    assert isinstance(store, ReportsBacklog), f"{type(store).__name__} has no backlog()"
    return store


def _groups(backlog: Backlog) -> dict[tuple[str, str | None], BacklogGroup]:
    return {(g.flow_id, g.tenant): g for g in backlog.groups}


class BacklogConformance:
    """What ``backlog`` must answer on every store that has it."""

    lease_ms: ClassVar[int] = 250

    async def pass_time(self, ms: int) -> None:
        await asyncio.sleep(ms / 1000)

    async def test_backlog_counts_runnable_executions_without_a_live_lease(
            self, store: EventStore) -> None:
        for eid in ("q1", "q2"):
            await store.append(started(eid, flow_id="f1"))
        await store.append(started("q3", flow_id="f1", timestamp=T0 + 40))
        await store.append(started("other", flow_id="f2", tenant=None, timestamp=T0 + 7))
        await store.append(started("held", flow_id="f1"))
        held = await store.acquire_fence("held", holder="w1", lease_ms=60_000)
        await store.append(started("parked", flow_id="f1"))
        await store.append(make_event("parked", 1, E.EXECUTION_SUSPENDED))
        await store.append(started("done", flow_id="f1"))
        await store.append(make_event("done", 1, E.EXECUTION_COMPLETED))
        now = held.lease_expires_at - 60_000
        answer = await _backlog(store).backlog(now, gates=["approval", "nobody-waits"])
        groups = _groups(answer)
        assert set(groups) == {("f1", "acme"), ("f2", None)}
        assert (groups["f1", "acme"].unowned, groups["f1", "acme"].unowned_since) == (3, T0)
        assert (groups["f2", None].unowned, groups["f2", None].unowned_since) == (1, T0 + 7)
        assert groups["f1", "acme"].timers_due == 0
        assert groups["f1", "acme"].due_since is None
        assert answer.parked == {"approval": 1, "nobody-waits": 0}
        # A holder's lease runs out: its execution waits again, since the lease's end.
        await store.release_fence("held", held.token)
        taken = await store.acquire_fence("held", holder="w2", lease_ms=self.lease_ms)
        assert (await _backlog(store).backlog(now)).groups == answer.groups
        await self.pass_time(self.lease_ms + 50)
        later = taken.lease_expires_at + 50
        group = _groups(await _backlog(store).backlog(later))["f1", "acme"]
        assert group.unowned == 4
        assert group.unowned_since == T0  # q1's is still the oldest
        await store.append(make_event("q1", 1, E.EXECUTION_COMPLETED))
        await store.append(make_event("q2", 1, E.EXECUTION_COMPLETED))
        group = _groups(await _backlog(store).backlog(later))["f1", "acme"]
        assert group.unowned == 2
        assert group.unowned_since == T0 + 40  # q3 (started at T0 + 40) < the lease's end

    async def test_backlog_counts_due_timers_until_they_fire(self, store: EventStore) -> None:
        await store.append(started("sleeper", flow_id="naps", tenant="t1"))
        await store.append(make_event("sleeper", 1, E.TIMER_SCHEDULED,
                                      {"timerId": "nap", "dueAt": T0 + 1_000}))
        await store.append(make_event("sleeper", 2, E.EXECUTION_SUSPENDED, {
            "condition": {"on": "nap", "kind": "timer"}}))
        await store.append(started("early", flow_id="naps", tenant="t1"))
        await store.append(make_event("early", 1, E.TIMER_SCHEDULED,
                                      {"timerId": "t", "dueAt": T0 + 500}))
        await store.append(make_event("early", 2, E.TIMER_SCHEDULED,
                                      {"timerId": "u", "dueAt": T0 + 5_000}))
        await store.append(make_event("early", 3, E.EXECUTION_SUSPENDED, {
            "condition": {"on": "t", "kind": "timer"}}))
        reader = _backlog(store)
        assert (await reader.backlog(T0 + 499)).groups == ()
        (group,) = (await reader.backlog(T0 + 1_000)).groups
        assert (group.flow_id, group.tenant) == ("naps", "t1")
        assert (group.timers_due, group.due_since, group.unowned) == (2, T0 + 500, 0)
        await store.append(make_event("early", 4, E.TIMER_FIRED, {"timerId": "t"}))
        (group,) = (await reader.backlog(T0 + 1_000)).groups
        # Fired: runnable now (no lease), and the other timer is not due yet.
        assert (group.timers_due, group.due_since) == (1, T0 + 1_000)
        assert (group.unowned, group.unowned_since) == (1, T0 + 4)
        await store.append(make_event("sleeper", 3, E.EXECUTION_CANCELLED))
        (group,) = (await reader.backlog(T0 + 10_000)).groups
        assert (group.timers_due, group.due_since) == (1, T0 + 5_000)  # cancelled: cleared

    async def test_backlog_keeps_hostile_flow_ids_tenants_and_gates_exactly(
            self, store: EventStore) -> None:
        for i, text in enumerate(HOSTILE_STRINGS):
            await store.append(started(f"h{i}", flow_id=text, tenant=text))
            await store.append(started(f"p{i}", flow_id="f"))
            await store.append(make_event(f"p{i}", 1, E.EXECUTION_SUSPENDED, {
                "condition": {"on": text, "kind": "gate"}}))
        answer = await _backlog(store).backlog(T0 + 1, gates=list(HOSTILE_STRINGS))
        assert {(g.flow_id, g.tenant, g.unowned) for g in answer.groups} == {
            (text, text, 1) for text in HOSTILE_STRINGS}
        assert answer.parked == dict.fromkeys(HOSTILE_STRINGS, 1)
        # A gate that only shares a long prefix with one that is waited on: none.
        assert (await _backlog(store).backlog(T0 + 1, gates=["k" * 10_239 + "x"])).parked == {
            "k" * 10_239 + "x": 0}

    async def test_backlog_refuses_bad_arguments(self, store: EventStore) -> None:
        reader = _backlog(store)
        for now in (2**63, "soon", 1.5, True):
            with pytest.raises(ValidationError):
                await reader.backlog(now)  # type: ignore[arg-type]
        for gates in ("approval", ["a\x00b"], [7], ["\ud800"]):
            with pytest.raises(ValidationError):
                await reader.backlog(T0, gates=gates)  # type: ignore[arg-type]
        assert await reader.backlog(T0, gates=["g", "g"]) == Backlog((), {"g": 0})
