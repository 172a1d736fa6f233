"""An idempotent start never hands back someone else's execution (issue 10 item 2).

``start(..., execution_id=X)`` returned a handle to whatever X was, so another
tenant's ``handle.result()`` read its output; the derived ids (``idem-`` + a hash of
tenant, flow and key; ``<id>~1`` after ``continue_as_new``) could be created first
with an explicit id, so a later legitimate start "succeeded" with the squatter's
execution and a victim's run continued into the attacker's. Now an existing
execution comes back only to a principal who may read it and only for the same
flow (``ExecutionConflictError`` otherwise), and the derived forms are reserved
(decision 0024). On memory, SQLite and a real Postgres.
"""

from __future__ import annotations

from typing import Any

import pytest
from kernel_kit import dumped, failed_with

from fleet import (
    AccessDeniedError,
    Context,
    EventEnvelope,
    EventType,
    Principal,
    ReservedNameError,
    Runtime,
    flow,
)
from fleet.kernel.errors import ExecutionConflictError
from fleet.kernel.ids import idempotent_execution_id
from fleet.kernel.store.spi import EventStore, SnapshotStore

ALICE = Principal("alice", tenant="acme")
CAROL = Principal("carol", tenant="acme")
MALLORY = Principal("mallory", tenant="evil")


@flow("ledger")
async def ledger(ctx: Context, owner: str) -> str:
    return await ctx.step("secret", lambda: f"{owner}'s balance: 1,000,000")


@flow("other")
async def other(ctx: Context, _: Any) -> str:
    return "other"


@flow("chain")
async def chain(ctx: Context, n: int) -> Any:
    if n == 0:
        await ctx.continue_as_new(1)
    return await ctx.step("end", lambda: f"chain ended at {n}")


def runtime_for(store: EventStore, denied: list[dict[str, Any]] | None = None) -> Runtime:
    return Runtime(store, flows=[ledger, other, chain],
                   on_execution_denied=None if denied is None else denied.append)


async def test_an_existing_id_is_handed_back_only_to_a_reader_of_the_same_flow(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    store = stores[0]
    denied: list[dict[str, Any]] = []
    runtime = runtime_for(store, denied)
    mine = await runtime.start("ledger", "alice", principal=ALICE, execution_id="order-1")
    assert await mine.result(timeout=10) == "alice's balance: 1,000,000"
    before = dumped(await store.read("order-1"))

    with pytest.raises(ExecutionConflictError, match="taken by another execution") as taken:
        await runtime.start("ledger", "mallory", principal=MALLORY, execution_id="order-1")
    assert "alice" not in str(taken.value)  # the refusal says nothing about the owner
    assert isinstance(taken.value.__cause__.__cause__, AccessDeniedError)  # read: hidden
    assert (runtime.denied, [d["op"] for d in denied]) == (1, ["read"])
    with pytest.raises(ExecutionConflictError, match="exists for flow 'ledger', not 'other'"):
        await runtime.start("other", None, principal=ALICE, execution_id="order-1")
    assert dumped(await store.read("order-1")) == before  # nothing written by either

    again = await runtime.start("ledger", "alice", principal=ALICE, execution_id="order-1")
    assert await again.result(timeout=10) == "alice's balance: 1,000,000"
    colleague = await runtime.start("ledger", "carol", principal=CAROL, execution_id="order-1")
    assert await colleague.result(timeout=10) == "alice's balance: 1,000,000"  # read: tenant
    assert dumped(await store.read("order-1")) == before


async def test_derived_ids_cannot_be_squatted(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    store = stores[0]
    runtime = runtime_for(store)
    idem = idempotent_execution_id("ledger", "invoice-77", "acme")
    for squat in (idem, "victim~1", "victim~12", "__fleet_x"):
        with pytest.raises(ReservedNameError):
            await runtime.start("ledger", "mallory", principal=MALLORY, execution_id=squat)
        assert await store.head(squat) is None
    assert await store.list_executions() == []

    keyed = await runtime.start("ledger", "alice", principal=ALICE,
                                idempotency_key="invoice-77")
    assert keyed.execution_id == idem
    assert await keyed.result(timeout=10) == "alice's balance: 1,000,000"
    # The same key in another tenant names another execution; never alice's.
    theirs = await runtime.start("ledger", "mallory", principal=MALLORY,
                                 idempotency_key="invoice-77")
    assert theirs.execution_id != idem
    assert await theirs.result(timeout=10) == "mallory's balance: 1,000,000"
    again = await runtime.start("ledger", "alice", principal=ALICE,
                                idempotency_key="invoice-77")
    assert again.execution_id == idem


async def _squat(store: EventStore, execution_id: str, **payload: Any) -> list[Any]:
    """An execution written straight to the store, as a squat made before the rule."""
    body = {"flowId": "chain", "flowVersion": 1, "flowHash": "x", "input": 99,
            "owner": MALLORY.to_owner(), **payload}
    await store.append(EventEnvelope.make(execution_id, 0, EventType.EXECUTION_STARTED,
                                          1_700_000_000_000, body))
    return dumped(await store.read(execution_id))


async def test_an_old_squat_of_a_successor_id_is_never_continued_into(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    store = stores[0]
    runtime = runtime_for(store)
    squat = await _squat(store, "victim~1")
    handle = await runtime.start("chain", 0, principal=ALICE, execution_id="victim")
    error = await failed_with(handle, ExecutionConflictError.code, timeout=10)
    assert "'victim~1' is taken" in error["message"]
    state = await runtime.load_state("victim")
    assert (state.status, state.next_execution_id) == ("failed", None)
    assert dumped(await store.read("victim~1")) == squat
    assert runtime.refused == 1


async def test_an_old_squat_of_an_idempotency_id_is_refused(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    store = stores[0]
    runtime = runtime_for(store)
    idem = idempotent_execution_id("chain", "k", "acme")
    squat = await _squat(store, idem)
    with pytest.raises(ExecutionConflictError):
        await runtime.start("chain", 1, principal=ALICE, idempotency_key="k")
    assert dumped(await store.read(idem)) == squat


async def test_a_successor_of_the_same_run_is_found_again_after_a_crash(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    """The check is not a false alarm for the run's own successor (a re-drive after a
    crash between the successor's start and CONTINUED finds it and continues)."""
    store = stores[0]
    runtime = runtime_for(store)
    await _squat(store, "mine~1", continuedFrom="mine", owner=ALICE.to_owner(), input=1,
                 flowVersion=chain.version, flowHash=chain.content_hash(runtime.features))
    handle = await runtime.start("chain", 0, principal=ALICE, execution_id="mine")
    assert (await handle.outcome()).kind == "continued"  # type: ignore[union-attr]
    await runtime.drive("mine~1")  # what recovery does for the successor left running
    assert await handle.result(timeout=10) == "chain ended at 1"
    assert (await runtime.load_state("mine")).next_execution_id == "mine~1"


# Issue 25 item 3: the generation of a successor id is ASCII digits only. int() and
# str.isdigit() also take '٣' (Arabic-Indic), '\uff13' (fullwidth) and '²' (superscript), so
# 'victim~٣' continued into 'victim~4' (the victim's own chain then failed with
# ExecutionConflictError) and 'run~²' raised a bare ValueError.
UNICODE_DIGIT_TAILS = ("victim~\u0663", "victim~\uff13", "run~\u00b2", "victim~\u2167",
                       "victim~1\u0663")


@pytest.mark.parametrize("squat", UNICODE_DIGIT_TAILS)
async def test_an_id_ending_in_digits_of_any_script_is_refused_typed(
        stores: tuple[EventStore, SnapshotStore], squat: str) -> None:
    store = stores[0]
    runtime = runtime_for(store)
    with pytest.raises(ReservedNameError, match="digits of any script"):
        await runtime.start("chain", 0, principal=MALLORY, execution_id=squat)
    assert await store.head(squat) is None
    assert await store.list_executions() == []
    # Lookalikes that are not '~<digits>' stay ordinary ids.
    for fine in ("victim~3a", "victim~", "victim-\u0663"):
        handle = await runtime.start("ledger", "alice", principal=ALICE, execution_id=fine)
        assert await handle.result(timeout=10) == "alice's balance: 1,000,000"


async def test_an_old_unicode_digit_id_continues_into_its_own_ascii_successor(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    """Written before the rule (straight to the store), 'victim~٣' and 'run~²' continue
    into '<id>~1', never into the victim's 'victim~4', and never raise ValueError."""
    store = stores[0]
    runtime = runtime_for(store)
    for old in ("victim~\u0663", "victim~\uff13", "run~\u00b2"):
        await _squat(store, old, input=0, flowVersion=chain.version,
                     flowHash=chain.content_hash(runtime.features))
        handle = await runtime.drive(old)
        assert await handle.result(timeout=10) == "chain ended at 1"  # through its successor
        assert (await runtime.load_state(old)).next_execution_id == f"{old}~1"
        assert (await runtime.load_state(f"{old}~1")).status == "completed"
    for victims in ("victim~4", "run~3", "run~1"):
        assert await store.head(victims) is None

    # The victim's own chain is untouched by the old ids.
    victim = await runtime.start("chain", 0, principal=ALICE, execution_id="victim")
    assert await victim.result(timeout=10) == "chain ended at 1"
    assert (await runtime.load_state("victim")).next_execution_id == "victim~1"


def test_successor_id_reads_ascii_digits_only() -> None:
    from fleet.kernel.ids import successor_id

    assert successor_id("victim") == "victim~1"
    assert successor_id("victim~3") == "victim~4"
    assert successor_id("victim~09") == "victim~10"
    assert successor_id("victim~\u0663") == "victim~\u0663~1"
    assert successor_id("victim~\uff13") == "victim~\uff13~1"
    assert successor_id("run~\u00b2") == "run~\u00b2~1"
    assert successor_id("~7") == "~7~1"
