"""A reward reads what is new, not the whole execution (issue 25 item 12).

``record_outcome`` folded the whole log twice per reward (once to authorise, once to
judge), so a reward for a decision of a long log, or of one near the outcome cap,
cost a fold of all of it. Now one observation serves both, and a finished execution's
judged fold is remembered: the next reward reads only the events appended since.
Counted, not timed (events read through a counting store), on memory, SQLite and a
real Postgres; the answers stay the ADR 0116 ones: duplicates, conflicts, the cap,
another runtime's outcomes, a log deleted and re-created under its id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from fleet import Context, Decision, Policy, Principal, Runtime, flow
from fleet.kernel.errors import OutcomeRefusedError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.outcomes import MAX_LATE_OUTCOMES
from fleet.kernel.store.forwarding import ForwardingEventStore
from fleet.kernel.store.spi import EventStore, SnapshotStore

pytestmark = pytest.mark.integration
ALICE = Principal("alice", tenant="acme")
LONG = 600  # late outcomes already on the log


@flow("priced", version=1, steps=["quote"])
async def priced(ctx: Context, n: int) -> str:
    await ctx.step("quote", lambda: n)
    await ctx.decide("price", lambda: Decision("high", policy=Policy("p", 1, 0.5)))
    return "done"


class CountingStore(ForwardingEventStore):
    """Counts the events every ``read`` returns."""

    def __init__(self, inner: EventStore) -> None:
        super().__init__(inner)
        self.events_read = 0

    async def read(self, execution_id: str, *, after: int = -1) -> list[EventEnvelope]:
        events = await self.inner.read(execution_id, after=after)
        self.events_read += len(events)
        return events


async def long_log(runtime: Runtime, store: EventStore) -> str:
    handle = await runtime.start("priced", 1, principal=ALICE)
    assert await handle.result(timeout=10) == "done"
    eid = handle.execution_id
    head = await store.head(eid)
    assert head is not None
    await store.append_batch([EventEnvelope.make(
        eid, head + 1 + i, EventType.OUTCOME_RECORDED, 1,
        {"decisionId": "price", "key": f"old{i}", "score": 1.0, "recordedBy": "system",
         "late": True}) for i in range(LONG)])
    return eid


async def reward(runtime: Runtime, eid: str, key: str, score: float = 1.0) -> Any:
    return await runtime.record_outcome(eid, decision_id="price", key=key, score=score,
                                        principal=ALICE)


async def test_a_reward_reads_only_what_was_appended_since_the_last(stores: Any) -> None:
    store: EventStore = stores[0]
    snapshots: SnapshotStore = stores[1]
    counting = CountingStore(store)
    runtime = Runtime(counting, snapshots=snapshots, flows=[priced])
    eid = await long_log(runtime, store)
    log = len(await store.read(eid))

    counting.events_read = 0
    assert (await reward(runtime, eid, "k0")).appended
    first = counting.events_read
    assert log <= first <= log + 1  # the first one folds it once (it was twice: 2 x log)
    per_reward: list[int] = []
    for i in range(1, 21):
        counting.events_read = 0
        assert (await reward(runtime, eid, f"k{i}")).appended
        per_reward.append(counting.events_read)
    assert per_reward == [1] * 20, per_reward  # the previous reward's own outcome

    # The answers are the record's: a duplicate is a duplicate, a conflict a conflict,
    # and each reads nothing new at all.
    counting.events_read = 0
    assert (await reward(runtime, eid, "k20")).appended is False
    with pytest.raises(OutcomeRefusedError, match="already recorded"):
        await reward(runtime, eid, "k20", score=0.5)
    with pytest.raises(OutcomeRefusedError, match="made no decision"):
        await runtime.record_outcome(eid, decision_id="nope", key="x", score=1.0,
                                     principal=ALICE)
    assert counting.events_read <= 1

    # Another runtime's outcomes (another process) are read as they are new.
    other = Runtime(store, snapshots=snapshots, flows=[priced])
    assert (await reward(other, eid, "theirs", score=0.25)).appended
    with pytest.raises(OutcomeRefusedError, match="already recorded"):
        await reward(runtime, eid, "theirs", score=0.75)
    assert (await reward(runtime, eid, "theirs", score=0.25)).appended is False

    # The cap still holds, judged on the remembered fold.
    state = await runtime.load_state(eid, principal=ALICE)
    room = MAX_LATE_OUTCOMES - sum(1 for o in state.outcomes if o.get("late"))
    head = await store.head(eid)
    assert head is not None
    await store.append_batch([EventEnvelope.make(
        eid, head + 1 + i, EventType.OUTCOME_RECORDED, 1,
        {"decisionId": "price", "key": f"fill{i}", "score": 1.0, "recordedBy": "system",
         "late": True}) for i in range(room)])
    with pytest.raises(OutcomeRefusedError, match=str(MAX_LATE_OUTCOMES)):
        await reward(runtime, eid, "one-too-many")


async def test_a_log_recreated_under_its_id_is_judged_afresh(stores: Any) -> None:
    store: EventStore = stores[0]
    runtime = Runtime(store, snapshots=stores[1], flows=[priced])
    eid = await long_log(runtime, store)
    assert (await reward(runtime, eid, "before")).appended
    await store.delete_execution(eid)
    await stores[1].delete(eid)
    again = await runtime.start("priced", 2, principal=ALICE, execution_id=eid)
    assert await again.result(timeout=10) == "done"
    # The remembered fold held "before" and 600 old outcomes; the new log holds none.
    assert (await reward(runtime, eid, "before", score=0.5)).appended
    outcomes: Sequence[dict[str, Any]] = (await runtime.load_state(eid)).outcomes
    assert [(o["key"], o["score"]) for o in outcomes] == [("before", 0.5)]
