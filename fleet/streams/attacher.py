"""``RewardAttacher``: the consumer group that turns reward messages into late outcomes.

Producers push onto the inbox ``fleet:rewards:inbox``; the attacher moves each
message onto ``fleet:rewards`` (``fleet.streams.inbox``: an id Redis picks, a
bounded size) and trims the stream below what its groups acknowledged. For
each entry of ``fleet:rewards``: verify it (``verify_reward``: parse, HMAC
with the producer's key, schema), then ``runtime.record_outcome`` as the
producer's principal, ``Principal(f"producer:{name}", tenant=...)``, so the
log says who sent every late reward (``recordedBy``). What happens next:

==============================  =====================================================
appended                        acknowledged, counted in ``attached``
duplicate (``appended=False``)  acknowledged, counted in ``duplicates``
oversized, malformed,           dead-lettered to ``fleet:rewards:dead`` with the
unsigned, unknown producer,     reason and the original entry at once, on the first
bad signature, invalid          delivery; never attached
out of the producer's scope     dead-lettered ``out_of_scope`` at once (the kernel
(``AccessDeniedError``)         refused ``annotate``; nothing written), warned
retryable error                 retried here with doubling backoff (``retries``
(``.retryable``: contended      times), then left pending and claimed again after
tip, busy, store down)          ``claim_idle_ms``, up to ``retry_deliveries``
                                deliveries; then dead-lettered with the error's code
execution not terminal          left pending and claimed again after
                                ``claim_idle_ms``, up to ``max_deliveries`` (the run
                                may finish meanwhile); then dead-lettered
any other refusal               dead-lettered at once with the error's code
(``OutcomeRefusedError``,       (``outcome_refused``, ``execution_not_found``,
not found, shape)               ``validation``, ``unstorable_value``)
==============================  =====================================================

Why a producer may annotate at all: ``docs/decisions/0011-reward-producers.md``;
which executions it may annotate (``FLEET_REWARD_TENANTS``):
``docs/decisions/0025-reward-tenant-scoping.md``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from fleet.host.keys import reward_keys_of
from fleet.kernel.errors import (
    AccessDeniedError,
    ConfigurationError,
    ExecutionNotFoundError,
    ExecutionNotTerminalError,
    FleetError,
)
from fleet.kernel.journal import WarnSink
from fleet.kernel.observers import Warner
from fleet.kernel.security import Principal
from fleet.streams.consumer import (
    DEAD_MAXLEN,
    Defer,
    Reject,
    StreamConsumer,
    StreamEntry,
    default_consumer_name,
)
from fleet.streams.inbox import RewardInbox
from fleet.streams.redis_client import aioredis, as_text
from fleet.streams.rewards import MAX_MESSAGE_BYTES, MESSAGE_FIELD, verify_reward

if TYPE_CHECKING:
    from fleet.config import FleetSettings
    from fleet.kernel.runtime import Runtime

__all__ = ["RewardAttacher"]


class RewardAttacher:
    """A ``Service``: a ``StreamConsumer`` on the rewards stream that attaches outcomes.

    The runtime's ``AccessPolicy`` must let a producer ``annotate``: a producer
    is never an execution's owner, so the default ``owner`` rule is refused at
    construction. Two ways (decision 0025):

    * **unscoped** (no ``producer_tenants``): the runtime's rule is ``"any"``,
      and every producer holding a key may annotate every finished execution;
    * **scoped** (``producer_tenants`` given, ``FLEET_REWARD_TENANTS``): the
      runtime's rule must be ``"tenant"``; a listed producer acts as
      ``Principal(f"producer:{name}", scope=its tenants)`` and may annotate only
      those tenants' executions (``"*"``: all, and those with no tenant); an
      unlisted one acts with no tenant and may annotate only executions with no
      tenant. The kernel judges it; a refusal is dead-lettered ``out_of_scope``
      at once and nothing is written.

    The policy is the attacher's runtime's, not the users': it grants nothing
    to anyone else.

    Args:
        runtime: The runtime outcomes are recorded through.
        redis: An asyncio Redis client.
        keys: ``{producer: HMAC key}`` (``FLEET_REWARD_KEYS`` or ``_FILE``).
        stream / group / dead_stream: ``rewards_stream``, ``rewards_group``,
            ``rewards_dead``.
        consumer: This member's name (default ``host:pid``).
        producer_tenants: ``{producer: [tenant, ...]}`` (a single tenant may be
            given as a string): turns scoping on (``FLEET_REWARD_TENANTS``).
            Every producer named must have a key.
        inbox: The producers' inbox (``rewards_inbox``, a list): what arrives there is
            moved onto ``stream`` (``fleet.streams.inbox``), and the stream is trimmed
            once every group acknowledged an entry. None: producers write the stream
            themselves (a stream of your own), nothing is trimmed.
        dead_maxlen: About how many dead letters ``dead_stream`` keeps.
        max_message_bytes: A larger ``message`` is dead-lettered ``oversized``.
        retries: In-place retries of a retryable error before the entry is
            left pending; ``backoff_s`` before the first, doubling.
        retry_deliveries: Deliveries a retryable error may take in all.
        max_deliveries: Deliveries a reward for a still-running execution may
            wait (each ``claim_idle_ms`` apart), and the bound for everything else.
        consumer_options: Passed to ``StreamConsumer`` (``block_ms``, ``count``,
            ``claim_every_s``, ``on_warn``...).

    ``stats()``: ``attached``, ``duplicates``, ``dead_lettered`` (by reason,
    ``out_of_scope`` among them), ``retried`` (in-place retries), ``deferred``
    (left pending to try later), ``scoped`` (whether producers are scoped to
    tenants), and the consumer's own counters under ``consumer``.
    """

    requires: tuple[str, ...] = ()

    def __init__(self, runtime: Runtime, redis: aioredis.Redis, *, keys: Mapping[str, str],
                 stream: str = "fleet:rewards", group: str = "fleet-attachers",
                 dead_stream: str = "fleet:rewards:dead", consumer: str | None = None,
                 producer_tenants: Mapping[str, str | Iterable[str] | None] | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, retries: int = 4,
                 backoff_s: float = 0.05, retry_deliveries: int = 5,
                 max_deliveries: int = 30, claim_idle_ms: int = 30_000,
                 on_warn: WarnSink | None = None, name: str = "reward-attacher",
                 close_client: bool = False, inbox: str | None = None,
                 dead_maxlen: int = DEAD_MAXLEN, **consumer_options: Any) -> None:
        rule = runtime.access_policy.rule_for("annotate")
        if rule == "owner":
            raise ConfigurationError(
                "RewardAttacher: the runtime's AccessPolicy lets only an execution's owner "
                "annotate it, and a reward producer is never the owner; give the attacher's "
                "runtime AccessPolicy(rules={'annotate': 'any'}), or 'tenant' with "
                "producer_tenants (docs/decisions/0011-reward-producers.md, "
                "0025-reward-tenant-scoping.md)")
        if not keys:
            raise ConfigurationError("RewardAttacher: no producer keys (FLEET_REWARD_KEYS): "
                                     "every message would be dead-lettered")
        scopes = _scopes(producer_tenants, keys)
        if scopes and rule != "tenant":
            raise ConfigurationError(
                f"RewardAttacher: producers are scoped to tenants (FLEET_REWARD_TENANTS), but "
                f"the runtime's AccessPolicy rule for annotate is {rule!r}, which would ignore "
                "the scope; give the attacher's runtime AccessPolicy(rules={'annotate': "
                "'tenant'}) (docs/decisions/0025-reward-tenant-scoping.md)")
        if max_message_bytes < 1024:
            raise ConfigurationError("RewardAttacher: max_message_bytes must be >= 1024")
        if retries < 0 or backoff_s < 0 or retry_deliveries < 1:
            raise ConfigurationError("RewardAttacher: retries and backoff_s must be >= 0, "
                                     "retry_deliveries >= 1")
        self.name = name
        self.runtime = runtime
        self.keys = dict(keys)
        # Scoped: judged by tenant (a producer without a listed scope acts with no tenant).
        self.scoped = bool(scopes) or rule == "tenant"
        self.principals = {producer: Principal(f"producer:{producer}", scope=scopes.get(producer))
                           for producer in self.keys}
        self.max_message_bytes = max_message_bytes
        self.warner = Warner(on_warn)
        self.retries = retries
        self.backoff_s = backoff_s
        self.retry_deliveries = retry_deliveries
        self._close_client = close_client
        member = consumer or default_consumer_name()
        self.inbox = None if inbox is None else RewardInbox(
            redis, inbox=inbox, stream=stream, dead_stream=dead_stream,
            max_bytes=max_message_bytes, dead_maxlen=dead_maxlen,
            count=int(consumer_options.get("count", 100)), consumer=member)
        self.consumer = StreamConsumer(
            redis, stream, group, member, self._on_entry,
            dead_stream=dead_stream, claim_idle_ms=claim_idle_ms,
            max_deliveries=max_deliveries, on_warn=on_warn, name=f"{name}:consumer",
            dead_maxlen=dead_maxlen,
            feed=self.inbox.move if self.inbox is not None else None,
            trim_acked=self.inbox is not None, **consumer_options)
        self.attached = 0
        self.duplicates = 0
        self.retried = 0
        self.deferred = 0

    @classmethod
    def from_settings(cls, settings: FleetSettings, runtime: Runtime,
                      **kwargs: Any) -> RewardAttacher:
        """An attacher on ``settings.redis_url`` with its streams, group and keys."""
        if not settings.redis_url:
            raise ConfigurationError("the reward attacher needs FLEET_REDIS_URL")
        # Every read is bounded (a Redis that accepts and never answers must not
        # wedge the attacher): its longest block plus the command deadline.
        block_s = int(kwargs.get("block_ms", 1000)) / 1000
        client = aioredis.Redis.from_url(
            settings.redis_url, socket_connect_timeout=settings.broker_connect_timeout_s,
            socket_timeout=block_s + settings.broker_socket_timeout_s)
        kwargs.setdefault("keys", reward_keys_of(settings))
        kwargs.setdefault("producer_tenants", settings.reward_tenants)
        kwargs.setdefault("stream", settings.rewards_stream)
        kwargs.setdefault("group", settings.rewards_group)
        kwargs.setdefault("dead_stream", settings.rewards_dead)
        kwargs.setdefault("inbox", settings.rewards_inbox)
        kwargs.setdefault("dead_maxlen", settings.dead_letters_maxlen)
        return cls(runtime, client, close_client=True, **kwargs)

    async def start(self) -> None:
        await self.consumer.start()

    async def stop(self) -> None:
        await self.consumer.stop()
        if self._close_client:
            await self.consumer.redis.aclose()

    def stats(self) -> dict[str, Any]:
        consumer = self.consumer.stats()
        dead = dict(consumer["dead_lettered"])
        out: dict[str, Any] = {"attached": self.attached, "duplicates": self.duplicates,
                               "dead_lettered": dead, "retried": self.retried,
                               "deferred": self.deferred, "scoped": self.scoped,
                               "consumer": consumer}
        if self.inbox is not None:
            inbox = self.inbox.stats()
            if inbox["oversized"]:  # dead-lettered by the move, before the consumer
                dead["oversized"] = dead.get("oversized", 0) + inbox["oversized"]
            out.update(moved=inbox["moved"], inbox=inbox["inbox"],
                       trimmed=consumer["trimmed"])
        return out

    async def _on_entry(self, entry: StreamEntry) -> Defer | Reject | None:
        try:
            # The bytes Redis holds, not their lossy text: non-UTF-8 is malformed.
            message = verify_reward(_raw_field(entry, MESSAGE_FIELD), self.keys,
                                    max_bytes=self.max_message_bytes)
        except FleetError as exc:
            return Reject(str(exc.details.get("reason", exc.code)), exc.message)
        principal = self.principals[message.producer]
        attempt = 0
        while True:
            try:
                result = await self.runtime.record_outcome(
                    message.execution_id, decision_id=message.decision_id, key=message.key,
                    score=message.score, success=message.success, principal=principal)
            except ExecutionNotTerminalError as exc:
                self.deferred += 1
                return Defer(exc.code, exc.message)
            except (AccessDeniedError, ExecutionNotFoundError) as exc:
                # The kernel refused annotate: the producer's scope leaves this
                # execution's tenant out (told as "no execution" to one who may not read
                # it either: the denial is its cause). Final: refused every time.
                denied = exc if isinstance(exc, AccessDeniedError) else exc.__cause__
                if not isinstance(denied, AccessDeniedError):
                    return Reject(exc.code, exc.message)
                detail = (f"producer {message.producer!r} may not reward execution "
                          f"{message.execution_id[:200]!r}: {denied.message}")
                self.warner.warn(f"reward refused (out_of_scope): {detail}",
                                 key=f"out_of_scope:{message.producer}")
                return Reject("out_of_scope", detail)
            except FleetError as exc:
                if not exc.retryable:
                    return Reject(exc.code, exc.message)
                if attempt < self.retries:
                    attempt += 1
                    self.retried += 1
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                    continue
                self.deferred += 1
                return Defer(exc.code, f"{exc.message} (still failing after {attempt + 1} "
                             "tries)", max_deliveries=self.retry_deliveries)
            if result.appended:
                self.attached += 1
            else:
                self.duplicates += 1
            return None


def _raw_field(entry: StreamEntry, name: str) -> bytes | str | None:
    """The field ``name`` as Redis returned it (bytes from a default client)."""
    for key, value in entry.raw.items():
        if as_text(key) == name:
            return value if isinstance(value, (bytes, str)) else str(value)
    return None


def _scopes(producer_tenants: Mapping[str, str | Iterable[str] | None] | None,
            keys: Mapping[str, str]) -> dict[str, frozenset[str] | None]:
    """``{producer: tenants}`` checked: each producer has a key, each list is non-empty."""
    out: dict[str, frozenset[str] | None] = {}
    for producer, tenants in (producer_tenants or {}).items():
        if producer not in keys:
            raise ConfigurationError(
                f"FLEET_REWARD_TENANTS names producer {producer!r}, which has no key in "
                f"FLEET_REWARD_KEYS (producers with keys: {sorted(keys)}); a typo?")
        if tenants is None:
            out[producer] = None  # listed with no tenant: executions with no tenant only
            continue
        scope = frozenset([tenants] if isinstance(tenants, str) else tenants)
        if not scope or not all(isinstance(t, str) and t for t in scope):
            raise ConfigurationError(
                f"FLEET_REWARD_TENANTS: producer {producer!r} needs a non-empty list of tenant "
                'names, e.g. {"crm": ["acme"], "ops": ["*"]}')
        out[producer] = scope
    return out
