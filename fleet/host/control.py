"""Remote control of the workers: only an operator's signed command changes one.

Celery's remote control (kombu's *pidbox*) is a fanout exchange. On Redis, kombu
publishes each command as one message on the channel ``/<db>.celery.pidbox``
(``PUBLISH``), every worker listens there (``PSUBSCRIBE``), and a worker that
is asked for an answer pushes it (``LPUSH``) onto the caller's reply queue
``<oid>.reply.celery.pidbox``, found through the routing table
``_kombu.binding.reply.celery.pidbox``. Whoever may publish on that channel can
tell every worker to stop consuming (``cancel_consumer``), to shut down, to
restart its pool, to revoke tasks: the fleet stops while its probes pass.

Two locks, each enough on its own against a different attacker (decision 0042):

1. **The broker's ACL** (``deploy/redis/users.acl``): on Redis only the operator
   console's user (``flower``) and ``admin`` may ``PUBLISH`` on the control channel.
   Workers only listen (``PSUBSCRIBE``; mingle, which broadcasts, is off), and the
   dispatchers' ``client`` user has no part in remote control at all.
2. **The worker itself** (``FleetNode``, in every app ``broker_app`` builds): a
   command that changes a worker (``shutdown``, ``cancel_consumer``,
   ``add_consumer``, ``pool_restart``, ``revoke``, ``enable_events``...: every
   command not in ``READ_ONLY``) is obeyed only when signed by an operator key of
   ``FLEET_CONTROL_KEYS``; anything else is refused, logged, counted
   (``control_refused``) and answered ``{"error": "refused by fleet: ..."}``. So a
   broker credential alone (a leaked password, a RabbitMQ user, the admin's) does
   not command the fleet either. A worker with no control key, or whose key file
   cannot be read, obeys no such command (fail closed). Commands that only read
   (``ping``, ``stats``, ``active_queues``...) are answered unsigned: Flower's
   pages, ``fleet up`` and the tests' readiness checks use them.

**The signature.** ``FleetMailbox`` (every fleet app's ``app.control.mailbox``)
adds ``fleet_auth = {"kid", "issued_at", "expires_at", "nonce", "signature"}``
to the message body it publishes, when its app was given a ``ControlAuth``
with a key (Flower's, ``fleet up``'s). ``signature`` is the hex HMAC-SHA256 of
the canonical JSON (keys sorted, ``,`` and ``:``, UTF-8) of the whole body as
the worker receives it (``method``, ``arguments``, ``destination``, ``pattern``,
``matcher``, ``ticket``, ``reply_to``, ``fleet_auth`` without ``signature``),
keyed by the key's secret. It is valid for ``CONTROL_TTL_S``; a worker refuses
one older than ``max_age_s`` or issued in the future beyond the clock skew. The
key must be an operator's: tenants ``["*"]`` (the ring's shorthand
``{"ops-1": "secret"}`` is). There is no nonce store: a replay needs both a copy
of a signed command (only a worker sees one) and the right to publish (which a
worker does not have), and repeats what the operator already did.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kombu import common as _common
from kombu import matcher as _matcher
from kombu import pidbox as _pidbox
from kombu.utils import json as _kombu_json

from fleet.host.celery_api import Control
from fleet.host.keys import ANY_TENANT, KeyEntry, KeySource

if TYPE_CHECKING:
    from fleet.config import FleetSettings

log = logging.getLogger("fleet.control")

#: Commands that only read a worker: answered without a signature.
READ_ONLY: frozenset[str] = frozenset({
    "ping", "stats", "active_queues", "active", "reserved", "scheduled", "revoked",
    "registered", "query_task", "clock", "report", "conf"})
#: How long a signed command is valid (the signer's choice).
CONTROL_TTL_S = 30.0
AUTH_FIELD = "fleet_auth"

# kombu's parts, untyped: used as Any (the rest of fleet stays mypy --strict).
_Mailbox: Any = _pidbox.Mailbox
_Node: Any = _pidbox.Node
_match: Any = _matcher.match
_maybe_declare: Any = _common.maybe_declare
_kombu_dumps: Any = _kombu_json.dumps


def canonical_control_body(body: Mapping[str, Any]) -> bytes:
    """What a control command's signature covers: the body with ``fleet_auth``'s
    ``signature`` left out, as canonical JSON."""
    unsigned = dict(body)
    auth = unsigned.get(AUTH_FIELD)
    if isinstance(auth, Mapping):
        unsigned[AUTH_FIELD] = {k: v for k, v in auth.items() if k != "signature"}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8", "surrogatepass")


def _mac(secret: bytes, body: bytes) -> str:
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def addressed_to(hostname: str, body: Mapping[str, Any]) -> bool:
    """Whether ``body`` is meant for the node ``hostname`` (kombu's own rule)."""
    destination, pattern, matcher = (body.get("destination"), body.get("pattern"),
                                     body.get("matcher"))
    if destination:
        return hostname in destination
    if pattern and matcher:
        return bool(_match(hostname, pattern, matcher))
    return True


class ControlAuth:
    """Signs a process's control commands, and judges the commands a worker receives.

    Args:
        keys: The operators' key ring (``FLEET_CONTROL_KEYS`` or its ``_FILE``); None:
            no key (nothing is signed; a worker obeys nothing that changes it).
        key_id: The key this process signs with (default: the ring's only key).
        max_age_s: The longest a signed command may be valid (``expires_at -
            issued_at``), and how old a worker still takes one.
        skew_s: Clock difference tolerated between signer and worker.
        signs: Whether this process signs what it broadcasts (Flower, ``fleet up``: yes;
            a worker only verifies).
    """

    def __init__(self, keys: KeySource | None, *, key_id: str | None = None,
                 max_age_s: float = 60.0, skew_s: float = 30.0, signs: bool = True) -> None:
        self.keys = keys
        self.key_id = key_id
        self.signs = signs
        self.max_age_ms = int(max_age_s * 1000)
        self.skew_ms = int(skew_s * 1000)
        self.refused: Counter[str] = Counter()
        self.obeyed = 0
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: FleetSettings, *, signs: bool = True) -> ControlAuth:
        """The operators' keys of ``FLEET_CONTROL_KEYS`` (or its ``_FILE``)."""
        return cls(KeySource.of(settings.control_keys, settings.control_keys_file,
                                setting="FLEET_CONTROL_KEYS"),
                   key_id=settings.control_key_id, skew_s=settings.dispatch_clock_skew_s,
                   signs=signs)

    # -- signing ---------------------------------------------------------------------
    def signing_key(self) -> KeyEntry | None:
        """The key this process signs with, or None (no ring, no such key)."""
        ring = self.keys.ring() if self.keys is not None and self.signs else None
        if ring is None:
            return None
        if self.key_id is not None:
            return ring.get(self.key_id)
        ids = ring.ids()
        return ring.get(ids[0]) if len(ids) == 1 else None

    def sign(self, message: Mapping[str, Any], *, now_ms: int | None = None
             ) -> dict[str, Any]:
        """``message`` (a pidbox body) with ``fleet_auth``; unchanged without a key."""
        entry = self.signing_key()
        # What the worker will decode: kombu's JSON, read back (tuples become lists).
        wire: dict[str, Any] = json.loads(_kombu_dumps(dict(message)))
        if entry is None:
            return wire
        issued = time.time_ns() // 1_000_000 if now_ms is None else now_ms
        wire[AUTH_FIELD] = {"kid": entry.key_id, "issued_at": issued,
                            "expires_at": issued + int(CONTROL_TTL_S * 1000),
                            "nonce": uuid.uuid4().hex}
        wire[AUTH_FIELD]["signature"] = _mac(entry.secret, canonical_control_body(wire))
        return wire

    # -- judging -----------------------------------------------------------------------
    def problem(self) -> str | None:
        """Why no command that changes a worker is obeyed now, or None."""
        if self.keys is None:
            return ("no operator key (FLEET_CONTROL_KEYS): no control command that changes "
                    "this worker is obeyed")
        return self.keys.check()

    def judge(self, body: Mapping[str, Any], *, now_ms: int | None = None) -> str | None:
        """Why ``body`` may not change this worker (None: it may)."""
        problem = self.problem()
        if problem is not None:
            return problem
        ring = self.keys.ring() if self.keys is not None else None
        if ring is None:
            return "the operators' key ring cannot be read"
        auth = body.get(AUTH_FIELD)
        if not isinstance(auth, Mapping) or not isinstance(auth.get("signature"), str):
            return "unsigned: a command that changes a worker needs an operator's signature"
        kid = auth.get("kid")
        entry = ring.get(kid) if isinstance(kid, str) else None
        if entry is None:
            return f"unknown key {str(kid)[:80]!r}"
        if ANY_TENANT not in entry.tenants:
            return f"key {entry.key_id!r} is a tenant's, not an operator's (tenants [\"*\"])"
        try:
            expected = _mac(entry.secret, canonical_control_body(body)).encode()
        except (TypeError, ValueError, RecursionError):
            return "malformed: no canonical form"
        given = str(auth["signature"]).encode("utf-8", "surrogatepass")
        if not hmac.compare_digest(expected, given):
            return f"bad signature for key {entry.key_id!r}"
        issued, expires = auth.get("issued_at"), auth.get("expires_at")
        if (not isinstance(issued, int) or isinstance(issued, bool)
                or not isinstance(expires, int) or isinstance(expires, bool)):
            return "malformed: issued_at and expires_at must be integers (epoch ms)"
        now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
        if now > expires + self.skew_ms:
            return f"expired {(now - expires) / 1000:.0f} s ago"
        if issued > now + self.skew_ms:
            return f"issued {(issued - now) / 1000:.0f} s in the future (clocks apart?)"
        if expires - issued > self.max_age_ms:
            return (f"valid for {(expires - issued) / 1000:.0f} s; the limit is "
                    f"{self.max_age_ms / 1000:g} s")
        return None

    def count(self, refused: str | None) -> None:
        with self._lock:
            if refused is None:
                self.obeyed += 1
            else:
                self.refused[refused.split(":", 1)[0][:40]] += 1

    def stats(self) -> dict[str, int]:
        return {"control_refused": sum(self.refused.values()), "control_obeyed": self.obeyed}


class FleetNode(_Node):  # type: ignore[misc]  # kombu's Node is untyped
    """A worker's mailbox node: obeys a command that changes it only when signed."""

    def handle_message(self, body: Any, message: Any = None) -> Any:
        if not isinstance(body, Mapping):
            log.warning("control message refused: not an object (%s)", type(body).__name__)
            return None
        method = body.get("method")
        if method in READ_ONLY or not addressed_to(self.hostname, body):
            return super().handle_message(body, message)
        auth: ControlAuth | None = getattr(self.mailbox, "auth", None)
        reason = (auth.judge(body) if auth is not None
                  else "this worker has no operator keys (FLEET_CONTROL_KEYS)")
        if auth is not None:
            auth.count(reason)
        if reason is None:
            return super().handle_message(body, message)
        log.warning("control command %.40r refused: %s (fleet_auth.kid=%.60r)", method,
                    reason, (body.get(AUTH_FIELD) or {}).get("kid")
                    if isinstance(body.get(AUTH_FIELD), Mapping) else None)
        reply_to = body.get("reply_to")
        if isinstance(reply_to, Mapping) and reply_to.get("exchange") is not None:
            self.reply({self.hostname: {"error": f"refused by fleet: {reason}"}},
                       exchange=reply_to["exchange"], routing_key=reply_to.get("routing_key"),
                       ticket=body.get("ticket"))
        return None

    dispatch_from_message = handle_message


class FleetMailbox(_Mailbox):  # type: ignore[misc]  # kombu's Mailbox is untyped
    """kombu's mailbox whose commands carry the operator's signature (``auth``)."""

    node_cls = FleetNode
    auth: ControlAuth | None = None

    # kombu 5.x's Mailbox._publish, with the body signed before it is published (a
    # test pins its signature: a kombu that changes it fails there, not in production).
    def _publish(self, type: str, arguments: Any, destination: Any = None,
                 reply_ticket: Any = None, channel: Any = None, timeout: Any = None,
                 serializer: Any = None, producer: Any = None, pattern: Any = None,
                 matcher: Any = None) -> None:
        message: dict[str, Any] = {"method": type, "arguments": arguments,
                                   "destination": destination, "pattern": pattern,
                                   "matcher": matcher}
        chan = channel or self.connection.default_channel
        exchange = self.exchange
        if reply_ticket:
            _maybe_declare(self.reply_queue(chan))
            message.update(ticket=reply_ticket,
                           reply_to={"exchange": self.reply_exchange.name,
                                     "routing_key": self.oid})
        if self.auth is not None:
            message = self.auth.sign(message)
        serializer = serializer or self.serializer
        with self.producer_or_acquire(producer, chan) as chosen:
            chosen.publish(message, exchange=exchange.name, declare=[exchange],
                           headers={"clock": self.clock.forward(),
                                    "expires": time.time() + timeout if timeout else 0},
                           serializer=serializer, retry=True)


class FleetControl(Control):  # type: ignore[misc]  # Celery's Control is untyped
    """``app.control`` of every fleet app: ``FleetMailbox``, signed with the app's
    ``fleet_control_auth`` (``broker_app(control_auth=...)``)."""

    Mailbox = FleetMailbox

    def __init__(self, app: Any = None) -> None:
        super().__init__(app)
        self.mailbox.auth = getattr(app, "fleet_control_auth", None)


__all__ = ["AUTH_FIELD", "CONTROL_TTL_S", "READ_ONLY", "ControlAuth", "FleetControl",
           "FleetMailbox", "FleetNode", "addressed_to", "canonical_control_body"]
