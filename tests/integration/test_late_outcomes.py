"""ADR 0116 on memory, SQLite and Postgres: late outcomes, retention, compaction, repair.

Every refusal asserts the log is byte-for-byte what it was before the call.
The names of these tests are listed against the record's items in
docs/decisions/0009-adr-0116-tests.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from fleet import (
    AccessDeniedError,
    AccessPolicy,
    Context,
    Decision,
    DuplicateSequenceError,
    ExecutionNotFoundError,
    ExecutionNotTerminalError,
    ExecutionStateError,
    OutcomeContendedError,
    OutcomeRefusedError,
    Policy,
    Principal,
    Runtime,
    ValidationError,
    flow,
)
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.fold import fold_log
from fleet.kernel.lifecycle import LogLifecycle
from fleet.kernel.store.forwarding import ForwardingEventStore
from fleet.kernel.store.spi import (
    ConditionalAppendResult,
    EventStore,
    Snapshot,
    SnapshotStore,
    TipObservation,
)
from fleet.learning import evidence_events, trajectories

pytestmark = pytest.mark.integration
Stores = tuple[EventStore, SnapshotStore]
ALICE = Principal("alice", tenant="acme")
BOB = Principal("bob", tenant="acme")
EVE = Principal("eve", tenant="other")


def _price() -> Decision:
    return Decision("high", policy=Policy("pricing", 1, 0.25), alternatives=["low", "high"])


@flow("deal", version=1, steps=["quote"])
async def deal(ctx: Context, n: int) -> str:
    await ctx.step("quote", lambda: n)
    await ctx.decide("price", _price)
    return "done"


@flow("gated", version=1, steps=["quote"])
async def gated(ctx: Context, n: int) -> str:
    await ctx.decide("price", _price)
    await ctx.wait("approval")
    return "done"


class Clock:
    def __init__(self, now: int = 1_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def runtime_for(stores: Stores, **kw: Any) -> Runtime:
    store, snapshots = stores
    return Runtime(store, snapshots=snapshots, flows=[deal, gated], **kw)


async def finished(rt: Runtime, principal: Principal | None = ALICE) -> str:
    handle = await rt.start("deal", 1, principal=principal)
    assert await handle.result(timeout=10) == "done"
    return handle.execution_id


async def dump(store: EventStore, execution_id: str) -> list[str]:
    return [e.to_json() for e in await store.read(execution_id)]


def late(events: Sequence[EventEnvelope]) -> list[EventEnvelope]:
    return [e for e in events if e.type is EventType.OUTCOME_RECORDED
            and e.payload.get("late") is True]


# -- D1: the happy path and the status rules ----------------------------------

async def test_attach_to_a_completed_execution(stores: Stores) -> None:
    rt = runtime_for(stores)
    eid = await finished(rt)
    head = await stores[0].head(eid)
    result = await rt.record_outcome(eid, decision_id="price", key="csat:1", score=0.9,
                                     principal=ALICE)
    assert result.appended is True
    assert result.sequence == (head or 0) + 1
    state = await rt.load_state(eid, principal=ALICE)
    assert state.status == "completed"
    assert state.outcomes[-1] == {**state.outcomes[-1], "decisionId": "price", "key": "csat:1",
                                  "score": 0.9, "recordedBy": "alice", "late": True}
    written = late(await stores[0].read(eid))
    assert len(written) == 1
    assert written[0].kernel is True


async def test_refused_while_parked_and_the_next_writer_still_appends(stores: Stores) -> None:
    rt = runtime_for(stores)
    handle = await rt.start("gated", 1, principal=ALICE)
    eid = handle.execution_id
    for _ in range(200):
        if (await rt.load_state(eid, system=True)).parked:
            break
        await asyncio.sleep(0.01)
    before = await dump(stores[0], eid)
    with pytest.raises(ExecutionNotTerminalError):
        await rt.record_outcome(eid, decision_id="price", key="k", score=1.0,
                                principal=ALICE)
    assert await dump(stores[0], eid) == before
    # A late outcome takes no fence: the execution's next writer is undisturbed.
    await rt.resume(eid, "approval", True, principal=ALICE)
    assert await handle.result(timeout=10) == "done"


async def test_refused_while_running_and_the_holder_still_appends(stores: Stores) -> None:
    release = asyncio.Event()

    async def slow() -> int:
        await release.wait()
        return 1

    @flow("slow", version=1, steps=["slow"])
    async def body(ctx: Context, _: Any) -> str:
        await ctx.decide("price", _price)
        await ctx.step("slow", slow)
        return "done"

    rt = Runtime(stores[0], snapshots=stores[1], flows=[body])
    handle = await rt.start("slow", None, principal=ALICE)
    eid = handle.execution_id
    for _ in range(200):
        if "slow" in (await rt.load_state(eid, system=True)).frames:
            break
        await asyncio.sleep(0.01)
    before = await dump(stores[0], eid)
    with pytest.raises(ExecutionNotTerminalError):
        await rt.record_outcome(eid, decision_id="price", key="k", score=1.0,
                                principal=ALICE)
    assert await dump(stores[0], eid) == before
    release.set()
    assert await handle.result(timeout=10) == "done"


@flow("ends", version=1)
async def ends(ctx: Context, how: str) -> str:
    await ctx.decide("price", _price)
    if how == "fail":
        raise RuntimeError("the flow's own failure")
    if how == "continue":
        await ctx.continue_as_new("done")
    if how == "wait":
        await ctx.wait("approval")
    return "done"


async def _ended(rt: Runtime, how: str) -> str:
    handle = await rt.start("ends", how, principal=ALICE)
    eid = handle.execution_id
    if how == "wait":
        for _ in range(200):
            if (await rt.load_state(eid, system=True)).parked:
                break
            await asyncio.sleep(0.01)
        await (await rt.cancel(eid, principal=ALICE)).outcome()
    else:
        with contextlib.suppress(Exception):
            await handle.result(timeout=10)
    return eid


@pytest.mark.parametrize(("how", "status"), [
    ("fail", "failed"), ("wait", "cancelled"), ("continue", "continued")])
async def test_late_outcomes_attach_to_failed_cancelled_and_continued_executions(
        stores: Stores, how: str, status: str) -> None:
    """D1 and the R1b note: every terminal status takes a late outcome, status unchanged;
    a continued one takes it on the id the caller named, never the head of the chain."""
    rt = Runtime(stores[0], snapshots=stores[1], flows=[ends])
    eid = await _ended(rt, how)
    state = await rt.load_state(eid, system=True)
    assert state.status == status
    result = await rt.record_outcome(eid, decision_id="price", key="csat:1", score=0.4,
                                     principal=ALICE)
    assert result.appended
    [written] = late(await stores[0].read(eid))
    assert (written.execution_id, written.sequence) == (eid, result.sequence)
    after = await rt.load_state(eid, system=True)
    assert after.status == status
    assert after.outcomes[-1]["key"] == "csat:1"
    if how == "continue":
        successor = state.next_execution_id
        assert successor is not None
        assert late(await stores[0].read(successor)) == []
        assert (await rt.load_state(successor, system=True)).status == "completed"


async def test_two_concurrent_identical_calls_append_once(stores: Stores) -> None:
    rt = runtime_for(stores)
    eid = await finished(rt)
    results = await asyncio.gather(*(
        rt.record_outcome(eid, decision_id="price", key="csat:1", score=0.5, principal=ALICE)
        for _ in range(2)))
    assert sorted(r.appended for r in results) == [False, True]
    assert len(late(await stores[0].read(eid))) == 1


async def test_duplicate_is_idempotent_and_a_conflict_is_refused(stores: Stores) -> None:
    rt = runtime_for(stores)
    eid = await finished(rt)
    first = await rt.record_outcome(eid, decision_id="price", key="k", success=True,
                                    principal=ALICE)
    assert first.appended
    again = await rt.record_outcome(eid, decision_id="price", key="k", success=True,
                                    principal=ALICE)
    assert again.appended is False
    assert again.sequence is None
    before = await dump(stores[0], eid)
    with pytest.raises(OutcomeRefusedError, match="new key"):
        await rt.record_outcome(eid, decision_id="price", key="k", success=False,
                                principal=ALICE)
    assert await dump(stores[0], eid) == before


REFUSALS: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("unknown decision", {"decision_id": "invented", "key": "k", "score": 1.0},
     OutcomeRefusedError),
    ("huge score", {"decision_id": "price", "key": "k", "score": 1.7e308}, ValidationError),
    ("NaN score", {"decision_id": "price", "key": "k", "score": math.nan}, ValidationError),
    ("infinite score", {"decision_id": "price", "key": "k", "score": math.inf},
     ValidationError),
    ("257-char key", {"decision_id": "price", "key": "k" * 257, "score": 1.0},
     ValidationError),
    ("no score nor success", {"decision_id": "price", "key": "k"}, ValidationError),
    ("bool score", {"decision_id": "price", "key": "k", "score": True}, ValidationError),
]


@pytest.mark.parametrize(("case", "kwargs", "error"), REFUSALS, ids=[r[0] for r in REFUSALS])
async def test_refusals_leave_the_log_byte_for_byte_unchanged(
        stores: Stores, case: str, kwargs: dict[str, Any], error: type[Exception]) -> None:
    rt = runtime_for(stores)
    eid = await finished(rt)
    before = await dump(stores[0], eid)
    with pytest.raises(error):
        await rt.record_outcome(eid, principal=ALICE, **kwargs)
    assert await dump(stores[0], eid) == before


ORDER: list[tuple[str, str, Principal, dict[str, Any], type[Exception]]] = [
    # (case, the execution, caller, arguments, the error of the check judged FIRST)
    ("not found before authorise", "missing", EVE, {"score": 1.0}, ExecutionNotFoundError),
    # EVE may not read it: refused as "no execution" (issue 25 item 11), before the shape.
    ("authorise before shape", "finished", EVE, {"score": math.nan}, ExecutionNotFoundError),
    ("shape before terminal", "parked", ALICE, {"score": math.nan}, ValidationError),
    ("terminal before decision exists", "parked", ALICE,
     {"score": 1.0, "decision_id": "invented"}, ExecutionNotTerminalError),
    # An outcome for a decision the log never made (another writer's, unstamped): the
    # same value again is refused for the decision, not answered as a duplicate.
    ("decision exists before duplicate", "ghost outcome", ALICE,
     {"score": 1.0, "decision_id": "ghost"}, OutcomeRefusedError),
]


@pytest.mark.parametrize(("case", "which", "who", "kwargs", "error"), ORDER,
                         ids=[o[0] for o in ORDER])
async def test_the_order_of_checks_is_the_records(
        stores: Stores, case: str, which: str, who: Principal, kwargs: dict[str, Any],
        error: type[Exception]) -> None:
    """Implementation notes, order of checks: not found -> authorise annotate -> shape
    -> (inside the loop) terminal -> decision exists -> (decision_id, key). Each case
    breaks two adjacent checks and expects the earlier one's error; swapping either
    pair in outcomes.py fails a case (checked by hand, 2026-12-01). Log untouched."""
    rt = runtime_for(stores)
    if which == "finished":
        eid = await finished(rt)
    elif which == "ghost outcome":
        eid = await finished(rt)
        head = await stores[0].head(eid)
        assert head is not None
        await stores[0].append(EventEnvelope.make(
            eid, head + 1, EventType.OUTCOME_RECORDED, 1,
            {"decisionId": "ghost", "key": "k", "score": 1.0}, kernel=False))
    elif which == "parked":
        eid = (await rt.start("gated", 1, principal=ALICE)).execution_id
        for _ in range(200):
            if (await rt.load_state(eid, system=True)).parked:
                break
            await asyncio.sleep(0.01)
    else:
        eid = "no-such-run"
    before = await dump(stores[0], eid)
    args = {"decision_id": "price", "key": "k", **kwargs}
    with pytest.raises(error):
        await rt.record_outcome(eid, principal=who, **args)
    assert await dump(stores[0], eid) == before


async def test_an_unauthorised_principal_is_denied_and_nothing_is_appended(
        stores: Stores) -> None:
    denials: list[dict[str, Any]] = []
    rt = runtime_for(stores, on_execution_denied=denials.append)
    eid = await finished(rt)
    before = await dump(stores[0], eid)
    # Default rule is owner: a tenant peer is refused too (it may read it: "denied"); one
    # of another tenant may not read it either and hears "no execution" (issue 25 item 11).
    for who, error in ((BOB, AccessDeniedError), (EVE, ExecutionNotFoundError)):
        with pytest.raises(error):
            await rt.record_outcome(eid, decision_id="price", key="k", score=1.0,
                                    principal=who)
    assert await dump(stores[0], eid) == before
    assert [d["op"] for d in denials] == ["annotate", "annotate"]
    assert [d["actor"] for d in denials] == ["bob", "eve"]


async def test_the_tenant_rule_widens_annotate(stores: Stores) -> None:
    rt = runtime_for(stores, access_policy=AccessPolicy(rules={"annotate": "tenant"}))
    eid = await finished(rt)
    assert (await rt.record_outcome(eid, decision_id="price", key="k", score=1.0,
                                    principal=BOB)).appended
    with pytest.raises(ExecutionNotFoundError):  # EVE may not read it: "no execution"
        await rt.record_outcome(eid, decision_id="price", key="k2", score=1.0, principal=EVE)
    assert late(await stores[0].read(eid))[0].payload["recordedBy"] == "bob"


async def test_strict_needs_a_principal_and_not_found_is_judged_first(stores: Stores) -> None:
    rt = runtime_for(stores, strict=True)
    eid = await finished(rt)
    before = await dump(stores[0], eid)
    with pytest.raises(ExecutionNotFoundError) as hidden:  # strict: nobody may read it
        await rt.record_outcome(eid, decision_id="price", key="k", score=1.0)
    assert "strict" in str(hidden.value.__cause__)
    assert await dump(stores[0], eid) == before
    with pytest.raises(ExecutionNotFoundError):
        await rt.record_outcome("no-such-run", decision_id="price", key="k", score=1.0)


async def test_the_system_grant_is_recorded_as_system(stores: Stores) -> None:
    rt = runtime_for(stores, strict=True)
    eid = await finished(rt)
    assert (await rt.record_outcome(eid, decision_id="price", key="k", score=1.0,
                                    system=True)).appended
    assert late(await stores[0].read(eid))[0].payload["recordedBy"] == "system"


async def test_the_1025th_late_outcome_is_refused(stores: Stores) -> None:
    rt = runtime_for(stores)
    eid = await finished(rt)
    # The first 1,022 exactly as record_outcome writes them (one batch: the
    # calls themselves are O(n) each by design, and the cap is what bounds
    # them), then the last two through the runtime.
    head = await stores[0].head(eid)
    assert head is not None
    await stores[0].append_batch([EventEnvelope.make(
        eid, head + 1 + i, EventType.OUTCOME_RECORDED, 1,
        {"decisionId": "price", "key": f"k{i}", "score": 1.0, "recordedBy": "system",
         "late": True}) for i in range(1022)])
    for i in (1022, 1023):
        assert (await rt.record_outcome(eid, decision_id="price", key=f"k{i}", score=1.0,
                                        system=True)).appended
    before = await dump(stores[0], eid)
    with pytest.raises(OutcomeRefusedError, match="1024"):
        await rt.record_outcome(eid, decision_id="price", key="k1024", score=1.0, system=True)
    assert await dump(stores[0], eid) == before
    # A duplicate of an existing one is still answered, not refused by the cap.
    assert (await rt.record_outcome(eid, decision_id="price", key="k7", score=1.0,
                                    system=True)).appended is False


async def test_a_deleted_execution_is_not_found(stores: Stores) -> None:
    rt = runtime_for(stores)
    eid = await finished(rt)
    await stores[0].delete_execution(eid)
    with pytest.raises(ExecutionNotFoundError):
        await rt.record_outcome(eid, decision_id="price", key="k", score=1.0, system=True)
    assert await stores[0].read(eid) == []


class _DeletesAfterObserving(ForwardingEventStore):
    """The retention sweep at its worst moment: it deletes the log right after
    ``record_outcome`` observed the tip, before its read (the checkpoint, deleted
    after the events as the sweep does, is still there)."""

    def __init__(self, inner: EventStore) -> None:
        super().__init__(inner)
        self.armed = True

    async def append_if_unchanged(self, execution_id: str, event: EventEnvelope | None,
                                  expect: TipObservation | None = None,
                                  ) -> ConditionalAppendResult:
        result = await self.inner.append_if_unchanged(execution_id, event, expect)
        if event is None and self.armed:
            self.armed = False
            await self.inner.delete_execution(execution_id)
        return result


@pytest.mark.parametrize("compacted", [False, True], ids=["plain", "compacted"])
async def test_a_delete_between_the_observation_and_the_read_is_not_found(
        stores: Stores, compacted: bool) -> None:
    """Issue 13 item 6: the read after the observation finds an empty log (or only the
    checkpoint): that is "gone", never ExecutionNotTerminalError("... is pending")."""
    eid = await finished(runtime_for(stores))
    if compacted:
        await LogLifecycle(stores[0], stores[1]).compact(eid)
    rt = Runtime(_DeletesAfterObserving(stores[0]), snapshots=stores[1], flows=[deal])
    with pytest.raises(ExecutionNotFoundError):
        await rt.record_outcome(eid, decision_id="price", key="k", score=1.0, system=True)
    assert await stores[0].read(eid) == []


async def test_deletes_racing_late_outcomes_read_as_gone(stores: Stores) -> None:
    """Real concurrency (on Postgres: separate connections of one pool): four late
    outcomes racing the delete of their execution, twenty times, the delete let go
    after 0 to 9 turns of the loop so it lands in every phase of the calls on the
    embedded stores too. Each call either landed before the delete or is not found;
    none says the execution is pending, and nothing is left behind (no orphan)."""
    rt = runtime_for(stores)
    seen: list[str] = []

    async def delete(eid: str, turns: int) -> None:
        for _ in range(turns):
            await asyncio.sleep(0)
        await stores[0].delete_execution(eid)

    for round_ in range(20):
        eid = await finished(rt)
        calls = [rt.record_outcome(eid, decision_id="price", key=f"k{i}", score=1.0,
                                   system=True) for i in range(4)]
        results = await asyncio.gather(delete(eid, round_ % 10), *calls,
                                       return_exceptions=True)
        for result in results[1:]:
            if isinstance(result, BaseException):
                assert isinstance(result, ExecutionNotFoundError), repr(result)
                seen.append("not found")
            else:
                assert result.appended
                seen.append("appended")
        assert await stores[0].read(eid) == []
    assert "not found" in seen


@flow("rated", version=1)
async def rated(ctx: Context, _: Any) -> str:
    await ctx.decide("price", _price)
    await ctx.outcome("price", "csat", score=0.5)  # the flow's own, in-run
    return "done"


async def test_in_run_and_late_outcomes_share_the_decision_and_key_identity(
        stores: Stores) -> None:
    """Review round 1: (decision_id, key) is one identity across in-run and late
    outcomes: the in-run value again is a duplicate, another value a conflict."""
    rt = Runtime(stores[0], snapshots=stores[1], flows=[rated])
    handle = await rt.start("rated", None, principal=ALICE)
    assert await handle.result(timeout=10) == "done"
    eid = handle.execution_id
    before = await dump(stores[0], eid)
    again = await rt.record_outcome(eid, decision_id="price", key="csat", score=0.5,
                                    principal=ALICE)
    assert (again.appended, again.sequence) == (False, None)
    with pytest.raises(OutcomeRefusedError, match="new key"):
        await rt.record_outcome(eid, decision_id="price", key="csat", score=0.9,
                                principal=ALICE)
    assert await dump(stores[0], eid) == before
    # A namespaced key is another identity.
    assert (await rt.record_outcome(eid, decision_id="price", key="late:csat", score=0.9,
                                    principal=ALICE)).appended


async def test_the_existence_oracle_on_a_parked_execution(stores: Stores) -> None:
    """Review round 1: an authorised caller learns that the execution exists and is not
    terminal; an unauthorised one is denied before either is revealed (it cannot tell a
    parked execution from a finished one); not found is judged first (as send does). And
    (issue 25 item 11) one who may not read it cannot tell either from no execution."""
    rt = runtime_for(stores)
    eid = (await rt.start("gated", 1, principal=ALICE)).execution_id
    for _ in range(200):
        if (await rt.load_state(eid, system=True)).parked:
            break
        await asyncio.sleep(0.01)
    done = await finished(rt)
    before = await dump(stores[0], eid)
    with pytest.raises(ExecutionNotTerminalError, match="parked"):
        await rt.record_outcome(eid, decision_id="price", key="k", score=1.0,
                                principal=ALICE)
    denials = []
    for target in (eid, done, "no-such-run"):  # the same answer, parked, finished or none
        with pytest.raises(ExecutionNotFoundError) as denied:
            await rt.record_outcome(target, decision_id="price", key="k", score=1.0,
                                    principal=EVE)
        denials.append(str(denied.value).replace(target, "<id>"))
    assert denials == ["no execution '<id>'"] * 3
    assert await dump(stores[0], eid) == before


async def test_a_live_post_terminal_lease_never_blocks_a_late_outcome(stores: Stores) -> None:
    """Round 3 A: a holder that took the fence after the end (an at-least-once
    redispatch, recovery, a dead holder) neither blocks a late outcome nor loses its
    fence to it: the outcome's append is conditional on the token, never presents it."""
    rt = runtime_for(stores)
    eid = await finished(rt)
    grant = await stores[0].acquire_fence(eid, holder="redispatch", lease_ms=600_000)
    tip = (await stores[0].append_if_unchanged(eid, None)).tip
    assert tip.lease_expires_at is not None  # a live lease holds it
    result = await rt.record_outcome(eid, decision_id="price", key="k", score=1.0,
                                     principal=ALICE)
    assert result.appended
    after = (await stores[0].append_if_unchanged(eid, None)).tip
    assert (after.fence, after.holder) == (grant.token, "redispatch")  # not bumped, not taken
    assert after.head == result.sequence


async def test_three_late_outcomes_each_inside_a_ttl_window_do_not_pin_a_compacted_log(
        stores: Stores) -> None:
    """Q3: each outcome arrives within the TTL of the previous one (and of the end), the
    log compacted after each; retention still dates the end from the terminal event."""
    clock = Clock()
    rt = runtime_for(stores, clock=clock)
    eid = await finished(rt)
    ended = (await stores[0].read(eid))[-1].timestamp
    ttl = 1_000
    lifecycle = LogLifecycle(stores[0], stores[1], terminal_ttl_ms=ttl, clock=clock)
    for i in range(3):
        clock.now = ended + 300 * (i + 1)
        assert (await rt.record_outcome(eid, decision_id="price", key=f"k{i}", score=1.0,
                                        principal=ALICE)).appended
        await lifecycle.compact(eid)
        assert await lifecycle.retention_end(eid) == ended
        assert (await lifecycle.sweep(now=clock.now)).kept == 1
    log = await stores[0].read(eid)
    assert log[-1].timestamp == ended + 900  # the newest event is 100 ms old at the sweep
    assert (await lifecycle.sweep(now=ended + ttl - 1)).deleted == 0
    assert (await lifecycle.sweep(now=ended + ttl)).deleted == 1
    assert await stores[0].read(eid) == []


# -- Q1: the conditional append, through decorators that misbehave ------------

class _NoConditionalAppend(ForwardingEventStore):
    append_if_unchanged = None  # type: ignore[assignment]  # a store without the method


class _DropsAnchor(ForwardingEventStore):
    async def append_if_unchanged(self, execution_id: str, event: EventEnvelope | None,
                                  expect: TipObservation | None = None,
                                  ) -> ConditionalAppendResult:
        result = await self.inner.append_if_unchanged(execution_id, event, expect)
        tip = result.tip
        return ConditionalAppendResult(result.appended, result.reason,
                                       TipObservation(tip.head, tip.fence, None))


class _Mover(ForwardingEventStore):
    """Another writer slips an audit event in before each of the first ``moves`` writes."""

    def __init__(self, inner: EventStore, moves: int) -> None:
        super().__init__(inner)
        self.moves = moves

    async def append_if_unchanged(self, execution_id: str, event: EventEnvelope | None,
                                  expect: TipObservation | None = None,
                                  ) -> ConditionalAppendResult:
        if event is not None and self.moves > 0:
            self.moves -= 1
            head = await self.inner.head(execution_id)
            assert head is not None
            await self.inner.append(EventEnvelope.make(
                execution_id, head + 1, EventType.EXECUTION_DENIED, 1,
                {"op": "resume", "reason": "test"}))
        return await self.inner.append_if_unchanged(execution_id, event, expect)


@pytest.mark.parametrize(("wrapper", "names"), [
    (_NoConditionalAppend, "append_if_unchanged"),  # never a plain append instead
    (_DropsAnchor, "anchor"),  # refused at the first observation (round 4 item 4)
], ids=["no-conditional-append", "drops-anchor"])
async def test_a_store_that_cannot_prove_the_tip_is_refused(
        stores: Stores, wrapper: type[ForwardingEventStore], names: str) -> None:
    eid = await finished(runtime_for(stores))
    rt = Runtime(wrapper(stores[0]), flows=[deal])
    before = await dump(stores[0], eid)
    with pytest.raises(OutcomeRefusedError, match=names):
        await rt.record_outcome(eid, decision_id="price", key="k", score=1.0, system=True)
    assert await dump(stores[0], eid) == before


async def test_moved_re_observes_then_succeeds(stores: Stores) -> None:
    eid = await finished(runtime_for(stores))
    rt = Runtime(_Mover(stores[0], moves=2), flows=[deal])
    result = await rt.record_outcome(eid, decision_id="price", key="k", score=1.0,
                                     system=True)
    assert result.appended
    assert result.sequence == await stores[0].head(eid)


async def test_a_tip_that_keeps_moving_is_contended_and_retryable(stores: Stores) -> None:
    eid = await finished(runtime_for(stores))
    rt = Runtime(_Mover(stores[0], moves=100), flows=[deal])
    with pytest.raises(OutcomeContendedError) as info:
        await rt.record_outcome(eid, decision_id="price", key="k", score=1.0, system=True)
    assert info.value.retryable is True
    assert late(await stores[0].read(eid)) == []


# -- retention and compaction (Q3, round 3 i) -----------------------------------

async def test_a_late_outcome_does_not_move_the_retention_end(stores: Stores) -> None:
    clock = Clock()
    rt = runtime_for(stores, clock=clock)
    eid = await finished(rt)
    ended = clock.now
    clock.now += 500
    await rt.record_outcome(eid, decision_id="price", key="k", score=1.0, principal=ALICE)
    lifecycle = LogLifecycle(stores[0], stores[1], terminal_ttl_ms=1_000, clock=clock)
    assert await lifecycle.retention_end(eid) == ended
    # 1,100 ms after the end but only 600 ms after the outcome: reclaimed.
    report = await lifecycle.sweep(now=ended + 1_100)
    assert report.deleted == 1
    assert await stores[0].read(eid) == []


async def test_the_sweep_keeps_what_is_younger_than_the_ttl(stores: Stores) -> None:
    clock = Clock()
    rt = runtime_for(stores, clock=clock)
    eid = await finished(rt)
    lifecycle = LogLifecycle(stores[0], stores[1], terminal_ttl_ms=1_000, clock=clock)
    report = await lifecycle.sweep(now=clock.now + 999)
    assert (report.deleted, report.kept) == (0, 1)
    assert await stores[0].read(eid) != []


async def test_compaction_keeps_the_terminal_event_and_late_outcomes_above_it(
        stores: Stores) -> None:
    rt = runtime_for(stores)
    eid = await finished(rt)
    await rt.record_outcome(eid, decision_id="price", key="a", score=1.0, principal=ALICE)
    before_state = (await rt.load_state(eid, principal=ALICE)).to_dict()
    report = await LogLifecycle(stores[0], stores[1]).compact(eid)
    log = await stores[0].read(eid)
    assert [e.type for e in log] == [EventType.EXECUTION_STARTED,
                                     EventType.EXECUTION_COMPLETED,
                                     EventType.OUTCOME_RECORDED]
    assert report.checkpoint == log[1].sequence - 1
    assert (await rt.load_state(eid, principal=ALICE)).to_dict() == before_state
    # A late outcome after compaction still joins a decision the checkpoint holds.
    assert (await rt.record_outcome(eid, decision_id="price", key="b", score=0.0,
                                    principal=ALICE)).appended
    with pytest.raises(OutcomeRefusedError):
        await rt.record_outcome(eid, decision_id="nope", key="c", score=0.0, principal=ALICE)
    again = await LogLifecycle(stores[0], stores[1]).compact(eid)
    assert again.checkpoint is None  # nothing below the terminal event is left to fold
    assert len(late(await stores[0].read(eid))) == 2


async def test_two_thousand_decisions_compact_to_the_anchor_and_the_end(
        stores: Stores, capsys: pytest.CaptureFixture[str]) -> None:
    context = {"blob": "x" * 2048}

    @flow("agent", version=1)
    async def agent(ctx: Context, n: int) -> int:
        for i in range(n):
            await ctx.decide(f"turn#{i}", lambda i=i: Decision(  # type: ignore[misc]
                i % 3, policy=Policy("p", 1, 0.5), context=context))
        return n

    rt = Runtime(stores[0], snapshots=stores[1], flows=[agent])
    handle = await rt.start("agent", 2000)
    assert await handle.result(timeout=60) == 2000
    report = await LogLifecycle(stores[0], stores[1]).compact(handle.execution_id)
    with capsys.disabled():
        print(f"\n[{type(stores[0]).__name__}] 2,000 decisions of 2 KB: "
              f"{report.events_before} events / {report.bytes_before:,} bytes -> "
              f"{report.events_after} events / {report.bytes_after:,} bytes")
    assert report.events_before == 2002
    assert report.bytes_before > 2000 * 2048
    assert report.events_after == 2
    assert report.bytes_after < 1_000
    state = await rt.load_state(handle.execution_id, system=True)
    assert len(state.decisions) == 2000
    paths = trajectories(evidence_events(state, await stores[0].read(handle.execution_id)))
    assert [d.decision_id for d in paths[0].decisions][:3] == ["turn#0", "turn#1", "turn#2"]


async def test_evidence_order_survives_compaction_whatever_the_ids(stores: Stores) -> None:
    ids = ["10", "2", "b", "a", "0"]

    @flow("ids", version=1)
    async def body(ctx: Context, _: Any) -> str:
        for decision_id in ids:
            await ctx.decide(decision_id, lambda: Decision("x", policy=Policy("p", 1, 0.5)))
        return "ok"

    rt = Runtime(stores[0], snapshots=stores[1], flows=[body])
    handle = await rt.start("ids", None)
    await handle.result(timeout=10)
    eid = handle.execution_id
    full = trajectories(await stores[0].read(eid))
    await LogLifecycle(stores[0], stores[1]).compact(eid)
    # The checkpoint went through the snapshot store (jsonb on Postgres: key order lost).
    state = await rt.load_state(eid, system=True)
    compacted = trajectories(evidence_events(state, await stores[0].read(eid)))
    assert [d.decision_id for d in compacted[0].decisions] == ids
    assert compacted == full


# -- the repair of a log an older kernel compacted (round 4 item 5) --------------

async def _old_kernel_compaction(stores: Stores, eid: str) -> int:
    """What a pre-0116 kernel left: a checkpoint AT the terminal event, the event gone."""
    events = await stores[0].read(eid)
    terminal = events[-1].sequence
    await stores[1].save(Snapshot(eid, terminal, fold_log(events).to_dict()))
    await stores[0].compact_through(eid, terminal)
    return terminal


async def test_restore_terminal_event_repairs_an_old_compaction(stores: Stores) -> None:
    rt = runtime_for(stores)
    eid = await finished(rt)
    state = await rt.load_state(eid, system=True)
    terminal = await _old_kernel_compaction(stores, eid)
    lifecycle = LogLifecycle(stores[0], stores[1], terminal_ttl_ms=10**9)
    assert await lifecycle.retention_end(eid) is None
    assert (await lifecycle.sweep()).needs_repair == 1
    before = await dump(stores[0], eid)
    dry = await lifecycle.restore_terminal_event(eid)
    assert (dry.action, dry.sequence, dry.type) == ("would-write", terminal + 1,
                                                    "EXECUTION_COMPLETED")
    assert await dump(stores[0], eid) == before  # dry by default
    done = await lifecycle.restore_terminal_event(eid, apply=True)
    assert (done.action, done.sequence) == ("written", terminal + 1)
    assert (await lifecycle.restore_terminal_event(eid, apply=True)).action == "intact"
    log = await stores[0].read(eid)
    assert log[-1].payload == {}
    assert log[-1].metadata == {"kernel": True, "restoredTerminal": True}
    assert await lifecycle.retention_end(eid) == state.updated_at
    repaired = await rt.load_state(eid, system=True)
    assert repaired.status == "completed"
    assert repaired.output == "done"
    assert (await rt.record_outcome(eid, decision_id="price", key="k", score=1.0,
                                    principal=ALICE)).appended


async def test_an_old_compacted_log_refuses_a_late_outcome_until_repaired(
        stores: Stores) -> None:
    """Round 3 P3 item 1 / round 4 item 5 with a high-water head (issue 13 item 4): the
    head stays at T after the old compaction, so head + 1 is free, but the log holds
    no terminal event to date its end from: refused, nothing written, until repaired."""
    rt = runtime_for(stores)
    eid = await finished(rt)
    terminal = await _old_kernel_compaction(stores, eid)
    assert await stores[0].head(eid) == terminal  # the mark did not move back
    before = await dump(stores[0], eid)
    with pytest.raises(OutcomeRefusedError, match="repair terminal-event") as info:
        await rt.record_outcome(eid, decision_id="price", key="k", score=1.0,
                                principal=ALICE)
    assert f"checkpoint at sequence {terminal}" in str(info.value)
    assert await dump(stores[0], eid) == before
    await LogLifecycle(stores[0], stores[1]).restore_terminal_event(eid, apply=True)
    assert (await rt.record_outcome(eid, decision_id="price", key="k", score=1.0,
                                    principal=ALICE)).appended


class _NoHighWater(ForwardingEventStore):
    """The head a store WITHOUT a high-water mark reports (the record's stores): the
    highest sequence it still holds, so a compaction moves it back."""

    async def _held(self, execution_id: str) -> int | None:
        events = await self.inner.read(execution_id)
        return events[-1].sequence if events else None

    async def head(self, execution_id: str) -> int | None:
        return await self._held(execution_id)

    async def append_if_unchanged(self, execution_id: str, event: EventEnvelope | None,
                                  expect: TipObservation | None = None,
                                  ) -> ConditionalAppendResult:
        result = await self.inner.append_if_unchanged(execution_id, event, expect)
        tip = result.tip
        return ConditionalAppendResult(result.appended, result.reason, TipObservation(
            await self._held(execution_id), tip.fence, tip.anchor, tip.holder,
            tip.lease_expires_at))


async def test_a_log_folded_above_its_stored_head_is_refused(stores: Stores) -> None:
    """The record's own shape of an old compaction: [0] + a checkpoint at T, the head
    back at 0. The checkpoint above the head is folded, not ignored (ignoring it folded
    sequence 0 alone and answered ExecutionNotTerminalError)."""
    eid = await finished(runtime_for(stores))
    terminal = await _old_kernel_compaction(stores, eid)
    rt = Runtime(_NoHighWater(stores[0]), snapshots=stores[1], flows=[deal])
    before = await dump(stores[0], eid)
    with pytest.raises(OutcomeRefusedError,
                       match=f"sequence {terminal} above its stored head 0"):
        await rt.record_outcome(eid, decision_id="price", key="k", score=1.0, system=True)
    assert await dump(stores[0], eid) == before


async def test_the_repair_dates_the_end_from_the_original_terminal_event(
        stores: Stores) -> None:
    """A late outcome an older fleet accepted on an unrepaired old-compacted log (10 days
    after the end) must not date the end: the repair writes the checkpoint's time."""
    clock = Clock()
    rt = runtime_for(stores, clock=clock)
    eid = await finished(rt)
    ended = (await stores[0].read(eid))[-1].timestamp
    terminal = await _old_kernel_compaction(stores, eid)
    ten_days = 10 * 24 * 3600 * 1000
    await stores[0].append(EventEnvelope.make(
        eid, terminal + 1, EventType.OUTCOME_RECORDED, ended + ten_days,
        {"decisionId": "price", "key": "k", "score": 1.0, "recordedBy": "system",
         "late": True}))
    lifecycle = LogLifecycle(stores[0], stores[1], terminal_ttl_ms=1_000)
    assert (await rt.load_state(eid, system=True)).updated_at == ended + ten_days
    dry = await lifecycle.restore_terminal_event(eid)
    assert (dry.sequence, dry.ended_at) == (terminal + 2, ended)
    done = await lifecycle.restore_terminal_event(eid, apply=True)
    assert (done.sequence, done.ended_at) == (terminal + 2, ended)
    assert (await stores[0].read(eid))[-1].timestamp == ended
    assert await lifecycle.retention_end(eid) == ended
    report = await lifecycle.sweep(now=ended + 1_000)
    assert report.deleted == 1
    assert await stores[0].read(eid) == []


async def test_restore_refuses_running_and_continued_executions(stores: Stores) -> None:
    @flow("chain", version=1)
    async def chain(ctx: Context, n: int) -> int:
        if n < 1:
            await ctx.continue_as_new(n + 1)
        return n

    rt = Runtime(stores[0], snapshots=stores[1], flows=[gated, chain])
    lifecycle = LogLifecycle(stores[0], stores[1])
    parked = await rt.start("gated", 1)
    for _ in range(200):
        if (await rt.load_state(parked.execution_id, system=True)).parked:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(ExecutionStateError):
        await lifecycle.restore_terminal_event(parked.execution_id, apply=True)
    first = await rt.start("chain", 0)
    assert await first.result(timeout=10) == 1
    with pytest.raises(ExecutionStateError, match="continued"):
        await lifecycle.restore_terminal_event(first.execution_id, apply=True)


# -- the reopen bootstrap (round 3 A, round 4 item 1) ------------------------------

@flow("deal", version=2, steps=["quote"])
async def deal_v2(ctx: Context, n: int) -> str:
    await ctx.step("quote", lambda: n)
    await ctx.decide("price", _price)
    return "done v2"


class _SlotTaker(ForwardingEventStore):
    """Runs ``take`` (another writer) just before the reopen's bootstrap write."""

    def __init__(self, inner: EventStore, take: Callable[[str, int], Any],
                 hole: bool = False) -> None:
        super().__init__(inner)
        self.take = take
        self.hole = hole
        self.taken = False

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        if not self.taken and any(e.type is EventType.EXECUTION_MIGRATED for e in events):
            self.taken = True
            await self.take(events[0].execution_id, events[0].sequence)
        await self.inner.append_batch(events, fence=fence)

    async def read(self, execution_id: str, *, after: int = -1) -> list[EventEnvelope]:
        events = await self.inner.read(execution_id, after=after)
        if self.hole and self.taken and after >= 0 and events:
            return events[1:]  # report the tail non-contiguously
        return events


async def _reopen_with(stores: Stores, take: Callable[[Runtime, str, int], Any],
                       hole: bool = False) -> tuple[Runtime, str, _SlotTaker]:
    plain = runtime_for(stores)
    handle = await plain.start("deal", 1, principal=ALICE)
    await handle.result(timeout=10)
    holder: dict[str, Runtime] = {}
    store = _SlotTaker(stores[0], lambda eid, seq: take(holder["rt"], eid, seq), hole)
    rt = Runtime(store, snapshots=stores[1], flows=[deal, deal_v2])
    holder["rt"] = rt
    return rt, handle.execution_id, store


async def _late_outcome(rt: Runtime, eid: str, seq: int) -> None:
    await rt.record_outcome(eid, decision_id="price", key="slot", score=1.0, system=True)


async def _two_late_outcomes(rt: Runtime, eid: str, seq: int) -> None:
    # With the hole hiding the first, the second sits at head + 2: adopting it
    # alone would re-slot the bootstrap over an outcome it never folded.
    await _late_outcome(rt, eid, seq)
    await rt.record_outcome(eid, decision_id="price", key="slot2", score=1.0, system=True)


def _raw(kernel: bool, with_late: bool) -> Callable[[Runtime, str, int], Any]:
    async def take(rt: Runtime, eid: str, seq: int) -> None:
        payload: dict[str, Any] = {"decisionId": "price", "key": "slot", "score": 1.0}
        if with_late:
            payload["late"] = True
        inner = rt.store.inner  # type: ignore[attr-defined]
        await inner.append(EventEnvelope.make(eid, seq, EventType.OUTCOME_RECORDED, 1,
                                              payload, kernel=kernel))
    return take


async def test_a_reopen_re_slots_over_a_late_outcome_that_took_its_slot(
        stores: Stores) -> None:
    rt, eid, _ = await _reopen_with(stores, _late_outcome)
    handle = await rt.resume_as(eid, version=2, discard=["quote"], principal=ALICE)
    assert await handle.result(timeout=10) == "done v2"
    types = [e.type for e in await stores[0].read(eid)]
    outcome_at = types.index(EventType.OUTCOME_RECORDED)
    assert types[outcome_at + 1] is EventType.EXECUTION_MIGRATED  # re-slotted above it
    state = await rt.load_state(eid, system=True)
    assert state.outcomes[-1]["key"] == "slot"


@pytest.mark.parametrize(("name", "take", "hole"), [
    ("unstamped outcome", _raw(kernel=False, with_late=True), False),
    ("stamped outcome without late", _raw(kernel=True, with_late=False), False),
    ("a tail with a hole", _two_late_outcomes, True),
], ids=["unstamped", "not-late", "hole"])
async def test_a_reopen_over_anything_else_takes_the_ordinary_path(
        stores: Stores, name: str, take: Callable[[Runtime, str, int], Any],
        hole: bool) -> None:
    rt, eid, _ = await _reopen_with(stores, take, hole)
    with pytest.raises(DuplicateSequenceError):
        await rt.resume_as(eid, version=2, discard=["quote"], principal=ALICE)
    log = await stores[0].read(eid)
    assert not any(e.type is EventType.EXECUTION_MIGRATED for e in log)  # nothing durable
    assert (await rt.load_state(eid, system=True)).status == "completed"
