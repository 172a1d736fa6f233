"""The optional Redis client, imported only here, and the reply shapes it returns.

redis-py is in the ``fleet`` extra; without it importing ``fleet.streams``
raises ``MissingDependencyError`` naming the extra. Replies come back as bytes
or str depending on the client's ``decode_responses``, and stream reads in
RESP2 (lists) or RESP3 (maps) depending on its ``protocol``: the helpers
below take either, so a caller may pass any client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleet.kernel.errors import MissingDependencyError

try:
    import redis as sync_redis
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError, ResponseError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        "fleet.streams needs redis-py: pip install 'fleet-durable[fleet]'") from exc

# A connection that cannot be made, or that breaks, is a RedisError subclass
# or (below redis-py) an OSError: both mean "not now", never "wrong".
TRANSIENT = (RedisError, OSError)

__all__ = ["TRANSIENT", "RedisError", "ResponseError", "aioredis", "as_text",
           "read_entries", "sync_redis"]


def as_text(value: Any) -> str:
    """A reply value as text (bytes are UTF-8, undecodable bytes replaced)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def read_entries(reply: Any) -> list[tuple[Any, Mapping[Any, Any] | None]]:
    """The ``(id, fields)`` pairs of an XREAD/XREADGROUP reply for one stream.

    RESP2 gives ``[[name, [(id, fields), ...]]]``; RESP3 gives
    ``{name: [[(id, fields), ...]]}``. A deleted entry read from a pending
    list has no fields (``None`` or ``{}``).
    """
    if not reply:
        return []
    if isinstance(reply, Mapping):
        out: list[tuple[Any, Mapping[Any, Any] | None]] = []
        for value in reply.values():
            batches = value
            # RESP3 nests the entries one level deeper than RESP2.
            if batches and isinstance(batches[0], list):
                for batch in batches:
                    out.extend((eid, fields) for eid, fields in batch)
            else:
                out.extend((eid, fields) for eid, fields in batches)
        return out
    out = []
    for _name, entries in reply:
        out.extend((eid, fields) for eid, fields in entries)
    return out
