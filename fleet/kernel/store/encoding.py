"""The stored form of events and snapshots, and the checks every backend makes before a
write (split from ``spi``, which states the contract they serve).

``encode_event`` is the one refusal path of an event (its id, JSON, Unicode, the
index's keys and integers, its size), ``encode_state`` a snapshot's;
``creation_anchor`` is the mark that tells one log from a re-created one of the same
id.
"""

from __future__ import annotations

from fleet.kernel.errors import (
    NotSerializableError,
    PayloadTooLargeError,
    UnstorableValueError,
    ValidationError,
)
from fleet.kernel.events import EventEnvelope, EventType, dumps
from fleet.kernel.store.spi import Snapshot, check_id
from fleet.kernel.values import INT64_MAX, INT64_MIN, check_int64, check_text, printable

__all__ = ["creation_anchor", "encode_event", "encode_state"]


# The kinds whose payload fields the index keeps (see ``index_change``).
_INDEXED_KINDS = frozenset({EventType.EXECUTION_STARTED, EventType.EXECUTION_SUSPENDED,
                            EventType.TIMER_SCHEDULED, EventType.TIMER_FIRED,
                            EventType.TIMER_CANCELLED})


def encode_event(event: EventEnvelope, max_bytes: int | None) -> str:
    """The stored form of ``event`` (``dumps(event.to_dict())``), or a typed refusal.

    Every backend calls this before it writes: the id matches the slot, the
    event is JSON (``NotSerializableError``), valid Unicode, and the keys and
    integers the index keeps are storable (``UnstorableValueError``), and it is
    within ``max_bytes`` (``PayloadTooLargeError``). On the hot path of every
    append, so the common case (an ASCII id, small ints) is checked inline.
    """
    execution_id = event.execution_id
    if type(execution_id) is not str or "\x00" in execution_id \
            or not execution_id.isascii():
        check_id(execution_id)
    sequence, timestamp = event.sequence, event.timestamp
    if type(sequence) is not int or not INT64_MIN <= sequence <= INT64_MAX:
        check_int64(sequence, "sequence")
    if type(timestamp) is not int or not INT64_MIN <= timestamp <= INT64_MAX:
        check_int64(timestamp, "timestamp")
    if event.id != f"{execution_id}-{sequence}":
        raise ValidationError(f"event id {printable(event.id, 80)!r} does not match "
                              f"{printable(execution_id, 80)!r}-{event.sequence}")
    try:
        body = event.to_json()  # dumps(event.to_dict()), the envelope's fields written around it
    except (TypeError, ValueError, RecursionError) as exc:
        raise NotSerializableError(f"event {printable(event.id, 80)!r} ({event.type}) is not "
                                   f"JSON: {printable(exc, 300)}") from exc
    size = len(body)
    if not body.isascii():
        try:
            size = len(body.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise UnstorableValueError(
                f"event {printable(event.id, 80)!r} ({event.type}) holds text that is not "
                "valid Unicode (a lone surrogate); no store can keep it") from exc
    if max_bytes is not None and size > max_bytes:
        raise PayloadTooLargeError(
            f"event {printable(event.id, 80)!r} ({event.type}) is {size} bytes; this store "
            f"takes events up to {max_bytes} (max_event_bytes): keep large results outside "
            "the log and record a reference", size=size, limit=max_bytes)
    if event.type in _INDEXED_KINDS:
        _check_index_fields(event)
    return body


def _check_index_fields(event: EventEnvelope) -> None:
    """The payload fields the index keeps as keys or integers (see ``index_change``)."""
    p = event.payload
    kind = event.type
    if kind is EventType.EXECUTION_STARTED and event.sequence == 0:
        check_text(p.get("flowId", ""), "flow id")
        owner = p.get("owner") or {}
        for what in ("actor", "tenant"):
            value = owner.get(what) if isinstance(owner, dict) else None
            if value is not None:
                check_text(value, f"owner {what}")
    elif kind is EventType.EXECUTION_SUSPENDED:
        condition = p.get("condition") or {}
        on = condition.get("on") if isinstance(condition, dict) else None
        if on is not None:
            check_text(on, "the gate an execution waits on")
    elif kind is EventType.TIMER_SCHEDULED:
        check_text(p.get("timerId"), "timer id")
        check_int64(p.get("dueAt"), "timer due time (dueAt)")
    elif kind is EventType.TIMER_FIRED or kind is EventType.TIMER_CANCELLED:
        check_text(p.get("timerId"), "timer id")


def encode_state(snapshot: Snapshot) -> str:
    """The stored form of a snapshot's state (JSON text), or a typed refusal.

    NUL is kept (JSON escapes it); a lone surrogate and a value that is not JSON
    are refused, alike on every snapshot store.
    """
    check_id(snapshot.execution_id)
    check_int64(snapshot.sequence, "snapshot sequence")
    try:
        text = dumps(snapshot.state)
    except (TypeError, ValueError, RecursionError) as exc:
        raise NotSerializableError(f"snapshot of {printable(snapshot.execution_id, 80)!r} is "
                                   f"not JSON: {printable(exc, 300)}") from exc
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UnstorableValueError(
                f"snapshot of {printable(snapshot.execution_id, 80)!r} holds text that is "
                "not valid Unicode (a lone surrogate); no store can keep it") from exc
    return text


def creation_anchor(first: EventEnvelope) -> str:
    """The creation marker of a log: timestamp and id of its sequence-0 event."""
    return f"{first.timestamp}:{first.id}"
