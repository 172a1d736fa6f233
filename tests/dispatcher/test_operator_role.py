"""One name per operation, one unit for time, the operator role in the kernel (issue 29.3,
decision 0051).

- ``Runtime.drive(id, if_free=True)`` is the one way to drive only a free execution;
  ``RunOutcome.drove`` says whether it did (``drive_if_free`` is gone).
- ``Runtime.now()`` is a ``datetime``; the kernel's milliseconds stay inside
  (``runtime.engine.clock``).
- The operator role is the kernel's: a principal holding it may read, resume and
  cancel any execution of a tenant it acts for, nothing more, refusals audited.
- ``Dispatcher.retry_diverged`` (and its sync twin) exists beside ``Runtime``'s.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from divergence_kit import Drill, Effects, ab_go_c, dropped_a, parked_ab
from kernel_kit import kinds, settle
from refusals import hidden

from fleet import (
    AccessDeniedError,
    AccessPolicy,
    ConfigurationError,
    MemoryEventStore,
    Principal,
    RunOutcome,
    Runtime,
    SqliteEventStore,
)
from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, producer_app
from fleet.dispatcher.operator import operator_principal
from fleet.kernel.fold import DIVERGED_GATE
from fleet.kernel.security import OPERATOR
from fleet.kernel.store.spi import EventStore

ALICE = Principal("alice", tenant="acme")
OPS = Principal("oncall", scope=frozenset({"*"}), roles=frozenset({OPERATOR}))
ACME_OPS = Principal("acme-oncall", tenant="acme", roles={OPERATOR})  # type: ignore[arg-type]


async def _diverged(store: EventStore) -> tuple[str, Runtime]:
    """An execution of alice's (tenant acme) parked on the divergence gate, and a runtime
    with the edited body (the deploy that made it diverge)."""
    drill, fx = Drill(store), Effects()
    eid = await drill.park(ab_go_c(fx), principal=ALICE)
    runtime = drill.runtime(dropped_a(fx))
    await runtime.resume(eid, "go", "ok", principal=ALICE)
    await settle(runtime)
    summary = await store.get_execution(eid)
    assert summary is not None
    assert (summary.status, summary.waiting_on) == ("parked", DIVERGED_GATE)
    return eid, runtime


def test_roles_are_the_kernels_and_checked() -> None:
    assert OPS.is_operator
    assert not ALICE.is_operator
    assert ACME_OPS.roles == frozenset({OPERATOR})  # a set is taken, kept frozen
    with pytest.raises(ConfigurationError, match="roles"):
        Principal("x", roles=frozenset({"admin"}))
    with pytest.raises(ConfigurationError, match="roles"):
        Principal("x", roles="operator")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="operator op"):
        AccessPolicy(operator_ops=frozenset({"everything"}))


async def test_an_operator_retries_another_owners_diverged_run() -> None:
    store = MemoryEventStore()
    eid, runtime = await _diverged(store)
    with pytest.raises(AccessDeniedError):  # not the owner, no role: refused
        await runtime.retry_diverged(eid, principal=Principal("mallory", tenant="acme"))
    await runtime.retry_diverged(eid, principal=OPS, drive=False)
    log = await store.read(eid)
    assert kinds(log)[-1] == "EXECUTION_RESUMED"
    assert log[-1].payload["gate"] == DIVERGED_GATE
    assert log[-1].payload["by"] == "oncall"  # the audit: who retried
    assert kinds(log).count("EXECUTION_DENIED") == 1  # mallory's refusal, audited


async def test_an_operator_role_stops_at_its_tenants_and_its_ops() -> None:
    store = MemoryEventStore()
    eid, runtime = await _diverged(store)
    other = Principal("globex-oncall", tenant="globex", roles=frozenset({OPERATOR}))
    with hidden():
        await runtime.retry_diverged(eid, principal=other)  # another tenant's run
    with pytest.raises(AccessDeniedError):
        await runtime.send(eid, "note", 1, principal=ACME_OPS)  # send is not an operator op
    state = await runtime.load_state(eid, principal=ACME_OPS)  # read is
    assert state.execution_id == eid
    narrow = Runtime(store, flows=list(runtime.flows),
                     access_policy=AccessPolicy(operator_ops=frozenset({"read"})))
    with pytest.raises(AccessDeniedError):
        await narrow.retry_diverged(eid, principal=ACME_OPS)  # the policy narrowed it
    await (await runtime.cancel(eid, principal=ACME_OPS)).outcome()  # delivered, ended
    summary = await store.get_execution(eid)
    assert summary is not None
    assert summary.status == "cancelled"
    # The two refused resumes are audited (a refused send is not, decision 0007).
    assert kinds(await store.read(eid)).count("EXECUTION_DENIED") == 2


def test_fleet_operator_principal_holds_the_role_for_every_tenant() -> None:
    settings = FleetSettings(database_url="memory:", broker_url="memory://",
                             operator="operator:oncall")
    principal = operator_principal(settings)
    assert principal is not None
    assert principal.is_operator
    assert principal.acts_for("any-tenant")
    assert principal.acts_for(None)
    assert operator_principal(settings.model_copy(update={"operator": None})) is None


async def test_dispatcher_retry_diverged_writes_and_enqueues() -> None:
    store = MemoryEventStore()
    eid, runtime = await _diverged(store)
    settings = FleetSettings(database_url="memory:", broker_url="memory://", flows=[])
    app = producer_app(settings)
    try:
        async with Dispatcher(settings, runtime=runtime, app=app) as dispatcher:
            await dispatcher.retry_diverged(eid, principal=OPS)
            assert dispatcher.enqueued == 1
    finally:
        app.close()
    log = await store.read(eid)
    assert (log[-1].payload["gate"], log[-1].payload["by"]) == (DIVERGED_GATE, "oncall")


def test_dispatcher_retry_diverged_sync_twin(tmp_path: Path) -> None:
    """From sync code, on a dispatcher that opens its own store (a SQLite file)."""
    path = tmp_path / "sync.db"

    async def seed() -> str:
        store = SqliteEventStore(str(path))
        try:
            return (await _diverged(store))[0]
        finally:
            await store.close()
    eid = asyncio.run(seed())
    settings = FleetSettings(database_url=f"sqlite:///{path}", broker_url="memory://",
                             flows=[])
    with Dispatcher(settings) as dispatcher:
        dispatcher.retry_diverged_sync(eid, principal=OPS)
        assert dispatcher.enqueued == 1

    async def last() -> Any:
        store = SqliteEventStore(str(path))
        try:
            return (await store.read(eid))[-1]
        finally:
            await store.close()
    resumed = asyncio.run(last())
    assert (resumed.payload["gate"], resumed.payload["by"]) == (DIVERGED_GATE, "oncall")


async def test_one_drive_name_and_one_unit_for_time() -> None:
    store = MemoryEventStore()
    drill, fx = Drill(store), Effects()
    eid = await parked_ab(drill, fx)
    runtime = drill.runtime(ab_go_c(fx))
    assert not hasattr(runtime, "drive_if_free")
    assert not hasattr(runtime, "clock")
    now = runtime.now()
    assert isinstance(now, datetime)
    assert now.tzinfo is not None
    assert abs((now - datetime.now(UTC)).total_seconds()) < 60
    parked: Any = await (await runtime.drive(eid, if_free=True, wait=True)).outcome()
    assert (parked.kind, parked.drove) == ("nothing_to_do", False)  # parked on "go"
    await runtime.resume(eid, "go", "ok", drive=False)
    holder = await store.acquire_fence(eid, holder="elsewhere", lease_ms=60_000)
    aside: Any = await (await runtime.drive(eid, if_free=True, wait=True)).outcome()
    assert isinstance(aside, RunOutcome)
    assert (aside.kind, aside.drove) == ("stepped_aside", False)
    assert fx.calls == {"a": 1, "b": 1}  # nothing ran
    assert await store.release_fence(eid, holder.token)
    ran = await (await runtime.drive(eid, if_free=True, wait=True)).outcome()
    assert ran is not None
    assert (ran.kind, ran.drove) == ("completed", True)
