"""True counters across processes: each fleet process reports to Redis, one reader reads them.

Every fleet process (each worker process, ``fleet timers``, ``recovery``,
``attacher`` and ``relay``) runs a ``StatsReporter``: every
``FLEET_STATS_INTERVAL_S`` it writes its counters and a heartbeat into its own
hash ``fleet:stats:<role>:<name>`` (decision 0022), which expires
``FLEET_STATS_TTL_S`` after the last write. One hash per process, one writer per
hash: nothing is summed in Redis, nothing is lost when a process restarts under
a new name, and a process that stopped writing keeps its last values.

The hash:

===========  ===============================================================
role, name   which process (``worker``, ``timers``...; the worker's Celery
             node name, or ``<host>:<pid>`` for a service)
pid, host    where it runs
at           when it last reported (epoch seconds)
interval_s   how often it reports
started_at   when the reporter started
stopped_at   set by a clean stop (its last report)
counters     JSON ``{name: number}``: the counters of ``fleet.workers.stats``
             (``drives``, ``divergence_parked``...) and the service's own
             (``fired``, ``published``, ``lag_ms``...)
pool         a worker's Celery pool (its ``slots`` counter: drives at once)
problems     JSON list of what makes the process unhealthy now (a worker that
             consumes no fleet queue, a key file that cannot be read; issue 25):
             the Fleet page shows the process red with them
rose         JSON ``{name: epoch seconds}``: when each counter of ``ALARMS``
             last rose in this process (decision 0047)
===========  ===============================================================

``read_fleet`` is the one reader the Fleet page in Flower, ``fleet status`` and
the Prometheus collector use: every process's last report, its age, and its
**state** (decision 0047): ``live`` (reported within ``FLEET_STATS_STALE_S``),
``stopped`` (a clean stop: it leaves the page and the metrics at once),
``missing`` (silent without a clean stop, and still expected back: red, with its
last values and their age, never zeros) or ``gone`` (silent for longer than
``FLEET_STATS_MISSING_S``, or replaced by a newer process of its role). Every
report's counters stay in the totals until Redis forgets it. It also reads the
streams' lags (``XINFO GROUPS``) and dead letters (``XLEN``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fleet.config import FleetSettings
from fleet.kernel.errors import ConfigurationError
from fleet.services.base import PeriodicService
from fleet.streams.redis_client import aioredis, as_text, sync_redis

log = logging.getLogger("fleet.counters")

PREFIX = "fleet:stats:"
ROLES: tuple[str, ...] = ("worker", "timers", "recovery", "attacher", "relay")
#: The counters a worker reports (``fleet.workers.stats.FIELDS``), and the services'.
WORKER_COUNTERS: tuple[str, ...] = (
    "drives", "completed", "failed", "parked", "stepped_aside", "fenced_out", "recovered",
    "timers_fired", "divergence_warnings", "divergence_parked", "outcomes_attached",
    "outcomes_dead_lettered", "deliveries", "idle", "aborted", "errors", "handed_back",
    "dispatch_refused", "dispatch_accepted", "refused", "active")
SERVICE_COUNTERS: dict[str, tuple[str, ...]] = {
    "timers": ("timers_fired", "fired", "enqueued", "enqueue_errors", "ticks", "errors"),
    "recovery": ("examined", "redriven", "skipped", "queued", "failed", "diverged", "ticks",
                 "errors"),
    "attacher": ("outcomes_attached", "outcomes_dead_lettered", "duplicates", "retried",
                 "deferred", "moved", "inbox", "trimmed"),
    "relay": ("published", "present", "batches", "errors", "lag_ms", "leader",
              "peak_batch_bytes"),
}
#: Counters that need an operator when they rose lately (``FLEET_ALARM_WINDOW_S``; red
#: on the Fleet page). Parks on the divergence gate are judged by what is parked now
#: (the store), not by ``divergence_parked``, which only grows (decision 0047).
ALARMS: tuple[str, ...] = ("divergence_warnings", "fenced_out", "outcomes_dead_lettered",
                           "dispatch_refused", "errors", "enqueue_errors", "failed",
                           "control_refused")
#: A process's state, as the reader judges it (``classify``).
LIVE, STOPPED, MISSING, GONE = "live", "stopped", "missing", "gone"
#: The most problems one report carries, and the longest one.
_PROBLEMS_KEPT, _PROBLEM_CHARS = 10, 500
#: Gauges: read as they are, never summed into totals.
GAUGES: frozenset[str] = frozenset({"active", "lag_ms", "leader", "peak_batch_bytes", "diverged",
                                  "failures", "slots", "inbox"})
#: The most recent parks on an operator's gate a worker reports (which worker parked
#: which execution: the store's index forgets the holder when the lease is released).
PARKS_KEPT = 50
#: Longest name part of a key (a node name); longer is cut.
_NAME_MAX = 200


def stats_key(role: str, name: str, prefix: str = PREFIX) -> str:
    """``fleet:stats:<role>:<name>`` (``FLEET_STATS_PREFIX`` replaces ``fleet:stats:``)."""
    if role not in ROLES:
        raise ConfigurationError(f"unknown role {role!r}; one of {ROLES}")
    return f"{prefix}{role}:{name[:_NAME_MAX]}"


def process_name() -> str:
    """A service process's name: ``<host>:<pid>`` (a pod's host name is its own)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def numbers(values: Mapping[str, Any], renames: Mapping[str, str] | None = None
            ) -> dict[str, float]:
    """The numeric scalars of ``values`` (bools as 0/1; lists as their length), renamed."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, bool):
            number: float = int(value)
        elif isinstance(value, int | float):
            if isinstance(value, float) and not math.isfinite(value):
                continue
            number = value
        elif isinstance(value, list):
            number = len(value)
        elif isinstance(value, dict) and value and all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()):
            number = sum(value.values())  # counts by reason: their total
        else:
            continue
        out[(renames or {}).get(key, key)] = number
    return out


Collect = Callable[[], Mapping[str, Any]]


class StatsReporter(PeriodicService):
    """A ``PeriodicService`` writing this process's counters to ``fleet:stats:<role>:<name>``.

    Args:
        redis_url: The fleet's Redis (``FLEET_REDIS_URL``; each component's own ACL
            user may write only its role's hashes).
        role: The process's role.
        name: Its name (unique in the fleet).
        collect: Returns the counters now (called on the loop; must not block).
        interval_s: Seconds between reports.
        ttl_s: How long the hash outlives the last report.

    A report that fails (Redis down) is counted and retried at the next
    interval; the process goes on. ``stop`` writes a last report marked stopped.
    """

    name = "stats"

    def __init__(self, redis_url: str, role: str, name: str, collect: Collect, *,
                 interval_s: float = 2.0, ttl_s: int = 86_400, prefix: str = PREFIX) -> None:
        if ttl_s < 1:
            raise ConfigurationError("StatsReporter: ttl_s must be >= 1")
        # A report is bounded by its Redis client's timeouts (2 s connect, 5 s a
        # command); stop cuts one still running after that.
        super().__init__(interval_s, stop_timeout_s=8.0)
        self.key = stats_key(role, name, prefix)
        self.index = f"{prefix}index"
        self.role = role
        self.process = name
        self.redis_url = redis_url
        self.collect = collect
        self.ttl_s = ttl_s
        self.reports = 0
        self.started_at = time.time()
        #: When each alarm counter last rose here (epoch s), and its last value.
        self.rose: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._client: aioredis.Redis | None = None

    @classmethod
    def for_settings(cls, settings: FleetSettings, role: str, name: str,
                     collect: Collect) -> StatsReporter | None:
        """The reporter the settings ask for (None without ``FLEET_REDIS_URL``)."""
        if not settings.redis_url:
            return None
        return cls(settings.redis_url, role, name, collect,
                   interval_s=settings.stats_interval_s, ttl_s=settings.stats_ttl_s,
                   prefix=settings.stats_prefix)

    def fields(self, *, stopped: bool = False) -> dict[str, str]:
        """What one report writes."""
        parks: list[Any] = []
        problems: list[str] = []
        pool: Any = ""
        try:
            values = dict(self.collect())
            found = values.pop("parks", None)
            if isinstance(found, list):
                parks = found[-PARKS_KEPT:]
            said = values.pop("problems", None)
            if isinstance(said, list):
                problems = [str(p)[:_PROBLEM_CHARS] for p in said[:_PROBLEMS_KEPT]]
            pool = values.pop("pool", "")
            counters = numbers(values)
        except Exception as exc:  # noqa: BLE001 - a broken source must not stop the report
            log.warning("%s: collecting counters failed: %s: %s", self.key,
                        type(exc).__name__, exc)
            counters = {}
        now = time.time()
        for name in ALARMS:
            value = counters.get(name, 0)
            if value > self._last.get(name, 0):
                self.rose[name] = now
            self._last[name] = value
        out = {"role": self.role, "name": self.process, "pid": str(os.getpid()),
               "host": socket.gethostname(), "at": f"{now:.3f}",
               "interval_s": f"{self.interval_s:g}", "started_at": f"{self.started_at:.3f}",
               "counters": json.dumps(counters, separators=(",", ":")), "stopped_at": "",
               "parks": json.dumps(parks, separators=(",", ":")),
               "problems": json.dumps(problems, separators=(",", ":")),
               "pool": str(pool)[:40], "rose": json.dumps(self.rose, separators=(",", ":"))}
        if stopped:
            out["stopped_at"] = f"{now:.3f}"
        return out

    async def report(self, *, stopped: bool = False) -> bool:
        """Write one report now; whether Redis took it."""
        if self._client is None:
            self._client = aioredis.Redis.from_url(self.redis_url, socket_connect_timeout=2.0,
                                                   socket_timeout=5.0)
        try:
            # Not a transaction: the attacher's user has no MULTI. An HSET without
            # its EXPIRE (a fault between them) is fixed by the next report.
            pipe = self._client.pipeline(transaction=False)
            mapping: dict[Any, Any] = self.fields(stopped=stopped)
            pipe.hset(self.key, mapping=mapping)
            pipe.expire(self.key, self.ttl_s)
            # The index readers list the hashes from (no SCAN: no user may list keys).
            now = time.time()
            pipe.zadd(self.index, {self.key: now})
            pipe.zremrangebyscore(self.index, 0, now - self.ttl_s)
            await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - counted, retried at the next interval
            self.errors += 1
            if self.errors == 1 or self.errors % 30 == 0:
                log.warning("%s: cannot report to Redis (%d failures): %s: %s", self.key,
                            self.errors, type(exc).__name__, exc)
            return False
        self.reports += 1
        return True

    async def start(self) -> None:
        if self._task is None:
            self.started_at = time.time()
        await super().start()  # its first tick reports at once

    async def tick(self) -> None:
        await self.report()  # a failure is counted in report, never raised

    async def stop(self) -> None:
        running = self._task is not None
        await super().stop()
        if running:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.report(stopped=True), 5.0)
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    def stats(self) -> dict[str, Any]:
        return {"reports": self.reports, "errors": self.errors, "key": self.key}


# --------------------------------------------------------------------------
# The reader.
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessReport:
    """One process's last report as read, with its age."""

    role: str
    name: str
    counters: dict[str, float]
    at: float
    age_s: float
    stale: bool
    stopped: bool = False
    pid: int | None = None
    host: str = ""
    interval_s: float = 0.0
    started_at: float | None = None
    #: A worker's recent parks on an operator's gate: ``{"executionId", "gate", "at"}``.
    parks: tuple[dict[str, Any], ...] = ()
    #: What makes it unhealthy now (it consumes no fleet queue, a key file is unreadable).
    problems: tuple[str, ...] = ()
    #: A worker's Celery pool (``thread``, ``prefork``, ``solo``); its ``slots`` counter
    #: is how many drives it runs at once (what ``fleet status`` shows without inspect).
    pool: str = ""
    #: When each of ``ALARMS`` last rose in this process (epoch seconds).
    rose: dict[str, float] = field(default_factory=dict)
    #: ``live``, ``stopped``, ``missing`` or ``gone`` (``classify``; decision 0047).
    state: str = LIVE

    @property
    def shown(self) -> bool:
        """Whether the Fleet page, ``fleet status`` and ``/metrics`` show it: live, or
        missing (expected back)."""
        return self.state in (LIVE, MISSING)

    def rose_within(self, name: str, now: float, window_s: float) -> bool:
        at = self.rose.get(name)
        return at is not None and now - at <= window_s

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "name": self.name, "counters": dict(self.counters),
                "parks": [dict(p) for p in self.parks], "problems": list(self.problems),
                "pool": self.pool, "rose": dict(self.rose),
                "at": self.at, "age_s": round(self.age_s, 1), "stale": self.stale,
                "stopped": self.stopped, "state": self.state, "pid": self.pid,
                "host": self.host, "interval_s": self.interval_s,
                "started_at": self.started_at}


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """A stream's length, its consumer groups' lag and its dead letters."""

    stream: str
    length: int | None
    groups: dict[str, int | None]
    dead_stream: str
    dead_letters: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"stream": self.stream, "length": self.length, "groups": dict(self.groups),
                "dead_stream": self.dead_stream, "dead_letters": self.dead_letters}


@dataclass(frozen=True, slots=True)
class FleetCounters:
    """Every process's report, totals over them, the streams, and what could not be read."""

    processes: tuple[ProcessReport, ...]
    streams: tuple[StreamInfo, ...] = ()
    relay: dict[str, str] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    at: float = field(default_factory=time.time)

    def of(self, role: str) -> list[ProcessReport]:
        return [p for p in self.processes if p.role == role]

    @property
    def totals(self) -> dict[str, float]:
        """Every counter summed over every process (stale ones too: their last values);
        gauges summed over the live ones only."""
        out: dict[str, float] = dict.fromkeys(WORKER_COUNTERS, 0)
        for process in self.processes:
            for name, value in process.counters.items():
                if name in GAUGES and (process.stale or name != "active"):
                    continue
                out[name] = out.get(name, 0) + value
        return out

    def parked_by(self) -> dict[str, str]:
        """Which worker process last parked each execution (from the workers' reports)."""
        out: dict[str, tuple[float, str]] = {}
        for process in self.processes:
            for park in process.parks:
                eid, at = str(park.get("executionId", "")), float(park.get("at") or 0)
                if eid and (eid not in out or at > out[eid][0]):
                    out[eid] = (at, process.name)
        return {eid: name for eid, (_, name) in out.items()}

    @property
    def stale(self) -> list[ProcessReport]:
        return [p for p in self.processes if p.stale]

    @property
    def shown(self) -> list[ProcessReport]:
        """The processes the page and the metrics show: live, and missing ones."""
        return [p for p in self.processes if p.shown]

    @property
    def unhealthy(self) -> list[ProcessReport]:
        """The live processes that report a problem now (no fleet queue, a key file)."""
        return [p for p in self.processes if p.problems and p.state == LIVE]

    @property
    def missing(self) -> list[ProcessReport]:
        return [p for p in self.processes if p.state == MISSING]

    def live(self, role: str) -> int:
        """How many processes of ``role`` report now."""
        return sum(1 for p in self.processes if p.role == role and p.state == LIVE)

    def risen(self, now: float, window_s: float) -> dict[str, tuple[float, float]]:
        """``{counter: (total, when it last rose)}`` for the ``ALARMS`` that rose in some
        process within ``window_s`` of ``now``."""
        totals = self.totals
        out: dict[str, tuple[float, float]] = {}
        for name in ALARMS:
            last = max((p.rose[name] for p in self.processes
                        if p.rose_within(name, now, window_s)), default=None)
            if last is not None:
                out[name] = (totals.get(name, 0), last)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "totals": self.totals,
                "processes": [p.to_dict() for p in self.processes],
                "streams": [s.to_dict() for s in self.streams], "relay": dict(self.relay),
                "problems": list(self.problems)}


def parse_report(raw: Mapping[Any, Any], *, now: float, stale_s: float) -> ProcessReport | None:
    """A hash as ``HGETALL`` returns it; None when it is not a report (a foreign key)."""
    data = {as_text(k): as_text(v) for k, v in raw.items()}
    try:
        at = float(data["at"])
        counters_raw = json.loads(data.get("counters") or "{}")
        role, name = data["role"], data["name"]
    except (KeyError, ValueError, TypeError):
        return None
    counters = numbers(counters_raw) if isinstance(counters_raw, dict) else {}
    stopped = bool(data.get("stopped_at"))
    age = max(0.0, now - at)
    try:
        interval = float(data.get("interval_s") or 0)
    except ValueError:
        interval = 0.0
    try:
        pid: int | None = int(data.get("pid") or "")
    except ValueError:
        pid = None
    try:
        started: float | None = float(data.get("started_at") or "")
    except ValueError:
        started = None
    try:
        parks_raw = json.loads(data.get("parks") or "[]")
    except ValueError:
        parks_raw = []
    parks = tuple(p for p in parks_raw if isinstance(p, dict)) if isinstance(
        parks_raw, list) else ()
    try:
        problems_raw = json.loads(data.get("problems") or "[]")
    except ValueError:
        problems_raw = []
    problems = tuple(str(p)[:_PROBLEM_CHARS] for p in problems_raw[:_PROBLEMS_KEPT]) \
        if isinstance(problems_raw, list) else ()
    try:
        rose_raw = json.loads(data.get("rose") or "{}")
    except ValueError:
        rose_raw = {}
    rose = numbers(rose_raw) if isinstance(rose_raw, dict) else {}
    # A process reporting less often than the stale limit is judged by its own interval.
    limit = max(stale_s, 3 * interval)
    return ProcessReport(role=role, name=name, counters=counters, at=at, age_s=age,
                         stale=stopped or age > limit, stopped=stopped, pid=pid,
                         host=data.get("host", ""), interval_s=interval, started_at=started,
                         parks=parks, problems=problems, pool=data.get("pool", ""),
                         rose=rose,
                         state=STOPPED if stopped else (MISSING if age > limit else LIVE))


def classify(reports: Iterable[ProcessReport], *, missing_s: float) -> list[ProcessReport]:
    """Each silent process (stale, not stopped) as ``missing`` or ``gone`` (decision 0047).

    It is gone once it has been silent for more than ``missing_s``, or once a newer
    process of its role took its place: a live one that started after its last
    report (each newer process replaces one silent process, the most recent first,
    so a pod that restarts under a new name clears the old one and a worker that
    died while another kept running stays missing). Otherwise it is missing.
    """
    reports = list(reports)
    newer: dict[str, list[float]] = {}
    for report in reports:
        if report.state == LIVE and report.started_at is not None:
            newer.setdefault(report.role, []).append(report.started_at)
    out: dict[int, ProcessReport] = {}
    silent = sorted((i for i, r in enumerate(reports) if r.state in (MISSING, GONE)),
                    key=lambda i: -reports[i].at)
    for i in silent:
        report = reports[i]
        state = MISSING
        if report.age_s > missing_s:
            state = GONE
        else:
            takers = [at for at in newer.get(report.role, []) if at > report.at]
            if takers:
                newer[report.role].remove(min(takers))
                state = GONE
        out[i] = replace(report, state=state)
    return [out.get(i, r) for i, r in enumerate(reports)]


def _keys(client: Any, limit: int, prefix: str, since: float) -> list[str]:
    """The report hashes in the index (``<prefix>index``, scored by last report)."""
    keys = client.zrangebyscore(f"{prefix}index", since, "+inf", start=0, num=limit)
    wanted = [as_text(k) for k in keys or []]
    return sorted(k for k in wanted if k.startswith(prefix) and k != f"{prefix}index")


def _xinfo_groups(client: Any, stream: str) -> dict[str, int | None]:
    try:
        groups = client.xinfo_groups(stream)
    except sync_redis.ResponseError as exc:
        if "no such key" in str(exc).lower():
            return {}
        raise
    out: dict[str, int | None] = {}
    for group in groups or []:
        entry = {as_text(k): v for k, v in dict(group).items()}
        lag = entry.get("lag")
        out[as_text(entry.get("name", ""))] = None if lag is None else int(lag)
    return out


def stream_infos(client: Any, streams: Iterable[tuple[str, str]]) -> list[StreamInfo]:
    """``(stream, dead stream)`` pairs -> their lengths, group lags, dead letters."""
    out = []
    for stream, dead in streams:
        out.append(StreamInfo(stream, int(client.xlen(stream)), _xinfo_groups(client, stream),
                              dead, int(client.xlen(dead))))
    return out


def read_fleet(client: Any, *, stale_s: float = 10.0,
               streams: Iterable[tuple[str, str]] = (), relay_key: str | None = None,
               limit: int = 10_000, now: float | None = None,
               prefix: str = PREFIX, ttl_s: float = 86_400,
               missing_s: float = 900.0) -> FleetCounters:
    """Every ``fleet:stats:*`` report (a sync Redis client), and the streams asked for.

    A part that cannot be read is named in ``problems``; the rest is still read.
    """
    problems: list[str] = []
    reports: list[ProcessReport] = []
    try:
        at = time.time() if now is None else now
        keys = _keys(client, limit, prefix, at - ttl_s)
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        for key, raw in zip(keys, pipe.execute(), strict=True):
            report = parse_report(raw or {}, now=at, stale_s=stale_s)
            if report is None:
                if raw:
                    problems.append(f"{key}: not a fleet report")
                continue  # expired since it was indexed
            reports.append(report)
    except Exception as exc:  # noqa: BLE001 - shown, and the rest still read
        problems.append(f"counters: {type(exc).__name__}: {exc}")
    infos: list[StreamInfo] = []
    try:
        infos = stream_infos(client, streams)
    except Exception as exc:  # noqa: BLE001 - shown, and the rest still read
        problems.append(f"streams: {type(exc).__name__}: {exc}")
    relay: dict[str, str] = {}
    if relay_key:
        try:
            relay = {as_text(k): as_text(v) for k, v in (client.hgetall(relay_key) or {}).items()}
        except Exception as exc:  # noqa: BLE001 - shown, and the rest still read
            problems.append(f"relay: {type(exc).__name__}: {exc}")
    reports = classify(reports, missing_s=missing_s)
    order = {role: i for i, role in enumerate(ROLES)}
    reports.sort(key=lambda r: (order.get(r.role, 99), r.name))
    return FleetCounters(tuple(reports), tuple(infos), relay, tuple(problems))


def fleet_streams(settings: FleetSettings) -> list[tuple[str, str]]:
    """The streams a fleet has: events and rewards, each with its dead letters."""
    return [(settings.events_stream, f"{settings.events_stream}:dead"),
            (settings.rewards_stream, settings.rewards_dead)]


class CountersReader:
    """``read_fleet`` over one sync Redis client (the Fleet page, ``fleet status``, metrics)."""

    def __init__(self, settings: FleetSettings, *, timeout_s: float = 2.0) -> None:
        if not settings.redis_url:
            raise ConfigurationError("reading the fleet's counters needs FLEET_REDIS_URL")
        self.settings = settings
        self.client = sync_redis.Redis.from_url(settings.redis_url,
                                                socket_connect_timeout=timeout_s,
                                                socket_timeout=timeout_s)

    def read(self, *, streams: bool = True) -> FleetCounters:
        return read_fleet(self.client, stale_s=self.settings.stats_stale_s,
                          prefix=self.settings.stats_prefix, ttl_s=self.settings.stats_ttl_s,
                          missing_s=self.settings.stats_missing_s,
                          streams=fleet_streams(self.settings) if streams else (),
                          relay_key=f"{self.settings.events_stream}:relay" if streams else None)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


__all__ = ["ALARMS", "GAUGES", "GONE", "LIVE", "MISSING", "PARKS_KEPT", "PREFIX", "ROLES",
           "SERVICE_COUNTERS", "STOPPED", "WORKER_COUNTERS",
           "CountersReader", "FleetCounters", "ProcessReport", "StatsReporter", "StreamInfo",
           "classify", "fleet_streams", "numbers", "parse_report", "process_name",
           "read_fleet",
           "stats_key", "stream_infos"]
