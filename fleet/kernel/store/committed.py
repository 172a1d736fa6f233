"""Where events sit in a store's commit order: ``Position``, ``ORIGIN``, ``CommittedEvent``.

The types of the committed feed (``EventStore.read_committed``, decision 0020),
re-exported by ``spi``; kept apart so ``spi`` stays the protocols and their shared
checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.kernel.errors import CorruptLogError, ValidationError
from fleet.kernel.events import EventEnvelope

__all__ = ["ORIGIN", "CommittedEvent", "Position"]


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """Where an event sits in its store's commit order (``read_committed``).

    Two integers compared in order: Postgres uses (inserting transaction id,
    a per-insert sequence number), SQLite and memory (a commit counter, 0).
    Positions of one store only grow; they are never reused, not even after a
    deletion or a compaction. ``str(position)`` is ``"major-minor"``, which is
    also a valid Redis stream entry id (the relay publishes under it).
    Positions of different stores are not comparable.
    """

    major: int
    minor: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.major < 2**64 and 0 <= self.minor < 2**64):
            raise ValidationError(f"a position is two integers in [0, 2**64), got "
                                  f"{self.major}-{self.minor}")

    def __str__(self) -> str:
        return f"{self.major}-{self.minor}"

    @classmethod
    def parse(cls, text: str) -> Position:
        """``"12-3"`` (or ``"12"``, minor 0) -> ``Position(12, 3)``; anything else is refused."""
        major, sep, minor = str(text).strip().partition("-")
        try:
            # ASCII only: str.isdigit() also takes '²' (int() refuses it) and '٣'.
            if not (major + minor).isascii() or not major.isdigit() or (
                    sep and not minor.isdigit()):
                raise ValueError(text)
            return cls(int(major), int(minor) if sep else 0)
        except (ValueError, ValidationError):
            raise ValidationError(f"{text!r} is not a position: two non-negative integers "
                                  "as 'major-minor', e.g. '5123-17'") from None


#: Before every event: ``read_committed(after=ORIGIN)`` reads from the first.
ORIGIN = Position(0, 0)


class CommittedEvent:
    """One event of the committed feed: where it sits, the event, its execution's tenant.

    ``json`` is the envelope exactly as the store holds it (the canonical JSON
    of ``EventEnvelope.to_json``); ``event`` parses it on first use (a reader
    that only forwards the text, such as the relay, never pays for that), and
    raises ``CorruptLogError`` for a row that is not the envelope it should be.
    ``tenant`` comes from the execution index (None: no tenant, or the index row
    is gone). Two are equal when position, text and tenant are.
    """

    __slots__ = ("_event", "_json", "execution_id", "position", "sequence", "tenant", "type")

    def __init__(self, position: Position, event: EventEnvelope | None = None,
                 tenant: str | None = None, *, json: str | None = None,
                 execution_id: str | None = None, sequence: int | None = None,
                 type: str | None = None) -> None:
        if event is None and (json is None or execution_id is None or sequence is None
                              or type is None):
            raise ValidationError("a CommittedEvent needs the event, or its JSON with its "
                                  "execution id, sequence and type")
        self.position = position
        self.tenant = tenant
        self._event = event
        self._json = json
        self.execution_id: str = event.execution_id if event is not None else str(execution_id)
        self.sequence: int = event.sequence if event is not None else int(sequence or 0)
        self.type: str = event.type.value if event is not None else str(type)

    @property
    def event(self) -> EventEnvelope:
        if self._event is None:
            assert self._json is not None
            try:
                event = EventEnvelope.from_json(self._json)
            except CorruptLogError as exc:
                raise CorruptLogError(f"execution {self.execution_id!r} sequence "
                                      f"{self.sequence} is corrupt: {exc.message}",
                                      execution_id=self.execution_id,
                                      sequence=self.sequence) from exc
            if event.execution_id != self.execution_id or event.sequence != self.sequence:
                raise CorruptLogError(f"execution {self.execution_id!r} sequence "
                                      f"{self.sequence} holds the envelope of {event.id!r}",
                                      execution_id=self.execution_id, sequence=self.sequence)
            self._event = event
        return self._event

    @property
    def json(self) -> str:
        if self._json is None:
            assert self._event is not None
            self._json = self._event.to_json()
        return self._json

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CommittedEvent):
            return NotImplemented
        return (self.position, self.json, self.tenant) == (other.position, other.json,
                                                           other.tenant)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"CommittedEvent({self.position}, {self.execution_id!r}-{self.sequence} "
                f"{self.type}, tenant={self.tenant!r})")
