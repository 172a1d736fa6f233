"""The conformance kit's half on values: every store keeps and refuses the same ones.

``EventStoreConformance`` and ``SnapshotStoreConformance``
(``fleet.kernel.store.conformance``) include these tests; a backend or a
decorator passes them as it passes the rest. What they pin (decision 0023):

- a value that is not JSON is ``NotSerializableError``; text that is not valid
  Unicode (a lone surrogate) and a NUL in a key the index keeps (an execution
  id, flow id, tenant, owner, gate, timer id, holder) are ``UnstorableValueError``,
  as is an integer outside int64 where the store keeps one (timestamps, due times,
  lease expiries); each write refused writes nothing;
- an event larger than the store's ``max_event_bytes`` is ``PayloadTooLargeError``
  and one of exactly that size is taken (the size is the UTF-8 length of
  ``dumps(event.to_dict())``);
- a NUL inside a payload or a snapshot is kept byte for byte;
- arguments of the wrong type (a datetime where milliseconds are due, a string
  where an int is) are ``ValidationError``, never compared as something else.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import pytest

from fleet.kernel.errors import (
    FleetError,
    NotSerializableError,
    PayloadTooLargeError,
    UnstorableValueError,
    ValidationError,
)
from fleet.kernel.events import EventEnvelope, EventType, dumps
from fleet.kernel.store.spi import DEFAULT_MAX_EVENT_BYTES, EventStore, Snapshot, SnapshotStore

__all__ = ["SnapshotValueConformance", "ValueConformance"]

E = EventType
_T0 = 1_700_000_000_000


def _started(execution_id: str, *, flow_id: str = "flow", tenant: str | None = "acme",
             owner: str = "alice") -> EventEnvelope:
    return EventEnvelope.make(execution_id, 0, E.EXECUTION_STARTED, _T0, {
        "flowId": flow_id, "flowVersion": 1, "flowHash": "sha256:00", "input": None,
        "owner": {"actor": owner, "tenant": tenant}})


def _event(execution_id: str, sequence: int, kind: EventType, payload: dict[str, Any], *,
           timestamp: int | None = None) -> EventEnvelope:
    return EventEnvelope.make(execution_id, sequence, kind,
                              _T0 + sequence if timestamp is None else timestamp, payload)


class _Opaque:
    pass


class ValueConformance:
    """What an ``EventStore`` keeps and refuses; part of ``EventStoreConformance``."""

    # The max_event_bytes the fixture built the store with (None: no limit). A
    # fixture that builds its store with a smaller limit sets this to match.
    max_event_bytes: ClassVar[int | None] = DEFAULT_MAX_EVENT_BYTES

    async def test_values_no_store_keeps_are_refused_alike(self, store: EventStore) -> None:
        await store.append(_started("v"))
        before = [e.to_dict() for e in await store.read("v")]
        cases: list[tuple[type[FleetError], list[EventEnvelope]]] = [
            (NotSerializableError, [_event("v", 1, E.STEP_COMPLETED,
                                           {"stepId": "s", "attempt": 1, "output": {1, 2}})]),
            (NotSerializableError, [_event("v", 1, E.STEP_COMPLETED,
                                           {"stepId": "s", "attempt": 1,
                                            "output": _Opaque()})]),
            (NotSerializableError, [_event("v", 1, E.STEP_COMPLETED,
                                           {"stepId": "s", "attempt": 1,
                                            "output": float("nan")})]),
            (UnstorableValueError, [_event("v", 1, E.STEP_COMPLETED,
                                           {"stepId": "s", "attempt": 1,
                                            "output": "report-\udcff.txt"})]),
            (UnstorableValueError, [_event("v", 1, E.EXECUTION_SUSPENDED,
                                           {"condition": {"on": "appro\x00val"}})]),
            (UnstorableValueError, [_event("v", 1, E.TIMER_SCHEDULED,
                                           {"timerId": "t\x00", "dueAt": _T0})]),
            (UnstorableValueError, [_event("v", 1, E.TIMER_SCHEDULED,
                                           {"timerId": "t", "dueAt": 2**63})]),
            (UnstorableValueError, [_event("v", 1, E.STEP_COMPLETED,
                                           {"stepId": "s", "attempt": 1},
                                           timestamp=2**63)]),
            # A refused event in a batch refuses the whole batch.
            (UnstorableValueError, [_event("v", 1, E.STEP_COMPLETED,
                                           {"stepId": "ok", "attempt": 1}),
                                    _event("v", 2, E.EXECUTION_SUSPENDED,
                                           {"condition": {"on": "\x00"}})]),
        ]
        for error, events in cases:
            if len(events) == 1:
                with pytest.raises(error):
                    await store.append(events[0])
            with pytest.raises(error):
                await store.append_batch(events)
            assert [e.to_dict() for e in await store.read("v")] == before, events
        tip = (await store.append_if_unchanged("v", None)).tip
        with pytest.raises(UnstorableValueError):
            await store.append_if_unchanged("v", _event("v", 1, E.OUTCOME_RECORDED, {
                "decisionId": "d", "key": "k", "score": 1, "recordedBy": "\ud800"}), tip)
        assert await store.head("v") == 0
        summary = await store.get_execution("v")
        assert summary is not None
        assert (summary.status, summary.waiting_on) == ("running", None)
        assert await store.due_timers(2**62) == []

    async def test_keys_with_nul_or_lone_surrogates_are_refused_alike(
            self, store: EventStore) -> None:
        starts = [_started("a\x00b"), _started("a\udcffb"), _started("f1", flow_id="fl\x00w"),
                  _started("f2", tenant="t\x00"), _started("f3", owner="bo\x00b"),
                  _started("f4", owner="bo\udcffb")]
        for event in starts:
            with pytest.raises(UnstorableValueError):
                await store.append(event)
        assert await store.list_executions() == []
        for execution_id in ("a\x00b", "a\udcffb"):
            for call in (store.head(execution_id), store.read(execution_id),
                         store.get_execution(execution_id),
                         store.acquire_fence(execution_id, holder="w", lease_ms=1000),
                         store.append_if_unchanged(execution_id, None),
                         store.delete_execution(execution_id)):
                with pytest.raises(UnstorableValueError):
                    await call
        for holder in ("w\x00", "w\udcff"):
            with pytest.raises(UnstorableValueError):
                await store.acquire_fence("h", holder=holder, lease_ms=1000)
            with pytest.raises(UnstorableValueError):
                await store.acquire_fence_if("h", holder=holder, lease_ms=1000)
        assert (await store.append_if_unchanged("h", None)).tip.fence == 0  # never taken
        with pytest.raises(UnstorableValueError):
            await store.list_executions(waiting_on="g\x00")

    async def test_a_nul_inside_a_payload_is_kept(self, store: EventStore) -> None:
        events = [_started("nul"), _event("nul", 1, E.STEP_COMPLETED, {
            "stepId": "s", "attempt": 1, "output": {"text": "a\x00b", "k\x00": ["\x00"]}})]
        await store.append_batch(events)
        back = await store.read("nul")
        assert [json.dumps(e.to_dict(), sort_keys=True) for e in back] == [
            json.dumps(e.to_dict(), sort_keys=True) for e in events]
        assert back[1].payload["output"]["text"] == "a\x00b"

    async def test_an_event_over_the_size_limit_is_refused(self, store: EventStore) -> None:
        limit = self.max_event_bytes
        if limit is None:
            return  # a store built without a limit takes any size
        await store.append(_started("big"))

        def sized(size: int) -> EventEnvelope:
            bare = _event("big", 1, E.STEP_COMPLETED, {"stepId": "s", "attempt": 1,
                                                       "output": "ü"})
            base = len(dumps(bare.to_dict()).encode())
            fill = size - base  # each "é" is two bytes, each "x" one
            text = "ü" + "é" * (fill // 2) + "x" * (fill % 2)
            event = _event("big", 1, E.STEP_COMPLETED, {"stepId": "s", "attempt": 1,
                                                        "output": text})
            assert len(dumps(event.to_dict()).encode()) == size
            return event

        with pytest.raises(PayloadTooLargeError) as refused:
            await store.append(sized(limit + 1))
        assert refused.value.details["limit"] == limit
        with pytest.raises(PayloadTooLargeError):
            await store.append_batch([sized(limit + 1)])
        assert await store.head("big") == 0
        await store.append(sized(limit))
        assert await store.head("big") == 1

    async def test_arguments_of_the_wrong_type_are_refused(self, store: EventStore) -> None:
        await store.append(_started("arg"))
        await store.append(_event("arg", 1, E.TIMER_SCHEDULED, {"timerId": "t", "dueAt": _T0}))
        now = dt.datetime.now(dt.UTC)
        calls: list[tuple[type[FleetError], Callable[[], Awaitable[Any]]]] = [
            (ValidationError, lambda: store.due_timers(now)),  # type: ignore[arg-type]
            (ValidationError, lambda: store.due_timers(str(_T0))),  # type: ignore[arg-type]
            (ValidationError, lambda: store.due_timers(float(_T0))),  # type: ignore[arg-type]
            (UnstorableValueError, lambda: store.due_timers(2**63)),
            (ValidationError, lambda: store.list_executions(
                updated_before=now)),  # type: ignore[arg-type]
            (ValidationError, lambda: store.list_executions(
                lease_expired_at="1")),  # type: ignore[arg-type]
            (ValidationError, lambda: store.read("arg", after="0")),  # type: ignore[arg-type]
            (ValidationError, lambda: store.head(7)),  # type: ignore[arg-type]
            (UnstorableValueError, lambda: store.acquire_fence("arg", holder="w",
                                                               lease_ms=2**63)),
            (ValidationError, lambda: store.acquire_fence("arg", holder="w",
                                                          lease_ms=1.5)),  # type: ignore[arg-type]
        ]
        for error, call in calls:
            with pytest.raises(error):
                await call()
        assert [t.timer_id for t in await store.due_timers(_T0)] == ["t"]
        assert (await store.append_if_unchanged("arg", None)).tip.fence == 0


class SnapshotValueConformance:
    """What a ``SnapshotStore`` keeps and refuses; part of ``SnapshotStoreConformance``."""

    async def test_a_nul_in_a_state_is_kept(self, snapshot_store: SnapshotStore) -> None:
        state = {"values": {"text": "a\x00b", "k\x00y": ["\x00", 1]}, "z": 1, "a": 2}
        await snapshot_store.save(Snapshot("nul", 3, state))
        loaded = await snapshot_store.load("nul")
        assert loaded == Snapshot("nul", 3, state)

    async def test_a_state_no_store_keeps_is_refused(
            self, snapshot_store: SnapshotStore) -> None:
        with pytest.raises(UnstorableValueError):
            await snapshot_store.save(Snapshot("bad", 1, {"name": "report-\udcff.txt"}))
        with pytest.raises(UnstorableValueError):
            await snapshot_store.save(Snapshot("b\x00d", 1, {}))
        with pytest.raises(NotSerializableError):
            await snapshot_store.save(Snapshot("bad", 1, {"n": float("inf")}))
        assert await snapshot_store.load("bad") is None
