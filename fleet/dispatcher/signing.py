"""Signed ``fleet.dispatch`` messages: who may start, resume, send and cancel over the broker.

Anyone who can publish to the broker (a plain Celery client, Flower's
``/api/task/async-apply``) could otherwise act as any principal. So each
``fleet.dispatch`` message carries an HMAC-SHA256 signature by a client key
of the ring (``fleet.host.keys``, decision 0018), and a worker verifies it
before anything is written.

**The message** is the request's keyword arguments (``fleet.dispatcher.remote``)
plus five fields (six with an environment)::

    env         the fleet it is meant for (FLEET_ENVIRONMENT; decision 0045); optional
    kid         the key id it was signed with
    issued_at   epoch milliseconds when it was signed (integer)
    expires_at  epoch milliseconds after which it is refused (integer)
    nonce       a random string, unique per message (at most 128 characters)
    signature   hex HMAC-SHA256 of the canonical body, keyed by the key's secret

**The canonical body** is the message without ``signature``, serialised as
JSON with keys sorted, no whitespace (``","`` and ``":"``), UTF-8 with
non-ASCII characters unescaped, no NaN or Infinity, numbers as Python's
``json`` writes them: exactly decision 0011's form for rewards. Every field is
covered (operation, execution id, principal, times, nonce and the operation's
arguments), so none can be changed, added or swapped. A signed start names its
execution (``execution_id`` or ``idempotency_key``), so a replay is the same
start. Test vector: ``docs/decisions/0018-dispatch-signing-and-key-rings.md``.

**A worker refuses**, writing nothing, counting (``dispatch_refused``) and
logging the reason, and answering ``{"ok": false, "error": {"code":
"dispatch_refused", "details": [{"reason": ...}]}}`` (never retried):

=================  ============================================================
oversized          the message is larger than ``FLEET_DISPATCH_MAX_BYTES``
malformed          not one JSON object, or a field that cannot be canonical
unsigned           no signature (and ``FLEET_DISPATCH_ALLOW_UNSIGNED`` is off)
unknown_key        no ``kid``, or none in the ring
bad_signature      the HMAC does not match the canonical body
expired            past ``expires_at`` (a replay after expiry lands here)
not_yet_valid      ``issued_at`` in the future (beyond the clock skew)
too_long_lived     ``expires_at - issued_at`` above ``FLEET_DISPATCH_MAX_AGE_S``
wrong_environment  signed for another fleet (``env`` is not this worker's
                   ``FLEET_ENVIRONMENT``), or for none where one is required
invalid            the request's shape (an unknown op, a field missing...)
out_of_scope       the key may not speak for the principal's tenant
replayed           this ``kid`` + ``nonce`` was already used
no_key_ring        the ring's file (``FLEET_DISPATCH_KEYS_FILE``) cannot be read:
                   no message is accepted until it is fixed (fail closed; the
                   only refusal answered ``retryable``: resend once it is)
=================  ============================================================

Checked in that order: nothing about a message is judged beyond its size and
shape before its signature is, and a forged message cannot use up a nonce.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError as PydanticValidationError

from fleet.config import FleetSettings
from fleet.dispatcher.routing import DISPATCH_TASK
from fleet.host.keys import KeyEntry, KeySource
from fleet.kernel.errors import FleetError
from fleet.streams.redis_client import TRANSIENT, aioredis

log = logging.getLogger("fleet.dispatch")

__all__ = ["AUTH_FIELDS", "REFUSALS", "RETRYABLE_REFUSALS", "DispatchRefusedError",
           "DispatchVerifier", "KeyRingUnavailableError",
           "ReplayGuardUnavailableError", "canonical_dispatch_body", "invalid", "refusal",
           "send_dispatch", "sign_dispatch"]

AUTH_FIELDS = ("env", "kid", "issued_at", "expires_at", "nonce", "signature")
REFUSALS = ("oversized", "malformed", "unsigned", "unknown_key", "bad_signature", "expired",
            "not_yet_valid", "too_long_lived", "wrong_environment", "invalid", "out_of_scope",
            "replayed", "no_key_ring")
#: Refusals the same message may pass later (a fixed key file): answered ``retryable``.
RETRYABLE_REFUSALS = frozenset({"no_key_ring"})
_NONCE_MAX = 128


class DispatchRefusedError(FleetError):
    """A ``fleet.dispatch`` message a worker will not act on; ``reason`` says why.

    Not retryable (the same message is refused the same way every time), except
    ``no_key_ring``: the worker's key file could not be read, and may be fixed.
    """

    code = "dispatch_refused"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"fleet.dispatch refused ({reason}): {message}", reason=reason)
        self.reason = reason


class KeyRingUnavailableError(DispatchRefusedError):
    """``no_key_ring``: the worker's key file cannot be read, so nothing is accepted
    (fail closed); retryable: the same message passes once the file is fixed."""

    retryable = True


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def canonical_dispatch_body(message: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: ``message`` without ``signature``, canonical JSON.

    Raises:
        ValueError: a number in it is NaN or infinite (no canonical form).
    """
    body = {k: v for k, v in message.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()


def _mac(secret: bytes, body: bytes) -> str:
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def sign_dispatch(request: Mapping[str, Any], *, key_id: str, secret: str | bytes,
                  ttl_s: float = 60.0, now_ms: int | None = None,
                  nonce: str | None = None, environment: str | None = None) -> dict[str, Any]:
    """``request`` (``{"op": ..., ...}``, as ``fleet.dispatch`` takes it) signed with a key.

    A start that names no execution gets a fresh ``execution_id`` first (a
    signed start must name one, so a replayed message is the same start).
    ``environment`` (``FLEET_ENVIRONMENT``) binds it to one fleet: ``env``.

    Returns:
        The keyword arguments to send (the request plus ``kid``, ``issued_at``,
        ``expires_at``, ``nonce``, ``signature``, and ``env`` when given).
    """
    message = {k: v for k, v in request.items() if k not in AUTH_FIELDS}
    if (message.get("op") == "start" and not message.get("execution_id")
            and not message.get("idempotency_key")):
        message["execution_id"] = uuid.uuid4().hex
    if environment is not None:
        message["env"] = environment
    issued = _now_ms() if now_ms is None else now_ms
    message.update(kid=key_id, issued_at=issued, expires_at=issued + int(ttl_s * 1000),
                   nonce=nonce or uuid.uuid4().hex)
    key = secret.encode() if isinstance(secret, str) else secret
    message["signature"] = _mac(key, canonical_dispatch_body(message))
    return message


def send_dispatch(app: Any, request: Mapping[str, Any], *, key_id: str, secret: str | bytes,
                  ttl_s: float = 60.0, environment: str | None = None) -> str:
    """Sign ``request`` and publish it as a ``fleet.dispatch`` task; the Celery task id.

    ``app`` is the fleet's producer app (``fleet.dispatcher.producer_app``); with
    a result backend, ``app.AsyncResult(task_id).get()`` is the worker's answer.
    ``environment`` defaults to the app's ``FLEET_ENVIRONMENT`` when it has settings.
    """
    if environment is None:
        environment = getattr(getattr(app, "fleet_settings", None), "environment", None)
    signed = sign_dispatch(request, key_id=key_id, secret=secret, ttl_s=ttl_s,
                           environment=environment)
    result = app.send_task(DISPATCH_TASK, kwargs=signed)
    return str(result.id)


def refusal(reason: str, message: str) -> DispatchRefusedError:
    """A refusal for ``reason`` (one of ``REFUSALS``)."""
    if reason in RETRYABLE_REFUSALS:
        return KeyRingUnavailableError(reason, message)
    return DispatchRefusedError(reason, message)


_refuse = refusal


class DispatchVerifier:
    """What a worker checks before a ``fleet.dispatch`` message may write (see above).

    Args:
        keys: The ring's source (``KeySource``); None refuses every signed message.
        allow_unsigned: Let unsigned messages through (``FLEET_DISPATCH_ALLOW_UNSIGNED``).
        max_age_s, skew_s, max_bytes: The bounds of the table above.
        redis_url: Where used nonces are kept until their message expires (shared
            by every worker); None keeps them in this process only.
        environment: This fleet's name (``FLEET_ENVIRONMENT``): a message signed for
            another is refused, and one that names none unless ``allow_unbound``.
    """

    def __init__(self, keys: KeySource | None, *, allow_unsigned: bool = False,
                 max_age_s: float = 300.0, skew_s: float = 30.0,
                 max_bytes: int = 1_048_576, redis_url: str | None = None,
                 timeout_s: float = 10.0, environment: str | None = None,
                 allow_unbound: bool = False) -> None:
        self.keys = keys
        self.allow_unsigned = allow_unsigned
        self.environment = environment
        self.allow_unbound = allow_unbound
        self.max_age_ms = int(max_age_s * 1000)
        self.skew_ms = int(skew_s * 1000)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._redis_url = redis_url
        self._redis: Any = None
        self._redis_loop: asyncio.AbstractEventLoop | None = None
        self._seen: dict[str, int] = {}  # without Redis: nonce key -> expiry (ms)
        self.refused: Counter[str] = Counter()
        self.accepted = 0

    @classmethod
    def from_settings(cls, settings: FleetSettings) -> DispatchVerifier:
        keys = KeySource.of(settings.dispatch_keys, settings.dispatch_keys_file,
                            setting="FLEET_DISPATCH_KEYS")
        redis_url = settings.redis_url
        if redis_url is None and settings.broker.split("://", 1)[0] in ("redis", "rediss"):
            redis_url = settings.broker
        ring = keys.ring() if keys is not None else None
        bare = [e.key_id for e in map(ring.get, ring.ids()) if e and e.bare] if ring else []
        if bare:
            log.warning("the dispatch key ring holds bare secrets (the reward key-file format), "
                        "which list no tenants: messages signed with %s are refused; write "
                        '{"client": ..., "secret": ..., "tenants": [...]}', bare[:10])
        if keys is not None and settings.environment is None:
            log.warning("FLEET_ENVIRONMENT is unset: a dispatch another fleet signed with a "
                        "key this ring shares verifies here (decision 0045)")
        return cls(keys, allow_unsigned=settings.dispatch_allow_unsigned,
                   max_age_s=settings.dispatch_max_age_s, skew_s=settings.dispatch_clock_skew_s,
                   max_bytes=settings.dispatch_max_bytes, redis_url=redis_url,
                   timeout_s=settings.broker_socket_timeout_s,
                   environment=settings.environment,
                   allow_unbound=settings.dispatch_allow_unbound)

    # -- the checks that need no loop ----------------------------------------------
    def message_of(self, args: Any, kwargs: Any) -> dict[str, Any]:
        """The one JSON object a message carries (keyword arguments, or the only
        positional argument), within the size bound."""
        try:
            size = len(json.dumps([args, kwargs], ensure_ascii=False).encode("utf-8",
                                                                             "surrogatepass"))
        except RecursionError as exc:  # a nesting no request has (issue 10 item 9's sibling)
            raise _refuse("malformed", "nested too deeply to be a request") from exc
        except (TypeError, ValueError) as exc:
            raise _refuse("malformed", f"not JSON: {str(exc)[:200]}") from exc
        if size > self.max_bytes:
            raise _refuse("oversized", f"{size} bytes; the limit is {self.max_bytes} "
                          "(FLEET_DISPATCH_MAX_BYTES)")
        if args:
            if len(args) != 1 or kwargs or not isinstance(args[0], dict):
                raise _refuse("malformed", "fleet.dispatch takes keyword arguments, or one "
                              "JSON object as its only positional argument")
            return dict(args[0])
        if not isinstance(kwargs, dict):
            raise _refuse("malformed", "the keyword arguments are not an object")
        return dict(kwargs)

    def authenticate(self, message: Mapping[str, Any], now_ms: int | None = None,
                     ) -> KeyEntry | None:
        """The key that signed ``message`` (None: unsigned, and unsigned is allowed)."""
        ring = self.keys.ring() if self.keys is not None else None
        if self.keys is not None and ring is None:
            # Fail closed (issue 25 item 4): a key file that cannot be read accepts
            # nothing, unsigned messages included, rather than its last good keys.
            raise _refuse("no_key_ring", self.keys.problem or "the key ring cannot be read")
        signature = message.get("signature")
        if signature is None and self.allow_unsigned and not any(
                f in message for f in AUTH_FIELDS):
            return None
        if not isinstance(signature, str) or not signature:
            raise _refuse("unsigned", "no signature: sign it with a client key "
                          "(fleet.dispatcher.signing.sign_dispatch)")
        kid = message.get("kid")
        entry = ring.get(kid) if ring is not None and isinstance(kid, str) else None
        if entry is None:
            raise _refuse("unknown_key", f"no key {str(kid)[:80]!r} in the ring")
        if entry.bare:  # a reward key's format: it would speak for everyone (keys.py)
            raise _refuse("unknown_key", f"key {kid!r} is a bare secret in the ring (the "
                          "reward key-file format), which lists no tenants; a dispatch key "
                          'is {"client": ..., "secret": ..., "tenants": [...]}')
        try:
            body = canonical_dispatch_body(message)
        except (TypeError, ValueError, RecursionError) as exc:
            # NaN, a lone surrogate (UnicodeEncodeError), a nesting too deep: no sender
            # could have signed it.
            raise _refuse("malformed", f"no canonical form: {type(exc).__name__}: "
                          f"{str(exc)[:200]}") from exc
        expected = _mac(entry.secret, body).encode()
        given = signature.encode("utf-8", "surrogatepass")  # any text: compared as bytes
        if not hmac.compare_digest(expected, given):
            raise _refuse("bad_signature", f"the signature does not match key {kid!r} over "
                          "the canonical body")
        issued, expires = message.get("issued_at"), message.get("expires_at")
        if (not isinstance(issued, int) or isinstance(issued, bool)
                or not isinstance(expires, int) or isinstance(expires, bool)):
            raise _refuse("malformed", "issued_at and expires_at must be integers (epoch ms)")
        now = _now_ms() if now_ms is None else now_ms
        if now > expires + self.skew_ms:
            raise _refuse("expired", f"it expired {(now - expires) / 1000:.0f} s ago")
        if issued > now + self.skew_ms:
            raise _refuse("not_yet_valid", f"issued {(issued - now) / 1000:.0f} s in the "
                          "future (clocks apart?)")
        if expires - issued > self.max_age_ms:
            raise _refuse("too_long_lived", f"valid for {(expires - issued) / 1000:.0f} s; "
                          f"the limit is {self.max_age_ms / 1000:g} s")
        self._check_environment(message.get("env", None), "env" in message)
        nonce = message.get("nonce")
        if not isinstance(nonce, str) or not 0 < len(nonce) <= _NONCE_MAX:
            raise _refuse("malformed", f"nonce must be 1-{_NONCE_MAX} characters")
        return entry

    def _check_environment(self, env: Any, named: bool) -> None:
        """The message is for this fleet (decision 0045): its ``env`` is this worker's
        ``FLEET_ENVIRONMENT``; one naming none only while ``allow_unbound`` (or no
        environment is set here, where nothing is bound)."""
        if named and (not isinstance(env, str) or not env):
            raise _refuse("malformed", "env must be a non-empty string (FLEET_ENVIRONMENT)")
        if not named:
            if self.environment is None or self.allow_unbound:
                return
            raise _refuse("wrong_environment", f"it names no environment; this fleet is "
                          f"{self.environment[:80]!r}: sign it with FLEET_ENVIRONMENT set")
        if env != self.environment:
            mine = (repr(self.environment[:80]) if self.environment is not None
                    else "none (FLEET_ENVIRONMENT is unset)")
            raise _refuse("wrong_environment", f"signed for environment {env[:80]!r}; this "
                          f"fleet is {mine}")

    @staticmethod
    def check_scope(entry: KeyEntry | None, tenant: str | None, has_principal: bool) -> None:
        """The key may act for this principal's tenant (``"*"``: any, and none)."""
        if entry is None:
            return
        if not entry.speaks_for(tenant if has_principal else None):
            who = (f"tenant {tenant[:80]!r}" if has_principal and tenant
                   else "a principal with no tenant")
            raise _refuse("out_of_scope", f"key {entry.key_id!r} (client {entry.client!r}) "
                          f"may not act for {who}")

    # -- the check that needs the loop (Redis) ---------------------------------------
    async def claim_nonce(self, entry: KeyEntry | None, message: Mapping[str, Any]) -> None:
        """Use up the message's nonce until it expires; ``replayed`` if already used."""
        if entry is None:
            return
        expires = int(message["expires_at"]) + self.skew_ms
        key = f"fleet:dispatch:nonce:{entry.key_id}:{message['nonce']}"
        if self._redis_url is None:
            now = _now_ms()
            if len(self._seen) > 100_000:
                self._seen = {k: v for k, v in self._seen.items() if v > now}
            if self._seen.get(key, 0) > now:
                raise _refuse("replayed", "this kid and nonce were already used")
            self._seen[key] = expires
            return
        client = self._client()
        try:
            fresh = await asyncio.wait_for(
                client.set(key, b"1", nx=True, pxat=max(expires, _now_ms() + 1000)),
                self.timeout_s)
        except (TimeoutError, *TRANSIENT) as exc:
            raise ReplayGuardUnavailableError(
                f"cannot check the nonce (Redis: {type(exc).__name__}: {exc}); retry") from exc
        if not fresh:
            raise _refuse("replayed", "this kid and nonce were already used")

    def _client(self) -> Any:
        assert self._redis_url is not None
        loop = asyncio.get_running_loop()
        if self._redis is None or self._redis_loop is not loop:
            self._redis = aioredis.Redis.from_url(self._redis_url, socket_connect_timeout=2.0,
                                                  socket_timeout=self.timeout_s)
            self._redis_loop = loop
        return self._redis

    def refuse(self, exc: DispatchRefusedError, message: Mapping[str, Any] | None) -> None:
        """Count and log a refusal (with what can be said about the message, cut short)."""
        self.refused[exc.reason] += 1
        info = message or {}
        log.warning("%s [kid=%.60r op=%.20r execution=%.80r]", exc.message, info.get("kid"),
                    info.get("op"), info.get("execution_id"))

    def stats(self) -> dict[str, int]:
        return {"dispatch_refused": sum(self.refused.values()),
                "dispatch_accepted": self.accepted}

    def problem(self) -> str | None:
        """Why no message is accepted now (an unreadable key file), or None."""
        return self.keys.check() if self.keys is not None else None

    def request_fields(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """The request's own fields (what ``DispatchRequest`` validates)."""
        return {k: v for k, v in message.items() if k not in AUTH_FIELDS}


class ReplayGuardUnavailableError(FleetError):
    """The nonce store (Redis) did not answer: nothing was written; retry."""

    code = "replay_guard_unavailable"
    retryable = True


def invalid(exc: PydanticValidationError | ValueError) -> DispatchRefusedError:
    """A request whose shape is wrong, as a refusal."""
    if isinstance(exc, PydanticValidationError):
        reasons = "; ".join(f"{'.'.join(map(str, e.get('loc', ()))) or 'request'}: "
                            f"{e.get('msg', '')}" for e in exc.errors()[:5])
        return _refuse("invalid", reasons)
    return _refuse("invalid", str(exc))

