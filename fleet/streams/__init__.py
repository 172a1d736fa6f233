"""Redis streams for the fleet: durable events out, rewards in.

* ``EventPublisher``: a ``Service`` whose ``on_durable_event`` a ``Runtime``
  calls; it publishes every durable event of this process to
  ``fleet:events`` (at most once, bounded buffer, never blocks a run).
* ``StreamConsumer``: a consumer-group member as a ``Service`` (XREADGROUP,
  XACK, XAUTOCLAIM of a dead member's entries, dead letters after a bound).
* ``RewardMessage`` / ``sign_reward`` / ``submit_reward`` (and
  ``submit_rewards``, ``submit_reward_sync``): what reward producers send,
  HMAC-signed with their key from ``FLEET_REWARD_KEYS``.
* ``RewardAttacher``: the ``fleet-attachers`` group that verifies each reward
  and records it with ``record_outcome`` as the producer's principal; bad ones
  go to ``fleet:rewards:dead`` with the reason.

Needs the ``fleet`` extra (redis-py): ``pip install 'fleet[fleet]'``.
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
from fleet.streams.publisher import EventPublisher, event_fields
from fleet.streams.rewards import (
    REJECT_REASONS,
    RewardMessage,
    canonical_body,
    sign_reward,
    submit_reward,
    submit_reward_sync,
    submit_rewards,
    verify_reward,
)

__all__ = [
    "REJECT_REASONS",
    "Defer",
    "EventPublisher",
    "Handler",
    "Reject",
    "RewardAttacher",
    "RewardMessage",
    "StreamConsumer",
    "StreamEntry",
    "canonical_body",
    "default_consumer_name",
    "event_fields",
    "sign_reward",
    "submit_reward",
    "submit_reward_sync",
    "submit_rewards",
    "verify_reward",
]
