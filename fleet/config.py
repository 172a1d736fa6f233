"""One typed settings object, read from ``FLEET_*`` environment variables.

Read when a program starts (``FleetSettings()``), never at import time, and
turned here into the options objects the parts take (``store_options()``): the
kernel and the stores never see this object. ``fleet.assembly.roles`` builds
every fleet process's parts from it; ``fleet.host.kernel`` its store and Runtime.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic import ValidationError as PydanticValidationError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from fleet.kernel.errors import ConfigurationError, ValidationError
from fleet.kernel.queues import Queue, queues_from_mapping
from fleet.kernel.store.factory import GroupCommit, StoreOptions

#: The event loops a fleet process may run on (``FLEET_EVENT_LOOP``; ``fleet.host.loop``).
EventLoopName = Literal["auto", "asyncio", "uvloop"]
EVENT_LOOPS: tuple[EventLoopName, ...] = ("auto", "asyncio", "uvloop")
#: What ``run_loop`` does to the garbage collector (``FLEET_GC``; ``fleet.host.loop``).
GcPolicy = Literal["auto", "default"]
GC_POLICIES: tuple[GcPolicy, ...] = ("auto", "default")


class FleetSettings(BaseSettings):
    """Where fleet keeps its state and how it runs."""

    model_config = SettingsConfigDict(env_prefix="FLEET_", extra="ignore")

    database_url: str = Field("sqlite:///fleet.db",
                              description="memory:, sqlite:///path or postgresql://...")
    redis_url: str | None = Field(None, description="redis://host:port/db for the fleet")
    lease_ms: int = Field(30_000, ge=100, description="how long a driver's lease lasts")
    strict: bool = Field(False, description="every call needs a principal")
    divergence: str = Field(
        "fail", pattern="^(off|warn|fail)$",
        description="what a re-run that skipped recorded steps does before new work: fail "
        "parks it on __fleet_diverged__ for an operator's retry (the fleet's default since "
        "0.2.0); warn (opt-in) logs it and lets it run on; off does not judge")
    sha256_flow_hash: bool = False
    event_loop: EventLoopName = Field(
        "auto", description="the event loop every loop fleet owns runs on (workers, services, "
        "the dispatcher's and the CLI's): auto (uvloop where it is installed, else asyncio's), "
        "uvloop (refused when it is not installed) or asyncio; a Runtime in your own "
        "application runs on your loop (decision 0031)")
    gc: GcPolicy = Field(
        "auto", description="what the first run_loop of a process does to the garbage "
        "collector: auto (freeze what start-up built, collect the youngest generation every "
        "5,000 allocations) or default (leave the interpreter's collector as it is; "
        "decision 0031)")

    # -- the store (issue 3): Postgres pool and limits, group commit ---------------
    # Turned into ``StoreOptions`` by ``store_options``. Unset pool sizes leave the
    # URL's ``?pool_min=&pool_max=`` or the store's defaults.
    pg_pool_min: int | None = Field(None, ge=0, description="Postgres connections kept open")
    pg_pool_max: int | None = Field(None, ge=1, description="most Postgres connections")
    max_event_bytes: int | None = Field(
        None, ge=1, description="largest event (JSON bytes) the store takes (every backend); "
        "unset: 16 MiB")
    group_commit: bool | None = Field(
        None, description="batch appends of many executions into one transaction per flush "
        "(CoalescingEventStore); unset: on for Postgres, off for memory and SQLite")
    group_commit_max_batch: int = Field(256, ge=1, description="most appends in one flush")
    group_commit_max_wait_ms: float = Field(
        0.0, ge=0, description="longest an append waits for others to join its flush")
    group_commit_max_inflight: int = Field(4, ge=1, description="flushes running at once")

    # -- the fleet (issue 6): Celery, Redis streams, services ------------------
    broker_url: str | None = Field(
        None, description="Celery broker (redis:// or amqp://); default: redis_url")
    # How broker connections fail and come back (fleet.host.broker, decision 0014):
    # a short outage costs about its own length, not Celery's 2/4/6 s backoff.
    broker_retry_interval_s: float = Field(
        0.2, gt=0, description="first wait before reconnecting to the broker, and how much "
        "longer each further wait is")
    broker_retry_max_interval_s: float = Field(
        1.0, gt=0, description="longest wait between two reconnect attempts")
    broker_max_retries: int | None = Field(
        None, ge=1, description="reconnect attempts before a worker gives up and exits "
        "non-zero (for its supervisor to restart it); unset: retry for as long as it takes")
    # Deadlines on every broker and Redis call (issue 10 item 4): connect, command, publish.
    broker_connect_timeout_s: float = Field(
        2.0, gt=0, description="a connection attempt to the broker gives up after this")
    broker_socket_timeout_s: float = Field(
        10.0, gt=1, description="Redis: a broker command with no answer fails after this "
        "(a half-open connection); above kombu's 1 s BRPOP")
    publish_timeout_s: float = Field(
        10.0, gt=0, description="the longest a dispatcher's publish of drives (connect, send, "
        "answer) takes before BrokerUnavailableError; the write it follows stands")
    publish_concurrency: int = Field(
        16, ge=1, description="publishes in flight at once per dispatcher: Redis connections "
        "(a redis:// broker) or publishing threads (amqp://)")
    broker_health_check_s: int = Field(
        5, ge=0, description="Redis: an idle broker connection is pinged before use after "
        "this, and a BRPOP overdue by this much is dropped and reconnected; 0: off")
    flows: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="comma-separated module:flow specs every fleet process registers")
    queue: str = Field("fleet.drive", description="the default Celery queue for drives")
    routes: dict[str, str] = Field(
        default_factory=dict,
        description='JSON {"flow:<id>" or "tenant:<t>": queue}; heavy flows get own workers')
    queues: dict[str, Any] = Field(
        default_factory=dict,
        description='JSON {"<queue>": {"concurrency": 3, "per_key_concurrency": 1, "rate": '
        '[10, 1.0], "priority": true}}: the queues starts may name (start(..., queue=)), '
        "with limits that hold across the fleet (the rate's period in seconds; decision "
        "0056). Every process of a fleet needs the same value")
    worker_drives: int = Field(64, ge=1, description="concurrent drives per worker process")
    drive_batch: int = Field(
        16, ge=1, le=256, description="most drives one published message carries: drives "
        "published together on one queue (a group of starts, sends) go out as `fleet.drives` "
        "messages of up to this many executions, which one worker drives at once on its loop "
        "(decision 0030); 1: a `fleet.drive` message each")
    worker_pool: str = Field(
        "threads", pattern="^(threads|prefork|solo)$",
        description="Celery pool of a worker: threads (one loop, worker_drives drives at "
        "once; decision 0012) or prefork (a loop per child). Celery's `-P prefork` cannot "
        "override an app's configured pool: set this instead")
    worker_drain_s: float = Field(
        20.0, ge=0, description="on SIGTERM, how long a worker lets its drives run on to "
        "their next durable point before it hands back the rest (leases released at once); "
        "keep it well under the pod's terminationGracePeriodSeconds")
    heartbeat_dir: str | None = Field(
        None, description="where each fleet process writes the heartbeat of its event loop "
        "(fleet-<component>.heartbeat) that `fleet health` reads; default: the temp dir")
    heartbeat_max_age_s: float = Field(
        10.0, gt=0, description="`fleet health` fails when the heartbeat (written every "
        "second from inside the event loop) is older than this: a stuck loop")
    timer_interval_s: float = Field(0.25, gt=0, description="how often due timers are polled")
    timer_batch: int = Field(500, ge=1, le=10_000, description="due timers one claim takes "
                             "(and fires in one write, their drives in one publish)")
    recovery_interval_s: float = Field(2.0, gt=0)
    service_tick_deadline_s: float = Field(
        60.0, gt=0, description="a timer or recovery tick running longer than this makes "
        "the service not live (`fleet health --liveness` fails): it is wedged")
    service_stop_s: float = Field(
        10.0, ge=0, description="on SIGTERM, how long a service's tick in flight may run "
        "on before it is cancelled")
    recovery_grace_ms: int = Field(
        5_000, ge=0, description="a running execution with no lease is lost after this")
    events_stream: str = Field(
        "fleet:events", description="the stream `fleet relay` publishes every committed event "
        "to (exactly once, under its store position); no other writer may use it")
    events_maxlen: int = Field(
        100_000, ge=1, description="MAXLEN ~ of the events stream: the trim policy (a consumer "
        "that falls further behind reads the gap from the store)")

    # -- the relay (issue 12): the store's committed feed -> events_stream -------------
    relay_batch_size: int = Field(500, ge=1, le=10_000,
                                  description="most events the relay reads and publishes at once")
    relay_batch_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="a relay batch stops once it holds this many "
        "bytes of JSON (with relay_batch_size, what bounds the relay's memory)")
    relay_poll_s: float = Field(
        0.25, gt=0, description="how often a caught-up relay reads the store when no commit "
        "signal arrives (SQLite and memory always poll)")
    relay_linger_ms: float = Field(
        2.0, ge=0, le=1000, description="after a short batch, how long the relay lets "
        "commits gather before it reads again: under a steady load it reads fuller batches "
        "and never arms the doorbell (no NOTIFY from the writers); at most this much more "
        "lag")
    relay_notify: bool = Field(
        True, description="on Postgres, wake the relay with LISTEN/NOTIFY (the first commit "
        "after it went idle rings it); off: poll only")
    relay_lease_ms: int = Field(
        10_000, ge=300, description="the lease that makes one relay replica the publisher; a "
        "standby takes over within about this long after the holder died")
    publisher_buffer_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="bytes of JSON an EventPublisher (the in-process "
        "hook onto a stream of your own; no fleet role runs one) holds while Redis cannot take "
        "them; the oldest are dropped past it")
    # -- what operators see (issue 14; decision 0022) --------------------------------
    stats_prefix: str = Field(
        "fleet:stats:", min_length=1, description="where processes report: the hash "
        "<prefix><role>:<name> (deploy/redis/users.acl grants fleet:stats:<role>:*)")
    stats_interval_s: float = Field(
        2.0, gt=0, description="how often every fleet process writes its counters and a "
        "heartbeat to its hash fleet:stats:<role>:<name> in Redis (the Fleet page, `fleet "
        "status` and the metrics read them)")
    stats_stale_s: float = Field(
        10.0, gt=0, description="a process whose last report is older than this shows as "
        "stale (its last values and their age, never zeros)")
    stats_ttl_s: int = Field(
        86_400, ge=60, description="how long a process's last report is kept (its "
        "counters stay in the totals) before Redis forgets it")
    health_port: int | None = Field(
        None, ge=0, le=65535, description="serve GET /livez and /readyz (the checks of "
        "`fleet health`) on this port, for HTTP probes; unset: off")
    stats_missing_s: float = Field(
        900.0, gt=0, description="a process that stopped reporting without a clean stop "
        "is missing (red on the Fleet page, fleet_process_stale=1) for this long, unless a "
        "newer process of its role replaced it first; then it is gone (decision 0047)")
    alarm_window_s: float = Field(
        900.0, gt=0, description="a counter that needs an operator (fenced_out, errors, "
        "dead letters...) is red on the Fleet page while it rose within this many seconds "
        "(decision 0047)")
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="Prometheus /metrics on this port: in `fleet "
        "flower`, the whole fleet's metrics (the one scrape target; decision 0046); in a "
        "service process (timers, recovery, attacher, relay), that process's own Python "
        "and process metrics only; unset: none")
    metrics_refresh_s: float = Field(
        5.0, gt=0, description="how often `fleet flower` reads the store's backlog for the "
        "metrics and the Fleet page while anyone reads them (one indexed query each time; "
        "a scrape answers the latest, decision 0046)")
    runbook_url: str | None = Field(
        None, description="where the Fleet page's alarms link to (the runbook of "
        "docs/operations.md as you host it; each alarm adds #<its entry>); unset: the "
        "runbook Flower serves at /fleet/runbook")
    operator: str | None = Field(
        None, description="the principal (actor) the Fleet page and `fleet diverged retry` "
        "retry diverged executions as; recorded on the log as who resumed. Unset: retry "
        "is off")
    operators: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated Flower users (basic-auth names or "
        "OAuth e-mails) with the operator role (may retry diverged executions); '*' is "
        "every user Flower lets in")
    flower_tenants: dict[str, list[str]] = Field(
        default_factory=dict, description='JSON {"<Flower user>": ["tenant", ...]}: what a '
        "Flower user without the operator role may read: the Fleet page's executions (their "
        "logs, the parked list) of those tenants; [\"*\"]: every tenant, and Flower's own "
        "task and worker pages (which show every task's arguments). Unlisted: the counters "
        "only. Operators (FLEET_OPERATORS) read everything; an unauthenticated Flower "
        "(--unauthenticated) reads everything and changes nothing (docs/security.md)")
    rewards_stream: str = Field(
        "fleet:rewards", description="the attachers' stream of rewards (the attacher alone "
        "adds to it, from the inbox; trimmed once every group acknowledged an entry)")
    rewards_inbox: str = Field(
        "fleet:rewards:inbox", description="where producers send rewards (a Redis list: "
        "LPUSH only; the attacher moves each onto the stream under an id Redis picks; issue "
        "25 item 2)")
    rewards_dead: str = "fleet:rewards:dead"
    rewards_group: str = "fleet-attachers"
    dead_letters_maxlen: int = Field(
        10_000, ge=100, description="the most dead letters a stream consumer keeps "
        "(XADD MAXLEN ~): the oldest go first; each field of one is cut to 8 KiB")
    # -- signed fleet.dispatch messages (issue 10 item 3; decision 0018) ----------
    dispatch_keys: dict[str, Any] = Field(
        default_factory=dict, description='JSON key ring {"<key id>": {"client": "web", '
        '"secret": "...", "tenants": ["acme"]}}: the keys fleet.dispatch messages are signed '
        'with (workers verify; a client keeps only its own)')
    dispatch_keys_file: str | None = Field(
        None, description="a file holding the same JSON (a mounted Secret); re-read when it "
        "changes")
    dispatch_key_id: str | None = Field(
        None, description="a client's: which key of the ring it signs with")
    dispatch_allow_unsigned: bool = Field(
        False, description="workers accept unsigned fleet.dispatch messages (anyone who can "
        "publish to the broker acts as any principal): a trusted network or a demo only")
    dispatch_max_age_s: float = Field(
        300.0, gt=0, description="the longest a signed message may be valid (expires_at - "
        "issued_at)")
    dispatch_clock_skew_s: float = Field(
        30.0, ge=0, description="clock difference tolerated between signer and worker")
    dispatch_max_bytes: int = Field(
        1_048_576, ge=1024, description="the largest fleet.dispatch message (JSON bytes) a "
        "worker reads")
    # -- remote control of the workers (issue 25 item 1; decision 0042) -------------
    control_keys: dict[str, Any] = Field(
        default_factory=dict, description='JSON key ring {"<key id>": "<secret>"} (the format '
        "of FLEET_DISPATCH_KEYS; tenants [\"*\"]): the operators' keys. Workers obey a "
        "control command that changes them (shutdown, cancel_consumer, pool_restart, "
        "revoke...) only when one of these signed it; Flower and `fleet up` sign with theirs. "
        "Unset on a worker: it obeys none")
    control_keys_file: str | None = Field(
        None, description="a file holding the same JSON (a mounted Secret); re-read when it "
        "changes; unreadable: no control command is obeyed")
    control_key_id: str | None = Field(
        None, description="which key of FLEET_CONTROL_KEYS this process signs its control "
        "commands with (default: the ring's only key)")
    environment: str | None = Field(
        None, min_length=1, max_length=200, description="this fleet's name (prod, staging, "
        "...): clients sign it into every fleet.dispatch message (env) and workers refuse a "
        "message signed for another, so a message from staging never verifies in production "
        "even where the two share a key (decision 0045). Unset: messages are not bound")
    dispatch_allow_unbound: bool = Field(
        False, description="a worker with FLEET_ENVIRONMENT also accepts signed messages "
        "that name no environment: only while clients of the previous release, which do "
        "not bind them, still run (decision 0045's migration)")
    reward_keys: dict[str, str] = Field(
        default_factory=dict, description='JSON {"producer": "secret"}: the reward producers\' '
        'HMAC keys (the attacher verifies with them, `fleet reward submit` signs with one)')
    reward_keys_file: str | None = Field(
        None, description="a file holding the same JSON object (what `fleet up` writes to "
        ".fleet/reward-keys.json; a mounted Secret); instead of FLEET_REWARD_KEYS")
    reward_tenants: dict[str, list[str]] = Field(
        default_factory=dict, description='JSON {"producer": ["tenant", ...]}: the tenants '
        'whose executions each producer may reward ("*": every tenant, and executions with '
        "none). A producer rewards only its tenants' executions; one it does not list (all "
        "of them, unset) only executions with no tenant: scoping is the default, [\"*\"] "
        "opts a producer out (decision 0025, issue 25 item 13)")

    @field_validator("reward_tenants")
    @classmethod
    def _check_reward_tenants(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for producer, tenants in value.items():
            if not producer or not tenants or not all(tenants):
                raise ValueError(
                    f"producer {producer!r} needs a non-empty list of tenant names; example: "
                    '{"crm": ["acme", "globex"], "ops": ["*"]}')
        return value

    @field_validator("flower_tenants")
    @classmethod
    def _check_flower_tenants(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for user, tenants in value.items():
            if not user or not tenants or not all(tenants):
                raise ValueError(
                    f"Flower user {user!r} needs a non-empty list of tenant names; example: "
                    '{"alice": ["acme"], "auditor": ["*"]}')
        return value

    @field_validator("flows", "operators", mode="before")
    @classmethod
    def _split_flows(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    def queue_declarations(self) -> tuple[Queue, ...]:
        """``FLEET_QUEUES`` as ``Queue`` objects (what every role's Runtime declares).

        Raises:
            ConfigurationError: a queue's settings are unusable; the message names
                ``FLEET_QUEUES``, the queue and the field.
        """
        try:
            return queues_from_mapping(self.queues)
        except ValidationError as exc:
            raise ConfigurationError(f"FLEET_QUEUES: {exc.message}; e.g. "
                                     f"FLEET_QUEUES={SETTING_EXAMPLES['queues']!r}") from exc

    def store_options(self) -> StoreOptions:
        """What ``open_event_store(database_url, ...)`` takes beside the URL."""
        postgres = self.database_url.startswith(("postgresql://", "postgres://"))
        group: GroupCommit | bool = (GroupCommit(max_batch=self.group_commit_max_batch,
                                                 max_wait_ms=self.group_commit_max_wait_ms,
                                                 max_inflight=self.group_commit_max_inflight)
                                     if self.group_commit or (self.group_commit is None
                                                              and postgres) else False)
        return StoreOptions(pool_min=self.pg_pool_min, pool_max=self.pg_pool_max,
                            max_event_bytes=self.max_event_bytes, group_commit=group,
                            max_lease_ms=self.max_lease_ms)

    @property
    def max_lease_ms(self) -> int:
        """The longest lease the fleet's stores grant or honour (decision 0044): twice the
        longest the fleet takes, so a lease set further ahead (a skewed or forged clock)
        is taken over, and the database's clock stepping back less than a lease does not
        make live leases look forged. The fleet's leases: ``lease_ms``, the relay's, and
        the kernel's default (30 s) that one-off runtimes take (the CLI, Flower's Retry,
        a repair)."""
        return 2 * max(self.lease_ms, self.relay_lease_ms, 30_000)

    @property
    def broker(self) -> str:
        url = self.broker_url or self.redis_url
        if not url:
            raise ConfigurationError(
                "no broker: set FLEET_BROKER_URL or FLEET_REDIS_URL (redis:// or amqp://)")
        return url


# -- explaining a bad setting (issue 10 item 11) ---------------------------------------

#: Example values for the settings whose default is no example (unset or empty).
SETTING_EXAMPLES: dict[str, str] = {
    "database_url": "postgresql://fleet@db:5432/fleet",
    "redis_url": "redis://127.0.0.1:6379/0",
    "broker_url": "redis://127.0.0.1:6379/0",
    "divergence": "fail",
    "pg_pool_min": "1",
    "pg_pool_max": "10",
    "max_event_bytes": "1048576",
    "broker_max_retries": "10",
    "flows": "myapp.flows:onboard,myapp.flows:billing",
    "routes": '{"flow:report": "fleet.heavy", "tenant:acme": "fleet.acme"}',
    "queues": '{"emails": {"concurrency": 3, "rate": [10, 1.0]}}',
    "heartbeat_dir": "/var/run/fleet",
    "dispatch_keys": '{"web-1": {"client": "web", "secret": "<random>", "tenants": ["acme"]}}',
    "dispatch_keys_file": "/etc/fleet/dispatch-keys.json",
    "dispatch_key_id": "web-1",
    "control_keys": '{"ops-1": "<random secret>"}',
    "control_keys_file": "/etc/fleet/control-keys.json",
    "control_key_id": "ops-1",
    "reward_keys": '{"billing": "<random secret>"}',
    "flower_tenants": '{"alice": ["acme"], "auditor": ["*"]}',
}
#: Settings whose value an error never repeats (secrets; URLs that may hold a password).
_UNECHOED = ("url", "keys", "secret", "password")


def setting_env_name(field: str) -> str:
    """The environment variable of setting ``field``: ``lease_ms`` -> ``FLEET_LEASE_MS``."""
    return f"FLEET_{field.upper()}"


def setting_example(field: str) -> str:
    """A good value of setting ``field``, as its environment variable takes it."""
    if field in SETTING_EXAMPLES:
        return SETTING_EXAMPLES[field]
    info = FleetSettings.model_fields.get(field)
    value = None if info is None else info.get_default(call_default_factory=True)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value)
    return "" if value is None else str(value)


def describe_settings_error(exc: BaseException) -> list[str] | None:
    """One line per bad ``FLEET_*`` setting in ``exc`` (which setting, what is wrong, a
    good value), or None when ``exc`` is not about the settings.

    ``exc`` is what ``FleetSettings()`` raised: pydantic's ``ValidationError`` (a
    value of the wrong type or range), or pydantic-settings' ``SettingsError`` (a
    JSON setting that is not JSON). A secret's or a URL's value is never repeated.
    """
    if isinstance(exc, SettingsError):
        found = re.search(r'field "([^"]+)"', str(exc))
        if found is None:
            return [str(exc)]
        field = found.group(1)
        cause = exc.__cause__ or exc.__context__
        why = f"is not JSON ({cause})" if isinstance(cause, ValueError) else f"is unusable ({exc})"
        return [_line(field, why)]
    if not isinstance(exc, PydanticValidationError) or exc.title != FleetSettings.__name__:
        return None
    lines = []
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ())]
        if not loc:
            lines.append(f"FLEET_* settings: {error.get('msg')}")
            continue
        field, inner = loc[0], loc[1:]
        where = f" (at {'.'.join(inner)})" if inner else ""
        shown = "" if any(word in field for word in _UNECHOED) or inner else \
            f"={_shown(error.get('input'))}"
        message = str(error.get("msg", "is not valid"))
        message = message[:1].lower() + message[1:]
        lines.append(_line(field, f"{message}{where}", shown))
    return lines


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return shlex.quote(text if len(text) <= 40 else text[:37] + "...")


def _line(field: str, why: str, shown: str = "") -> str:
    name = setting_env_name(field)
    example = setting_example(field)
    hint = f"; e.g. {name}={shlex.quote(example)}" if example else ""
    joint = " " if why.startswith("is ") else ": "
    return f"{name}{shown}{joint}{why}{hint}"
