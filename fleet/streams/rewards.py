"""Reward messages: the schema producers send, how they are signed, how they are sent.

A producer pushes one message per reward onto the inbox ``fleet:rewards:inbox``
(``LPUSH``, a Redis list: its only right; the attacher moves each onto the
``fleet:rewards`` stream, ``fleet.streams.inbox``, issue 25 item 2). The message
is a JSON object with these names (``RewardMessage``)::

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
idempotent by ``(decision_id, key)``. A ``message`` above ``MAX_MESSAGE_BYTES``
(64 KiB) is refused unread (``oversized``).

Producers' keys are one JSON object, producer -> secret, wherever they are
read (``FLEET_REWARD_KEYS``, ``FLEET_REWARD_KEYS_FILE``, ``fleet reward submit
--key-file``, the ``.fleet/reward-keys.json`` ``fleet up`` writes):
``fleet.host.keys.read_reward_keys``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic import ValidationError as PydanticValidationError

from fleet.host.keys import RewardKeyError, read_reward_keys, reward_keys_of
from fleet.kernel.errors import ConfigurationError, ValidationError
from fleet.kernel.security import check_outcome_shape
from fleet.streams.redis_client import aioredis, sync_redis

if TYPE_CHECKING:
    from fleet.config import FleetSettings

__all__ = ["MAX_MESSAGE_BYTES", "REJECT_REASONS", "RewardKeyError", "RewardMessage",
           "canonical_body", "reward_id", "sign_reward", "submit_reward",
           "submit_reward_from_settings", "submit_reward_sync", "submit_rewards",
           "verify_reward"]

MESSAGE_FIELD = "message"
#: Why ``verify_reward`` refuses a message (``ValidationError.details["reason"]``).
REJECT_REASONS = ("oversized", "malformed", "unsigned", "unknown_producer", "bad_signature",
                  "invalid")
#: The largest ``message`` field the attacher reads (UTF-8 bytes): a reward is a
#: few hundred bytes; anything near this is not one.
MAX_MESSAGE_BYTES = 64 * 1024
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


def verify_reward(text: str | bytes | None, keys: Mapping[str, str], *,
                  max_bytes: int = MAX_MESSAGE_BYTES) -> RewardMessage:
    """Parse, authenticate and validate one ``message`` field.

    Checks in this order, each a ``ValidationError`` whose ``details["reason"]``
    says which: ``oversized`` (more than ``max_bytes`` bytes), ``malformed``
    (not UTF-8, not a JSON object, nested too deeply, a string that is not
    valid Unicode), ``unsigned`` (no signature), ``unknown_producer`` (no
    producer, or none with a key in ``keys``), ``invalid`` (a NaN or infinite
    number, which has no canonical form), ``bad_signature`` (the HMAC does not
    match, whatever text the signature holds), ``invalid`` (the schema refuses
    it: a missing or extra field, a wrong type, no score or success). The
    signature is checked before the schema, so nothing about an
    unauthenticated message is judged beyond what finding its key needs.

    Never raises anything else: every refusal is final (the same bytes are
    refused the same way on every delivery), so the caller dead-letters it at
    once (issue 10 item 9).
    """
    try:
        return _verify(text, keys, max_bytes)
    except (ValidationError, MemoryError):
        raise
    except Exception as exc:  # parsing is pure: a fault here never heals
        raise _refuse("malformed", f"unreadable ({type(exc).__name__}: "
                      f"{str(exc)[:200]})") from exc


def _verify(text: str | bytes | None, keys: Mapping[str, str], max_bytes: int) -> RewardMessage:
    if text is None:
        raise _refuse("malformed", f"the entry has no {MESSAGE_FIELD!r} field")
    size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise _refuse("oversized", f"{size} bytes; a reward message is at most {max_bytes}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _refuse("malformed", f"not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start})") from exc
    try:
        data = json.loads(text)
    except RecursionError as exc:
        raise _refuse("malformed", "not JSON a reward can be: nested too deeply") from exc
    except (ValueError, TypeError) as exc:
        raise _refuse("malformed", f"not JSON: {str(exc)[:200]}") from exc
    if not isinstance(data, dict):
        raise _refuse("malformed", f"not a JSON object but {type(data).__name__}")
    signature = data.get("signature")
    if not isinstance(signature, str) or not signature:
        raise _refuse("unsigned", "no signature")
    producer = data.get("producer")
    if not isinstance(producer, str) or producer not in keys:
        shown = producer[:80] if isinstance(producer, str) else producer
        raise _refuse("unknown_producer", f"no key for producer {shown!r}")
    try:
        body = canonical_body(data)
    except UnicodeEncodeError as exc:
        raise _refuse("malformed", "a string holds a lone surrogate (not valid Unicode "
                      "text), so the message has no canonical form") from exc
    except RecursionError as exc:
        raise _refuse("malformed", "nested too deeply to have a canonical form") from exc
    except ValueError as exc:
        raise _refuse("invalid", f"a number is NaN or infinite ({exc})") from exc
    # Compared as bytes: compare_digest refuses str holding non-ASCII characters
    # (TypeError), and any text a sender puts here must simply not match.
    given = signature.encode("utf-8", "surrogatepass")
    if not hmac.compare_digest(_hmac(keys[producer], body).encode(), given):
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


def reward_id(message: RewardMessage) -> str:
    """How a sent reward is named (what ``submit_reward`` returns): its ``nonce``, else the
    start of its signature. The attacher's dead letters carry the message, so either
    finds it there."""
    return message.nonce or (message.signature or "")[:32]


async def submit_reward(redis: aioredis.Redis, inbox: str, message: RewardMessage,
                        key: str | bytes | None) -> str:
    """Sign ``message`` with ``key`` (None: send it as already signed) and push it onto the
    rewards ``inbox`` (``FLEET_REWARDS_INBOX``).

    Returns:
        The reward's id (``reward_id``).
    """
    signed = _signed(message, key)
    await redis.lpush(inbox, signed.to_wire())
    return reward_id(signed)


async def submit_rewards(redis: aioredis.Redis, inbox: str,
                         messages: Sequence[RewardMessage], key: str | bytes | None) -> list[str]:
    """``submit_reward`` for many, pipelined (a few round trips per thousand)."""
    ids: list[str] = []
    for start in range(0, len(messages), _BATCH):
        signed = [_signed(message, key) for message in messages[start:start + _BATCH]]
        await redis.lpush(inbox, *(m.to_wire() for m in signed))
        ids.extend(reward_id(m) for m in signed)
    return ids


def submit_reward_sync(redis: sync_redis.Redis, inbox: str, message: RewardMessage,
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
    signed = _signed(message, key)
    redis.lpush(inbox, signed.to_wire())
    return reward_id(signed)


def submit_reward_from_settings(settings: FleetSettings, *, execution_id: str,
                                decision_id: str, key: str, producer: str,
                                score: float | None = None, success: bool | None = None,
                                key_file: str | os.PathLike[str] | None = None,
                                nonce: str | None = None) -> str:
    """Build, sign and send one reward to ``settings.rewards_inbox`` (``fleet reward submit``).

    Everything that can be refused is refused before anything is sent: no key
    for ``producer``, a reward the schema or the attacher would refuse.

    Args:
        settings: ``redis_url``, ``rewards_stream`` and the producers' keys
            (``FLEET_REWARD_KEYS`` or ``FLEET_REWARD_KEYS_FILE``).
        key_file: A reward key file (``{"producer": "secret"}``, what ``fleet up``
            writes to ``.fleet/reward-keys.json``) to take the key from instead.

    Returns:
        The reward's id: its nonce (one is made when none is given).

    Raises:
        RewardKeyError: the keys hold none for ``producer`` (the message names
            where they came from and the producers they hold).
        ConfigurationError: no Redis URL; an unreadable or malformed key file.
        ValidationError: the reward does not fit the schema (``RewardMessage``)
            or is larger than the attacher reads.
    """
    if key_file is not None:
        keys, source = read_reward_keys(key_file), f"the key file {key_file}"
    elif settings.reward_keys_file:
        keys = reward_keys_of(settings)
        source = f"FLEET_REWARD_KEYS_FILE ({settings.reward_keys_file})"
    else:
        keys, source = reward_keys_of(settings), "FLEET_REWARD_KEYS"
    secret = keys.get(producer)
    if secret is None:
        held = ", ".join(repr(p) for p in sorted(keys)[:20]) or "none"
        raise RewardKeyError(
            f"{source} holds no key for producer {producer!r} (it holds: {held}); the "
            "reward was not sent", producer=producer)
    try:
        message = RewardMessage(execution_id=execution_id, decision_id=decision_id, key=key,
                                score=score, success=success, producer=producer,
                                sent_at=time.time_ns() // 1_000_000,
                                nonce=nonce if nonce is not None else uuid.uuid4().hex)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise ValidationError(f"reward refused: {where}: {first['msg']}",
                              reason="invalid") from exc
    # What the attacher and the kernel will check, checked here: a reward they would
    # refuse is not sent.
    check_outcome_shape(key, score, success, decision_id)
    try:
        signed = sign_reward(message, secret)
    except ValueError as exc:  # a lone surrogate (a non-UTF-8 argument): no canonical form
        raise ValidationError(f"reward refused: it has no canonical form ({exc}); pass text "
                              "that is valid Unicode", reason="malformed") from exc
    verify_reward(signed.to_wire(), {producer: secret})
    if not settings.redis_url:
        raise ConfigurationError("submitting a reward needs FLEET_REDIS_URL")
    client = sync_redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5.0,
                                       socket_timeout=10.0)
    try:
        return submit_reward_sync(client, settings.rewards_inbox, signed, None)
    finally:
        client.close()
