"""Reward messages: the schema producers send, how they are signed, how they are sent.

A producer ``XADD``s one entry per reward to ``fleet:rewards`` with one field,
``message``: a JSON object with these names (``RewardMessage``)::

    execution_id  str    the finished execution the reward is for
    decision_id   str    a decision that execution recorded (ctx.decide)
    key           str    1-256 chars; namespace it ("csat:1"); (decision_id, key)
                         is the idempotency identity: the same value twice is
                         one outcome, a different value is refused
    score         number optional, finite, |score| <= 1e9
    success       bool   optional; score, success or both
    producer      str    names the key in FLEET_REWARD_KEYS that signed it
    sent_at       int    epoch milliseconds when the producer sent it
    nonce         str    optional; anything the producer wants to tell copies apart
    signature     str    hex HMAC-SHA256 of the canonical body, keyed by the
                         producer's key

The body is the message without ``signature``, as canonical JSON: keys
sorted, no whitespace (``","`` and ``":"``), UTF-8 (non-ASCII characters
unescaped), numbers as Python's ``json`` writes them. A non-Python producer
must write the same bytes; ``docs/decisions/0011-reward-producers.md`` has a
test vector. Integers stay integers (``1`` is not ``1.0``): the attacher
re-serialises the JSON it received, so a producer that signs what it sends
round-trips as long as its numbers print as Python prints them.

No freshness window: replaying a message is harmless because attaching is
idempotent by ``(decision_id, key)``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic import ValidationError as PydanticValidationError

from fleet.kernel.errors import ConfigurationError, ValidationError
from fleet.streams.redis_client import aioredis, sync_redis

if TYPE_CHECKING:
    from fleet.config import FleetSettings

__all__ = ["REJECT_REASONS", "RewardMessage", "canonical_body", "sign_reward",
           "submit_reward", "submit_reward_from_settings", "submit_reward_sync", "submit_rewards",
           "verify_reward"]

MESSAGE_FIELD = "message"
#: Why ``verify_reward`` refuses a message (``ValidationError.details["reason"]``).
REJECT_REASONS = ("malformed", "unsigned", "unknown_producer", "bad_signature", "invalid")
_BATCH = 500


class RewardMessage(BaseModel):
    """One reward from a producer (see the module docstring for the wire form)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    execution_id: str = Field(min_length=1)
    decision_id: str = Field(min_length=1)
    key: str = Field(min_length=1, max_length=256)
    score: float | None = None
    success: bool | None = None
    producer: str = Field(min_length=1)
    sent_at: int = Field(ge=0)
    nonce: str | None = None
    signature: str | None = None

    @model_validator(mode="after")
    def _score_or_success(self) -> RewardMessage:
        if self.score is None and self.success is None:
            raise ValueError("a reward needs a score, a success flag or both")
        return self

    def body(self) -> dict[str, Any]:
        """The signed part: every set field except ``signature``."""
        return self.model_dump(exclude={"signature"}, exclude_none=True)

    def to_wire(self) -> str:
        """The ``message`` field's text (canonical JSON, signature included)."""
        return _canonical(self.model_dump(exclude_none=True))


def _canonical(value: Mapping[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def canonical_body(message: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: the message without ``signature``, canonical JSON.

    Raises:
        ValueError: a number in it is NaN or infinite (no canonical form).
    """
    return _canonical({k: v for k, v in message.items() if k != "signature"}).encode()


def _hmac(key: str | bytes, body: bytes) -> str:
    secret = key.encode() if isinstance(key, str) else key
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def sign_reward(message: RewardMessage, key: str | bytes) -> RewardMessage:
    """``message`` with its ``signature`` set, keyed by the producer's ``key``."""
    return message.model_copy(update={"signature": _hmac(key, canonical_body(message.body()))})


def _refuse(reason: str, detail: str) -> ValidationError:
    return ValidationError(f"reward refused ({reason}): {detail}", reason=reason)


def verify_reward(text: str | bytes | None, keys: Mapping[str, str]) -> RewardMessage:
    """Parse, authenticate and validate one ``message`` field.

    Checks in this order, each a ``ValidationError`` whose ``details["reason"]``
    says which: ``malformed`` (not a JSON object), ``unsigned`` (no
    signature), ``unknown_producer`` (no producer, or none with a key in
    ``keys``), ``invalid`` (a NaN or infinite number, which has no canonical
    form), ``bad_signature`` (the HMAC does not match), ``invalid`` (the schema
    refuses it: a missing or extra field, a wrong type, no score or success).
    The signature is checked before the schema, so nothing about an
    unauthenticated message is judged beyond what finding its key needs.
    """
    if text is None:
        raise _refuse("malformed", f"the entry has no {MESSAGE_FIELD!r} field")
    try:
        data = json.loads(text)
    except (ValueError, TypeError) as exc:
        raise _refuse("malformed", f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise _refuse("malformed", f"not a JSON object but {type(data).__name__}")
    signature = data.get("signature")
    if not isinstance(signature, str) or not signature:
        raise _refuse("unsigned", "no signature")
    producer = data.get("producer")
    if not isinstance(producer, str) or producer not in keys:
        raise _refuse("unknown_producer", f"no key for producer {producer!r}")
    try:
        body = canonical_body(data)
    except ValueError as exc:
        raise _refuse("invalid", f"a number is NaN or infinite ({exc})") from exc
    if not hmac.compare_digest(_hmac(keys[producer], body), signature):
        raise _refuse("bad_signature", f"the signature does not match producer {producer!r}'s"
                      " key over the canonical body")
    try:
        return RewardMessage.model_validate(data)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise _refuse("invalid", f"{where}: {first['msg']}") from exc


def _signed(message: RewardMessage, key: str | bytes | None) -> RewardMessage:
    if key is not None:
        return sign_reward(message, key)
    if not message.signature:
        raise ConfigurationError("submit_reward: the message is unsigned and no key was given")
    return message


async def submit_reward(redis: aioredis.Redis, stream: str, message: RewardMessage,
                        key: str | bytes | None) -> str:
    """Sign ``message`` with ``key`` (None: send it as already signed) and XADD it.

    Returns:
        The stream entry id.
    """
    entry = await redis.xadd(stream, {MESSAGE_FIELD: _signed(message, key).to_wire()})
    return entry.decode() if isinstance(entry, bytes) else str(entry)


async def submit_rewards(redis: aioredis.Redis, stream: str,
                         messages: Sequence[RewardMessage], key: str | bytes | None) -> list[str]:
    """``submit_reward`` for many, pipelined (a few round trips per thousand)."""
    ids: list[str] = []
    for start in range(0, len(messages), _BATCH):
        pipe = redis.pipeline(transaction=False)
        for message in messages[start:start + _BATCH]:
            pipe.xadd(stream, {MESSAGE_FIELD: _signed(message, key).to_wire()})
        ids.extend(e.decode() if isinstance(e, bytes) else str(e) for e in await pipe.execute())
    return ids


def submit_reward_sync(redis: sync_redis.Redis, stream: str, message: RewardMessage,
                       key: str | bytes | None) -> str:
    """``submit_reward`` from synchronous code, on a synchronous client.

    Raises:
        ConfigurationError: called inside a running event loop, where a
            blocking network call would stall every other task; use
            ``await submit_reward(...)`` there.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise ConfigurationError(
            "submit_reward_sync was called inside a running event loop; "
            "use `await submit_reward(...)` there")
    entry = redis.xadd(stream, {MESSAGE_FIELD: _signed(message, key).to_wire()})
    return entry.decode() if isinstance(entry, bytes) else str(entry)


def submit_reward_from_settings(settings: FleetSettings, *, execution_id: str,
                                decision_id: str, key: str, producer: str,
                                score: float | None = None, success: bool | None = None,
                                secret: str | bytes | None = None,
                                nonce: str | None = None) -> str:
    """Build, sign and send one reward to ``settings.rewards_stream`` (``fleet reward submit``).

    Args:
        settings: ``redis_url``, ``rewards_stream`` and ``reward_keys``.
        secret: The producer's HMAC key; default ``settings.reward_keys[producer]``.

    Returns:
        The stream entry id.

    Raises:
        ConfigurationError: no Redis URL, or no key for ``producer``.
        ValidationError: the reward does not fit the schema (``RewardMessage``).
    """
    if not settings.redis_url:
        raise ConfigurationError("submitting a reward needs FLEET_REDIS_URL")
    if secret is None:
        secret = settings.reward_keys.get(producer)
        if secret is None:
            raise ConfigurationError(f"no key for producer {producer!r}: add it to "
                                     "FLEET_REWARD_KEYS or give the key (--key-file)")
    try:
        message = RewardMessage(execution_id=execution_id, decision_id=decision_id, key=key,
                                score=score, success=success, producer=producer,
                                sent_at=time.time_ns() // 1_000_000, nonce=nonce)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise ValidationError(f"reward refused: {where}: {first['msg']}",
                              reason="invalid") from exc
    client = sync_redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5.0,
                                       socket_timeout=10.0)
    try:
        return submit_reward_sync(client, settings.rewards_stream, message, secret)
    finally:
        client.close()
