"""Redis streams for the fleet: durable events out, rewards in.

* ``EventRelay``: the store's committed events onto ``fleet:events``, each once,
  in commit order, under ids equal to their store positions (``fleet relay``;
  decision 0021). ``EventStreamConsumer``, ``backfill``, ``parse_entry``:
  reading it (at least once, idempotent by position, the trimmed part from
  the store).
* ``EventPublisher``: ADR 0147's in-process hook onto a stream of your own (at
  most once, a buffer bounded in events and bytes, never blocks a run); no
  fleet role runs one.
* ``StreamConsumer``: a consumer-group member as a ``Service`` (XREADGROUP,
  XACK, XAUTOCLAIM of a dead member's entries, dead letters after a bound).
* ``RewardMessage`` / ``sign_reward`` / ``submit_reward`` (and
  ``submit_rewards``, ``submit_reward_sync``): what reward producers send,
  HMAC-signed with their key from ``FLEET_REWARD_KEYS`` (or the key file
  ``FLEET_REWARD_KEYS_FILE``: the same JSON object, producer -> secret).
* ``RewardAttacher``: the ``fleet-attachers`` group that verifies each reward
  and records it with ``record_outcome`` as the producer's principal, within
  the tenants ``FLEET_REWARD_TENANTS`` gives it (decision 0025); bad ones go
  to ``fleet:rewards:dead`` with the reason, on their first delivery.

Needs the ``fleet`` extra (redis-py): ``pip install 'fleet-durable[fleet]'``.
"""

from fleet.streams.attacher import RewardAttacher
from fleet.streams.consumer import (
    Defer,
    Handler,
    Reject,
    StreamConsumer,
    StreamEntry,
    default_consumer_name,
)
from fleet.streams.events import (
    EventFilter,
    EventStreamConsumer,
    RedisCheckpoint,
    backfill,
    parse_entry,
)
from fleet.streams.publisher import EventPublisher, event_fields
from fleet.streams.relay import EventRelay, RelayLease
from fleet.streams.rewards import (
    MAX_MESSAGE_BYTES,
    REJECT_REASONS,
    RewardKeyError,
    RewardMessage,
    canonical_body,
    sign_reward,
    submit_reward,
    submit_reward_sync,
    submit_rewards,
    verify_reward,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "REJECT_REASONS",
    "Defer",
    "EventFilter",
    "EventPublisher",
    "EventRelay",
    "EventStreamConsumer",
    "Handler",
    "RedisCheckpoint",
    "Reject",
    "RelayLease",
    "RewardAttacher",
    "RewardKeyError",
    "RewardMessage",
    "StreamConsumer",
    "StreamEntry",
    "backfill",
    "canonical_body",
    "default_consumer_name",
    "event_fields",
    "parse_entry",
    "sign_reward",
    "submit_reward",
    "submit_reward_sync",
    "submit_rewards",
    "verify_reward",
]
