"""ABA under a frozen clock: documented, not hardened (ADR 0116 round 4 item 7; issue 25
item 14).

A conditional append compares the tip it observed: head, fence token and the log's
creation anchor, which is the sequence-0 event's timestamp and id. A log deleted and
re-created under the same id at the same instant (a frozen or virtual clock), with the
same head and token, has the same anchor: it reads as the log observed, and a write
judged on the old one lands on the new one. A random nonce in the anchor would close
it but make the start envelope non-deterministic (byte-identical replay, the vectors).
On memory, SQLite and a real Postgres: with time passing the re-created log is a
different one (``moved``); with the clock frozen it is not (the residual, pinned); a
harness that freezes time and re-creates an id under a late write varies the id.
"""

from __future__ import annotations

from typing import Any

from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.spi import EventStore

T = 1_800_000_000_000


def started(execution_id: str, at: int) -> EventEnvelope:
    return EventEnvelope.make(execution_id, 0, EventType.EXECUTION_STARTED, at,
                              {"flowId": "f", "flowVersion": 1, "flowHash": "x", "input": 1})


def late(execution_id: str) -> EventEnvelope:
    return EventEnvelope.make(execution_id, 1, EventType.OUTCOME_RECORDED, T + 5,
                              {"decisionId": "d", "key": "k", "score": 1.0,
                               "recordedBy": "system", "late": True}, kernel=True)


async def recreated(store: EventStore, execution_id: str, again_at: int) -> Any:
    """Observe a log, delete it and make it again at ``again_at``; then the write judged
    on the first observation."""
    await store.append(started(execution_id, T))
    seen = (await store.append_if_unchanged(execution_id, None)).tip
    assert await store.delete_execution(execution_id)
    await store.append(started(execution_id, again_at))
    return await store.append_if_unchanged(execution_id, late(execution_id), seen)


async def test_a_re_created_log_is_another_unless_the_clock_stood_still(stores: Any) -> None:
    store: EventStore = stores[0]
    moved = await recreated(store, "aba-real-clock", T + 1)
    assert (moved.appended, moved.reason) == (False, "moved")
    assert await store.head("aba-real-clock") == 0  # nothing landed on the new log
    # The residual: at the same instant the anchors are equal, and the write lands.
    same = await recreated(store, "aba-frozen-clock", T)
    assert (same.appended, same.reason) == (True, None)
    assert await store.head("aba-frozen-clock") == 1
