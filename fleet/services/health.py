"""Is this fleet process healthy? Its event loop's heartbeat, its broker, its store.

Each long-running fleet process (a worker, the timer service, the recovery
sweeper, the reward attacher, the relay) runs a ``Heartbeat`` on its event loop: every
second, from inside the loop, it rewrites ``fleet-<component>.heartbeat`` in
``FLEET_HEARTBEAT_DIR`` (default: the temp dir). A loop that is stuck (a step
that blocks it, a deadlock) stops rewriting it, while the process itself is
still alive and would pass any check made from another thread.

``check_health`` is what ``fleet health --component C`` runs, once per probe:

* **liveness** (``liveness=True``): only the heartbeat. A Redis or Postgres
  outage must not restart every pod; only a stuck or dead loop should.
* **readiness**: the heartbeat, then a broker ping and a cheap store read,
  concurrently, each bounded by ``timeout_s``.

The probe opens no Celery app and imports no more than the checks need, so it
stays fast (it runs every few seconds per pod).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from fleet.config import FleetSettings
from fleet.host.keys import KeyRing
from fleet.host.loop import run_loop
from fleet.kernel.errors import ConfigurationError
from fleet.kernel.store.factory import open_event_store, open_postgres_event_store

log = logging.getLogger("fleet.health")

COMPONENTS: tuple[str, ...] = ("worker", "timers", "recovery", "attacher", "relay")
BEAT_INTERVAL_S = 1.0
PROBE_EXECUTION_ID = "fleet:health-probe"
_REDIS_SCHEMES = ("redis", "rediss", "valkey", "valkeys", "unix")


def heartbeat_dir(settings: FleetSettings) -> Path:
    """Where heartbeats go: ``settings.heartbeat_dir``, else the temp dir (``$TMPDIR``)."""
    return Path(settings.heartbeat_dir or tempfile.gettempdir())


def heartbeat_path(settings: FleetSettings, component: str, slot: int | None = None) -> Path:
    """The heartbeat file of ``component`` (a prefork worker child adds its ``slot``)."""
    name = component if slot is None else f"{component}-{slot}"
    return heartbeat_dir(settings) / f"fleet-{name}.heartbeat"


def _check_component(component: str) -> None:
    if component not in COMPONENTS:
        raise ConfigurationError(f"unknown component {component!r}; one of {COMPONENTS}")


class Heartbeat:
    """A ``Service`` that rewrites a heartbeat file from inside its event loop.

    Args:
        path: The file (``heartbeat_path``).
        interval_s: Seconds between beats.
        on_beat: Called on the loop after each beat (the worker polls its
            shutdown flag there); an exception it raises is logged.
        stuck: Says why the process is not live although its loop runs (a
            service's tick past its deadline), or None; written into the
            heartbeat, where ``check_heartbeat`` fails on it.
    """

    requires: tuple[str, ...] = ()

    def __init__(self, path: Path, *, interval_s: float = BEAT_INTERVAL_S,
                 on_beat: Callable[[], Any] | None = None, name: str = "heartbeat",
                 stuck: Callable[[], str | None] | None = None) -> None:
        if interval_s <= 0:
            raise ConfigurationError("Heartbeat: interval_s must be > 0")
        self.name = name
        self.path = path
        self.interval_s = interval_s
        self.on_beat = on_beat
        self.stuck = stuck
        self.beats = 0
        self.errors = 0
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def for_component(cls, settings: FleetSettings, component: str, *,
                      slot: int | None = None, **kwargs: Any) -> Heartbeat:
        _check_component(component)
        return cls(heartbeat_path(settings, component, slot), **kwargs)

    async def start(self) -> None:
        if self._task is None:
            self.beat()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.beat()
            if self.on_beat is not None:
                try:
                    self.on_beat()
                except Exception as exc:  # noqa: BLE001 - a hook must not stop the beat
                    log.warning("heartbeat hook failed: %s: %s", type(exc).__name__, exc)

    def beat(self) -> None:
        """Write the file now (atomically: a reader never sees half of it)."""
        beat: dict[str, Any] = {"pid": os.getpid(), "at": time.time()}
        try:
            reason = self.stuck() if self.stuck is not None else None
        except Exception as exc:  # noqa: BLE001 - a broken check is itself a reason
            reason = f"the stuck check failed: {type(exc).__name__}: {exc}"
        if reason:
            beat["stuck"] = reason
        body = json.dumps(beat)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(body)
            os.replace(tmp, self.path)
            self.beats += 1
        except OSError as exc:
            # Counted, not fatal: the probe then sees an old heartbeat and says so.
            self.errors += 1
            if self.errors == 1 or self.errors % 60 == 0:
                log.warning("cannot write the heartbeat %s: %s", self.path, exc)

    async def stop(self) -> None:
        """Stop beating and remove the file (a stopped process has no heartbeat)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(OSError):
            self.path.unlink()

    def stats(self) -> dict[str, Any]:
        return {"beats": self.beats, "errors": self.errors, "path": str(self.path)}


# --------------------------------------------------------------------------
# The checks.
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    """One check: its name, whether it passed, what it found, how long it took."""

    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class HealthReport:
    """What ``check_health`` found."""

    component: str
    liveness: bool
    checks: tuple[Check, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def reason(self) -> str:
        """One line: the first failure, or what passed."""
        failed = [c for c in self.checks if not c.ok]
        if failed:
            return f"{failed[0].name}: {failed[0].detail}"
        return "; ".join(f"{c.name}: {c.detail}" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"component": self.component, "ok": self.ok,
                "mode": "liveness" if self.liveness else "readiness", "reason": self.reason,
                "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail,
                            "ms": round(c.seconds * 1000, 1)} for c in self.checks]}


def redact_url(url: str) -> str:
    """``url`` without its password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _failure(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def check_heartbeat(settings: FleetSettings, component: str, *,
                    max_age_s: float | None = None, now: float | None = None) -> Check:
    """Whether ``component``'s event loop beat within ``max_age_s`` (default: settings)."""
    _check_component(component)
    limit = settings.heartbeat_max_age_s if max_age_s is None else max_age_s
    main = heartbeat_path(settings, component)
    paths = [main] if main.exists() else []
    paths += sorted(main.parent.glob(f"fleet-{component}-*.heartbeat"))  # prefork children
    if not paths:
        return Check("heartbeat", False, f"no heartbeat at {main}: the {component}'s event "
                     "loop has not started (or the process runs elsewhere: same "
                     "FLEET_HEARTBEAT_DIR?)")
    at = time.time() if now is None else now
    oldest: tuple[float, Path, Any] | None = None
    reasons: list[str | None] = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
            beat = float(data["at"])
        except (OSError, ValueError, KeyError, TypeError):
            try:
                beat, data = path.stat().st_mtime, {}
            except OSError:
                continue  # removed meanwhile: a child that stopped
        reasons.append(data.get("stuck") if isinstance(data, dict) else None)
        if oldest is None or beat < oldest[0]:
            oldest = (beat, path, data.get("pid"))
    if oldest is None:
        return Check("heartbeat", False, f"no readable heartbeat at {main}")
    beat, path, pid = oldest
    age = max(0.0, at - beat)
    who = f"pid {pid}, " if pid is not None else ""
    stuck = next((reason for reason in reasons if reason), None)
    if stuck:
        return Check("heartbeat", False, f"the {component} is not live: {stuck} "
                     f"({who}{path.name})")
    if age > limit:
        return Check("heartbeat", False, f"the {component}'s event loop is stuck or gone: its "
                     f"heartbeat is {age:.1f} s old (limit {limit:g} s; {who}{path})")
    if component == "worker" and (idle := consuming_problem(settings, max_age_s=limit)):
        # Alive and beating, but taking no work (issue 25 item 1): not live either.
        return Check("heartbeat", False, idle)
    return Check("heartbeat", True, f"{age:.1f} s old ({who}{path.name})")


def check_broker(url: str | None, timeout_s: float = 2.0) -> Check:
    """A ping of the broker: Redis ``PING``, or an AMQP (any kombu) connection."""
    start = time.monotonic()
    if not url:
        return Check("broker", False, "no broker configured (FLEET_BROKER_URL or "
                     "FLEET_REDIS_URL)")
    scheme = url.split("://", 1)[0].lower()
    try:
        if scheme in _REDIS_SCHEMES:
            # Imported here: the probe loads only the client of the broker it pings.
            from fleet.streams.redis_client import sync_redis

            client = sync_redis.Redis.from_url(url, socket_connect_timeout=timeout_s,
                                               socket_timeout=timeout_s)
            try:
                client.ping()
            finally:
                client.close()
        else:
            # kombu ships partial types; its Connection is used as Any.
            connection: Any = importlib.import_module("kombu").Connection
            with connection(url, connect_timeout=timeout_s) as conn:
                conn.ensure_connection(max_retries=0, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return Check("broker", False, f"{redact_url(url)} unreachable: {_failure(exc)}",
                     time.monotonic() - start)
    took = time.monotonic() - start
    return Check("broker", True, f"{redact_url(url)} answered in {took * 1000:.0f} ms", took)


def _probe_store(settings: FleetSettings, timeout_s: float) -> Any:
    url = settings.database_url
    if url.startswith(("postgresql://", "postgres://")):
        # One connection, no migration: a probe never changes the schema.
        return open_postgres_event_store(url, migrate=False, pool_min=1, pool_max=1,
                                         connect_timeout=timeout_s)
    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).exists():
        # Opening it would create an empty database: a wrong path must fail.
        raise ConfigurationError(f"no SQLite database at {url[len('sqlite:///'):]}")
    return open_event_store(url)


def check_store(settings: FleetSettings, timeout_s: float = 2.0) -> Check:
    """A cheap read of the store (the index row of a probe id)."""
    start = time.monotonic()
    where = redact_url(settings.database_url)

    async def probe() -> None:
        store = _probe_store(settings, timeout_s)
        try:
            await asyncio.wait_for(store.head(PROBE_EXECUTION_ID), timeout_s)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(store.close(), timeout_s)

    try:
        run_loop(probe(), event_loop=settings.event_loop)
    except TimeoutError:
        return Check("store", False, f"{where} did not answer within {timeout_s:g} s",
                     time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return Check("store", False, f"{where} unreachable: {_failure(exc)}",
                     time.monotonic() - start)
    took = time.monotonic() - start
    return Check("store", True, f"{where} answered in {took * 1000:.0f} ms", took)


# --------------------------------------------------------------------------
# The worker's consumer: does it take work? (issue 25 item 1)
# --------------------------------------------------------------------------

#: Written every second by the worker's ``ConsumerWatch`` (``fleet.workers.consuming``).
CONSUMER_STATE = "fleet-worker.consumer"


def consumer_state_path(settings: FleetSettings) -> Path:
    """Where the worker writes what its consumer consumes."""
    return heartbeat_dir(settings) / CONSUMER_STATE


def fleet_queues(settings: FleetSettings) -> list[str]:
    """The queues the fleet routes drives to: ``FLEET_QUEUE`` and the routes' queues."""
    return sorted({settings.queue, *settings.routes.values()})


def consumer_problem(state: dict[str, Any]) -> str | None:
    """Why a worker in ``state`` (the file's content) takes no work, or None."""
    if state.get("connected") is False:
        return None  # reconnecting: the consumer is rebuilt with its queues
    consumed = [q for q in state.get("queues") or [] if isinstance(q, str)]
    wanted = [q for q in state.get("fleet_queues") or [] if isinstance(q, str)]
    if set(consumed) & set(wanted):
        return None
    return (f"the worker consumes no fleet queue (it consumes: {', '.join(consumed) or 'none'};"
            f" the fleet's: {', '.join(wanted)}): it takes no work. Told to stop consuming "
            "(cancel_consumer)? Restart it")


def read_consumer_state(settings: FleetSettings) -> dict[str, Any] | None:
    """The worker's consumer state as written, or None (not written, or unreadable)."""
    try:
        data = json.loads(consumer_state_path(settings).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def consuming_problem(settings: FleetSettings, *, max_age_s: float | None = None) -> str | None:
    """``consumer_problem`` of the state on disk, if it is fresh (None: no state, or fine)."""
    state = read_consumer_state(settings)
    if state is None:
        return None
    limit = settings.heartbeat_max_age_s if max_age_s is None else max_age_s
    try:
        age = time.time() - float(state.get("at", 0))
    except (TypeError, ValueError):
        age = limit + 1
    if age > limit:
        return (f"the worker's consumer stopped reporting its queues {age:.0f} s ago (limit "
                f"{limit:g} s; pid {state.get('pid')})")
    return consumer_problem(state)


def check_keys(settings: FleetSettings) -> Check:
    """The worker's key files (``FLEET_DISPATCH_KEYS_FILE``, ``FLEET_CONTROL_KEYS_FILE``)
    read as key rings: one that cannot be read accepts no key (fail closed, issue 25
    item 4), so the worker is not ready."""
    start = time.monotonic()
    read: list[str] = []
    for path, setting in ((settings.dispatch_keys_file, "FLEET_DISPATCH_KEYS_FILE"),
                          (settings.control_keys_file, "FLEET_CONTROL_KEYS_FILE")):
        if not path:
            continue
        try:
            ring = KeyRing.loads(Path(path).read_text(), where=f"{setting} ({path})")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            return Check("keys", False, f"{setting}: cannot read {path}: {reason}; no key is "
                         "accepted until it is fixed", time.monotonic() - start)
        except ConfigurationError as exc:
            return Check("keys", False, f"{exc.message}; no key is accepted until it is fixed",
                         time.monotonic() - start)
        read.append(f"{setting} {len(ring)} key(s)")
    return Check("keys", True, ", ".join(read) or "no key file", time.monotonic() - start)


def broker_url_for(settings: FleetSettings, component: str) -> str | None:
    """The broker a component needs: the reward attacher and the relay use Redis
    streams, the others enqueue (or take) drives on the Celery broker."""
    if component in ("attacher", "relay"):
        return settings.redis_url
    return settings.broker_url or settings.redis_url


def check_health(settings: FleetSettings, component: str, *, liveness: bool = False,
                 timeout_s: float = 2.0, max_age_s: float | None = None) -> HealthReport:
    """Check ``component`` running on this machine (see the module docstring).

    Args:
        settings: The process's settings (the probe runs with its environment).
        component: ``worker``, ``timers``, ``recovery`` or ``attacher``.
        liveness: Only the heartbeat.
        timeout_s: Bound on each of the broker and store checks.
        max_age_s: The oldest heartbeat that passes (default
            ``settings.heartbeat_max_age_s``).
    """
    _check_component(component)
    checks = [check_heartbeat(settings, component, max_age_s=max_age_s)]
    if not liveness:
        with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="fleet-health") as pool:
            broker = pool.submit(check_broker, broker_url_for(settings, component), timeout_s)
            store = pool.submit(check_store, settings, timeout_s)
            checks += [broker.result(), store.result()]
        if component == "worker":
            checks.append(check_keys(settings))
    return HealthReport(component, liveness, tuple(checks))


__all__ = ["BEAT_INTERVAL_S", "COMPONENTS", "CONSUMER_STATE", "Check", "HealthReport",
           "Heartbeat", "broker_url_for", "check_broker", "check_health", "check_heartbeat",
           "check_keys", "check_store", "consumer_problem", "consumer_state_path",
           "consuming_problem", "fleet_queues", "heartbeat_dir", "heartbeat_path",
           "read_consumer_state", "redact_url"]
