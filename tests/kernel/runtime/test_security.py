"""Principal and AccessPolicy: defaults, widening, strict, denials and their audit.

A principal refused an op on an execution it may not even read is told that the
execution does not exist, word for word as for an id with no log (issue 25 item 11:
no existence oracle); ``hidden`` below expects that.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
from kernel_kit import ManualClock, dumped, kinds, settle, started

from fleet import (
    AccessDeniedError,
    AccessPolicy,
    ConfigurationError,
    Context,
    Decision,
    ExecutionNotFoundError,
    FleetError,
    Policy,
    Principal,
    Runtime,
    flow,
)
from fleet.kernel.store.spi import EventStore

ALICE = Principal("alice", tenant="acme")
BOB = Principal("bob", tenant="acme")  # same tenant, not the owner
EVE = Principal("eve", tenant="evil")  # another tenant


@flow("guarded")
async def guarded(ctx: Context, _: Any) -> Any:
    first = await ctx.wait("approve")
    second = await ctx.receive("note")
    return [first, second]


@contextlib.contextmanager
def hidden(execution_id: str, because: str = "") -> Iterator[None]:
    """The refusal of one who may not read ``execution_id``: "no execution", exactly as
    for an id with no log; the denial (its reason matching ``because``) is its cause."""
    with pytest.raises(ExecutionNotFoundError) as refused:
        yield
    assert str(refused.value) == f"no execution {execution_id!r}"
    assert isinstance(refused.value.__cause__, AccessDeniedError)
    assert re.search(because, str(refused.value.__cause__))


def _runtime(store: EventStore, **kw: Any) -> tuple[Runtime, list[dict[str, Any]]]:
    denied: list[dict[str, Any]] = []
    return Runtime(store, flows=[guarded], on_execution_denied=denied.append, **kw), denied


async def test_owner_is_recorded_on_start(store: EventStore) -> None:
    runtime, _ = _runtime(store)
    eid = await started(runtime, "guarded", principal=ALICE)
    first = (await store.read(eid))[0]
    assert first.payload["owner"] == {"actor": "alice", "tenant": "acme"}
    summary = await store.get_execution(eid)
    assert summary is not None
    assert (summary.owner, summary.tenant) == ("alice", "acme")


async def test_start_is_open_to_any_principal(store: EventStore) -> None:
    runtime, denied = _runtime(store, access_policy=AccessPolicy(rules={"resume": "owner"}))
    for who in (ALICE, EVE, None):
        await runtime.start("guarded", principal=who)
    await settle(runtime)
    assert denied == []


async def test_defaults_owner_for_resume_tenant_for_read(clocked_store: EventStore,
                                                         clock: ManualClock) -> None:
    store = clocked_store
    runtime, denied = _runtime(store, clock=clock)
    eid = await started(runtime, "guarded", principal=ALICE)

    # read: the tenant may, another tenant may not.
    assert (await runtime.load_state(eid, principal=BOB)).status == "parked"
    with hidden(eid, "tenant"):
        await runtime.load_state(eid, principal=EVE)
    # resume: owner only; a same-tenant colleague (who may read it) is refused.
    with pytest.raises(AccessDeniedError, match="owner-only"):
        await runtime.resume(eid, "approve", 1, principal=BOB)
    await runtime.resume(eid, "approve", 1, principal=ALICE)
    await settle(runtime)
    # send: owner only.
    with pytest.raises(AccessDeniedError):
        await runtime.send(eid, "note", "x", principal=BOB)
    await runtime.send(eid, "note", "x", principal=ALICE)
    assert await runtime.result(eid) == [1, "x"]
    assert [d["op"] for d in denied] == ["read", "resume", "send"]
    assert denied[1] == {"executionId": eid, "op": "resume", "actor": "bob", "tenant": "acme",
                         "reason": denied[1]["reason"]}


async def test_cancel_is_owner_only_by_default(store: EventStore) -> None:
    runtime, _ = _runtime(store)
    eid = await started(runtime, "guarded", principal=ALICE)
    with pytest.raises(AccessDeniedError):
        await runtime.cancel(eid, principal=BOB)
    assert (await runtime.load_state(eid, principal=ALICE)).status == "parked"
    await (await runtime.cancel(eid, principal=ALICE)).outcome()
    assert (await runtime.load_state(eid, principal=ALICE)).status == "cancelled"


async def test_tenant_rule_widens_resume(store: EventStore) -> None:
    runtime, _ = _runtime(store, access_policy=AccessPolicy(rules={"resume": "tenant"}))
    eid = await started(runtime, "guarded", principal=ALICE)
    with hidden(eid, "tenant"):
        await runtime.resume(eid, "approve", 1, principal=EVE)
    await runtime.resume(eid, "approve", "by bob", principal=BOB)
    await settle(runtime)
    # Only resume was widened: send stays owner-only.
    with pytest.raises(AccessDeniedError):
        await runtime.send(eid, "note", 1, principal=BOB)
    resumed = [e for e in await store.read(eid) if str(e.type) == "EXECUTION_RESUMED"]
    assert resumed[0].payload["by"] == "bob"


async def test_any_rule_opens_an_op_to_every_principal(store: EventStore) -> None:
    runtime, _ = _runtime(store, access_policy=AccessPolicy(rules={"resume": "any",
                                                                   "read": "any"}))
    eid = await started(runtime, "guarded", principal=ALICE)
    assert (await runtime.load_state(eid, principal=EVE)).status == "parked"
    await runtime.resume(eid, "approve", 1, principal=EVE)
    await settle(runtime)


async def test_a_scope_is_what_the_tenant_rule_judges(store: EventStore) -> None:
    """Decision 0025: a service principal acting for several tenants (a reward producer)
    may act on exactly the tenants of its scope; "*" is every tenant and also none; the
    owner rule ignores a scope; a refusal is counted and reported like any other."""
    runtime, denied = _runtime(store, access_policy=AccessPolicy(rules={"read": "tenant",
                                                                        "resume": "owner"}))
    acme = await started(runtime, "guarded", principal=ALICE)
    evil = await started(runtime, "guarded", principal=EVE)
    nobody = await started(runtime, "guarded", principal=None)
    both = Principal("svc", scope=frozenset({"acme", "evil"}))
    one = Principal("svc", tenant="evil", scope={"acme"})  # the scope, not the tenant, counts
    every = Principal("ops", scope=frozenset({"*"}))
    allowed = [(both, acme), (both, evil), (one, acme), (every, acme), (every, evil),
               (every, nobody)]
    refused = [(both, nobody), (one, evil), (one, nobody)]
    for who, eid in allowed:
        assert (await runtime.load_state(eid, principal=who)).execution_id == eid
    for who, eid in refused:
        with hidden(eid, "may act for"):
            await runtime.load_state(eid, principal=who)
    assert [(d["executionId"], d["actor"]) for d in denied] == [
        (eid, who.actor) for who, eid in refused]
    assert runtime.denied == len(refused)
    with pytest.raises(AccessDeniedError, match="owner-only"):  # a scope makes no owner
        await runtime.resume(acme, "approve", 1, principal=every)
    assert isinstance(one.scope, frozenset)


@pytest.mark.parametrize("scope", ["acme", {"acme", ""}, {None}, b"acme"])
def test_a_scope_is_a_set_of_tenant_names(scope: Any) -> None:
    with pytest.raises(ConfigurationError, match="set of tenant names"):
        Principal("svc", scope=scope)


@pytest.mark.parametrize("strict_via", ["runtime", "policy"])
async def test_strict_refuses_calls_without_a_principal(store: EventStore,
                                                        strict_via: str) -> None:
    kw: dict[str, Any] = ({"strict": True} if strict_via == "runtime"
                          else {"access_policy": AccessPolicy(strict=True)})
    runtime, denied = _runtime(store, **kw)
    with pytest.raises(AccessDeniedError, match="strict"):
        await runtime.start("guarded")
    assert await store.list_executions() == []
    eid = await started(runtime, "guarded", principal=ALICE)
    for call in (runtime.resume(eid, "approve", 1), runtime.send(eid, "note", 1),
                 runtime.load_state(eid), runtime.cancel(eid)):
        with hidden(eid, "strict"):  # strict: without a principal it may not read either
            await call
    assert [d["op"] for d in denied] == ["start", "resume", "send", "read", "cancel"]
    assert (await runtime.load_state(eid, principal=ALICE)).status == "parked"


async def test_a_denied_resume_or_cancel_is_audited_on_the_log(clocked_store: EventStore,
                                                               clock: ManualClock) -> None:
    store = clocked_store
    runtime, denied = _runtime(store, clock=clock)
    eid = await started(runtime, "guarded", principal=ALICE)
    with hidden(eid):  # EVE may not read it; BOB may, and hears "denied"
        await runtime.resume(eid, "approve", 1, principal=EVE)
    with pytest.raises(AccessDeniedError):
        await runtime.cancel(eid, principal=BOB)
    log = await store.read(eid)
    audits = [e for e in log if str(e.type) == "EXECUTION_DENIED"]
    assert [(a.payload["op"], a.payload["actor"], a.payload["tenant"]) for a in audits] == [
        ("resume", "eve", "evil"), ("cancel", "bob", "acme")]
    assert all(a.kernel for a in audits)
    assert [d["op"] for d in denied] == ["resume", "cancel"]
    state = await runtime.load_state(eid, principal=ALICE)
    assert state.denials == 2
    assert state.status == "parked"  # an audit changes nothing else
    await runtime.resume(eid, "approve", 1, principal=ALICE)
    await settle(runtime)


async def test_a_denied_send_or_read_appends_nothing(clocked_store: EventStore,
                                                     clock: ManualClock) -> None:
    store = clocked_store
    runtime, denied = _runtime(store, clock=clock)
    eid = await started(runtime, "guarded", principal=ALICE)
    before = dumped(await store.read(eid))
    with hidden(eid):
        await runtime.send(eid, "note", 1, principal=EVE)
    with hidden(eid):
        await runtime.load_state(eid, principal=EVE)
    assert dumped(await store.read(eid)) == before
    assert [d["op"] for d in denied] == ["send", "read"]


async def test_a_denial_while_a_live_holder_runs_is_not_audited(store: EventStore) -> None:
    release, entered = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        entered.set()
        await release.wait()
        return "ok"

    @flow("running")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("slow", slow)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("running", principal=ALICE)
    await asyncio.wait_for(entered.wait(), 2)
    with hidden(handle.execution_id):
        await runtime.cancel(handle.execution_id, principal=EVE)
    release.set()
    assert await handle.result() == "ok"
    # The holder's log is its own: no audit squeezed in under its lease.
    assert "EXECUTION_DENIED" not in kinds(await store.read(handle.execution_id))


def test_policy_defaults_and_widening_per_op() -> None:
    assert AccessPolicy().rule_for("read") == "tenant"
    assert AccessPolicy().rule_for("annotate") == "owner"
    assert AccessPolicy(rules={"annotate": "tenant"}).rule_for("annotate") == "tenant"


@pytest.mark.parametrize("rules", [{"erase": "owner"}, {"resume": "admin"}, {"read": ""}])
def test_unknown_op_or_rule_is_a_configuration_error(rules: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError, match="AccessPolicy"):
        AccessPolicy(rules=rules)


def test_a_principal_needs_an_actor() -> None:
    with pytest.raises(ConfigurationError):
        Principal("")


async def test_denial_callback_that_throws_is_warned_not_raised(store: EventStore) -> None:
    warnings: list[str] = []

    def broken(_: dict[str, Any]) -> None:
        raise RuntimeError("audit sink down")

    runtime = Runtime(store, flows=[guarded], on_execution_denied=broken,
                      on_warn=warnings.append)
    eid = await started(runtime, "guarded", principal=ALICE)
    with hidden(eid):
        await runtime.load_state(eid, principal=EVE)
    assert any("audit sink down" in w for w in warnings)


@flow("decided")
async def decided(ctx: Context, _: Any) -> Any:
    return await ctx.decide("plan", lambda: Decision("a", policy=Policy("p", 1, 0.5)))


def _answer(exc: FleetError, execution_id: str) -> tuple[Any, ...]:
    """What a caller hears, with the id it asked about taken out."""
    return (type(exc), exc.code, exc.retryable, str(exc).replace(repr(execution_id), "<id>"),
            exc.details)


async def test_not_yours_and_no_such_execution_are_one_answer(stores: Any) -> None:
    """Issue 25 item 11: for a principal who may not read an execution, every op answers
    exactly what it answers for an id that has no log (type, code, retryable, message,
    details), on every backend; the denial is still counted, reported and, for resume
    and cancel, audited on the log."""
    store = stores[0]
    runtime, denied = _runtime(store)
    runtime.register(decided)
    eid = await started(runtime, "guarded", principal=ALICE)
    done = await runtime.start("decided", principal=ALICE)
    await done.result(timeout=10)
    ghost = "no-such-execution"

    def calls(guarded_id: str, decided_id: str) -> list[tuple[str, Any]]:
        return [(guarded_id, lambda: runtime.load_state(guarded_id, principal=EVE)),
                (guarded_id, lambda: runtime.resume(guarded_id, "approve", 1, principal=EVE)),
                (guarded_id, lambda: runtime.send(guarded_id, "note", 1, principal=EVE)),
                (guarded_id, lambda: runtime.cancel(guarded_id, principal=EVE)),
                (guarded_id, lambda: runtime.wait(guarded_id, principal=EVE)),
                (decided_id, lambda: runtime.record_outcome(
                    decided_id, decision_id="plan", key="k", score=1.0, principal=EVE))]

    for (real_id, real), (_, absent) in zip(calls(eid, done.execution_id),
                                            calls(ghost, ghost), strict=True):
        with pytest.raises(FleetError) as theirs:
            await real()
        with pytest.raises(FleetError) as nothing:
            await absent()
        assert _answer(theirs.value, real_id) == _answer(nothing.value, ghost), theirs.value
    assert [d["op"] for d in denied] == ["read", "resume", "send", "cancel", "read",
                                         "annotate"]
    assert runtime.denied == 6
    audits = [e.payload["op"] for e in await store.read(eid)
              if str(e.type) == "EXECUTION_DENIED"]
    assert audits == ["resume", "cancel"]
