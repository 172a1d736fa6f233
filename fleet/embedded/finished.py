"""Each execution that finished, as it finishes: what ``fleet up`` prints while it runs.

Read from the events stream the relay writes (every committed event, once, in
commit order), so an execution finished by any worker, or by a command in
another shell, is seen; nothing is asked of the store. The watcher begins at
the stream's end: what finished before it started is not repeated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fleet.kernel.errors import ValidationError
from fleet.streams.events import parse_entry
from fleet.streams.redis_client import TRANSIENT, as_text, read_entries, sync_redis

#: The events that end an execution, and the word for each.
ENDS = {"EXECUTION_COMPLETED": "completed", "EXECUTION_FAILED": "failed",
        "EXECUTION_CANCELLED": "cancelled", "EXECUTION_CONTINUED": "continued"}


@dataclass(frozen=True, slots=True)
class Finished:
    """One execution that ended.

    Attributes:
        execution_id: Its id, whole.
        status: ``completed``, ``failed``, ``cancelled`` or ``continued``.
        at_ms: When its end was written (milliseconds since the epoch).
        flow_id: Its flow, when its start was seen by this watcher.
        took_s: From its start to its end, when its start was seen.
        detail: The error of a failed one, the reason of a cancelled one, the
            successor of a continued one.
    """

    execution_id: str
    status: str
    at_ms: int
    flow_id: str | None = None
    took_s: float | None = None
    detail: str = ""

    def line(self) -> str:
        """``HH:MM:SS completed onboard <id> in 1.2 s`` (local time)."""
        when = time.strftime("%H:%M:%S", time.localtime(self.at_ms / 1000))
        parts = [when, self.status, self.flow_id or "-", self.execution_id]
        if self.took_s is not None:
            parts.append(f"in {self.took_s:.1f} s")
        return " ".join(parts) + (f": {self.detail}" if self.detail else "")


class FinishedWatcher:
    """Reads the events stream for executions that end (sync; one caller at a time).

    Args:
        redis_url: The Redis the relay publishes to.
        stream: ``FLEET_EVENTS_STREAM``.
        block_ms: How long ``poll`` waits for new entries.
    """

    def __init__(self, redis_url: str, stream: str, *, block_ms: int = 1000) -> None:
        self.stream = stream
        self.block_ms = block_ms
        self._client: Any = sync_redis.Redis.from_url(
            redis_url, socket_connect_timeout=2.0, socket_timeout=block_ms / 1000 + 5.0)
        self._cursor: str | None = None
        self._starts: dict[str, tuple[str, int]] = {}

    def poll(self) -> list[Finished]:
        """The executions that ended since the last call (waits up to ``block_ms``).

        Raises:
            RedisError, OSError: Redis did not answer (the caller may try again).
        """
        if self._cursor is None:
            last = self._client.xrevrange(self.stream, count=1)
            self._cursor = as_text(last[0][0]) if last else "0-0"
        reply = self._client.xread({self.stream: self._cursor}, count=500,
                                   block=self.block_ms)
        found: list[Finished] = []
        for raw_id, raw in read_entries(reply):
            self._cursor = as_text(raw_id)
            fields = {as_text(k): as_text(v) for k, v in (raw or {}).items()}
            try:
                event = parse_entry(self._cursor, fields).event
            except ValidationError:
                continue  # not the relay's entry: nothing to say about it
            kind = str(event.type)
            if kind == "EXECUTION_STARTED" and event.sequence == 0:
                self._starts[event.execution_id] = (str(event.payload.get("flowId")),
                                                    event.timestamp)
            elif kind in ENDS:
                flow, began = self._starts.pop(event.execution_id, (None, None))
                found.append(Finished(
                    event.execution_id, ENDS[kind], event.timestamp, flow,
                    None if began is None else max(0, event.timestamp - began) / 1000,
                    _detail(kind, event.payload)))
        return found

    def close(self) -> None:
        self._client.close()


def _detail(kind: str, payload: dict[str, Any]) -> str:
    if kind == "EXECUTION_FAILED":
        error = payload.get("error") or {}
        return f"{error.get('type', 'error')}: {error.get('message', '')}"[:200]
    if kind == "EXECUTION_CANCELLED":
        return str(payload.get("reason") or "")[:200]
    if kind == "EXECUTION_CONTINUED":
        return f"as {payload.get('nextExecutionId')}"
    return ""


__all__ = ["ENDS", "TRANSIENT", "Finished", "FinishedWatcher"]
