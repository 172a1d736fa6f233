"""The rewards inbox: where producers send, and how a reward gets onto the stream.

A producer that could ``XADD`` to the rewards stream could also wipe it
(``XADD ... MAXLEN 0`` deletes every pending reward) or jam it (an entry at the
largest id: no later ``XADD *`` succeeds), and Redis's ACL cannot forbid an
argument; a Redis function cannot help either, since it runs with its caller's
permissions, so the caller would need ``XADD`` itself (tested: decision 0042).
So producers do not touch the stream (issue 25 item 2). Their Redis user may
only ``LPUSH`` onto a list, ``fleet:rewards:inbox``: a list has no ids to jam
and ``LPUSH`` removes nothing. The attacher moves what arrives onto the stream
with ``MOVE_SCRIPT``, run as the attacher's user, which

* fixes the id: ``XADD <stream> * message <text>`` (Redis picks it);
* bounds the size: a message above ``max_bytes`` (64 KiB) goes to the dead
  letters instead, as a bounded excerpt (``message`` cut to ``excerpt_bytes``,
  with its size and SHA-1), reason ``oversized``, the dead stream itself capped
  (``MAXLEN ~``);
* loses nothing: each message is read (``LINDEX``), written, and only then
  popped, inside one script: a write Redis refuses (out of memory) leaves it in
  the inbox. The script is declared with flags (``#!lua``), so under
  ``maxmemory`` Redis refuses it whole before it starts.

Order: producers push on the left, the attacher takes from the right, oldest
first. Several attachers may move at once: each call of the script is atomic.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fleet.streams.redis_client import aioredis, as_text

log = logging.getLogger("fleet.rewards")

__all__ = ["EXCERPT_BYTES", "MOVE_SCRIPT", "RewardInbox"]

#: How much of an oversized message its dead letter keeps.
EXCERPT_BYTES = 4096

MOVE_SCRIPT = """#!lua
-- KEYS: inbox, stream, dead stream.
-- ARGV: most to move, largest message (bytes), excerpt (bytes), dead letters kept,
--       now (epoch ms), consumer name.
local inbox, stream, dead = KEYS[1], KEYS[2], KEYS[3]
local most, largest = tonumber(ARGV[1]), tonumber(ARGV[2])
local excerpt, kept = tonumber(ARGV[3]), ARGV[4]
local moved, oversized = 0, 0
for _ = 1, most do
  local message = redis.call('LINDEX', inbox, -1)
  if not message then break end
  if #message > largest then
    redis.call('XADD', dead, 'MAXLEN', '~', kept, '*',
      'message', string.sub(message, 1, excerpt),
      'dead_reason', 'oversized',
      'dead_detail', #message .. ' bytes; a reward message is at most ' .. largest,
      'dead_cut', '{"message":' .. #message .. '}',
      'dead_sha1', redis.sha1hex(message),
      'dead_stream', inbox, 'dead_id', '', 'dead_deliveries', '0',
      'dead_consumer', ARGV[6], 'dead_at', ARGV[5])
    oversized = oversized + 1
  else
    redis.call('XADD', stream, '*', 'message', message)
    moved = moved + 1
  end
  redis.call('RPOP', inbox)
end
return {moved, oversized, redis.call('LLEN', inbox)}
"""


class RewardInbox:
    """Moves rewards from the producers' inbox (a list) onto the attachers' stream.

    Args:
        redis: An asyncio Redis client (the attacher's user).
        inbox / stream / dead_stream: The three keys (``rewards_inbox``,
            ``rewards_stream``, ``rewards_dead``).
        max_bytes: The largest message moved; a larger one is dead-lettered.
        dead_maxlen: About how many dead letters the dead stream keeps.
        count: The most messages one call moves.
        consumer: Named in an oversized message's dead letter.
    """

    def __init__(self, redis: aioredis.Redis, *, inbox: str, stream: str, dead_stream: str,
                 max_bytes: int, dead_maxlen: int = 10_000, count: int = 100,
                 consumer: str = "") -> None:
        self.redis = redis
        self.keys = [inbox, stream, dead_stream]
        self.max_bytes = max_bytes
        self.dead_maxlen = dead_maxlen
        self.count = count
        self.consumer = consumer
        self._script: Any = redis.register_script(MOVE_SCRIPT)
        self.moved = 0
        self.oversized = 0
        self.waiting = 0  # messages in the inbox after the last move

    async def move(self) -> int:
        """Move up to ``count`` messages; how many reached the stream."""
        reply = await self._script(keys=self.keys, args=[
            self.count, self.max_bytes, EXCERPT_BYTES, self.dead_maxlen,
            time.time_ns() // 1_000_000, self.consumer])
        moved, oversized, waiting = (int(as_text(v)) for v in reply)
        self.moved += moved
        self.waiting = waiting
        if oversized:
            self.oversized += oversized
            log.warning("%d reward message(s) above %d bytes dead-lettered oversized on %s",
                        oversized, self.max_bytes, self.keys[2])
        return moved

    def stats(self) -> dict[str, int]:
        return {"moved": self.moved, "oversized": self.oversized, "inbox": self.waiting}
