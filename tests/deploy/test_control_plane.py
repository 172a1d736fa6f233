"""Issue 25 item 1: nobody but an operator stops the fleet through Celery's remote control.

One real ``fleet worker`` process on a private Redis loaded with the rendered
``deploy/redis/users.acl``, as the ``worker`` user, with the operators' key ring
(``FLEET_CONTROL_KEYS``); a throwaway Postgres database. Against it, as an
attacker would with the credentials each role really gets:

- every Redis user but the operator console's (``flower``) is refused the
  broadcast itself (``cancel_consumer``, ``shutdown``; Celery's own client and a
  raw ``PUBLISH``): the dispatchers' ``client`` user and the ``worker`` user (flow
  code in any worker pod) included; ACL LOG records each;
- with the console's Redis password but no operator key (an unsigned command, a
  key the worker does not hold, a tenant's key, a tampered or expired signature)
  the worker refuses and says so in its answer and its log, and keeps consuming;
- an operator's signed ``cancel_consumer`` is obeyed, and then the worker, which
  consumes no fleet queue, fails ``fleet health`` (liveness too) and its report
  to Redis carries the problem (the Fleet page shows it red); a signed
  ``add_consumer`` makes it healthy again; a signed ``shutdown`` ends it.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import acl_flows
import pytest
import redis
from fleet_procs_kit import FLEET, Proc, StoreView, nodename, process_env, until, wait_ready
from k8s_kit import ROOT
from kombu.exceptions import OperationalError
from postgres_server import throwaway_database
from redis_acl_kit import USERS, PrivateRedis

from fleet.config import FleetSettings
from fleet.host.celery_api import broker_app
from fleet.host.control import ControlAuth
from fleet.host.keys import KeySource
from fleet.services.alarms import fleet_alarms
from fleet.services.counters import read_fleet

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

QUEUE = "fleet.drive"
OPS_KEY = "operator-key-0123456789abcdef0123"
RING = {"ops-1": OPS_KEY,
        "acme-1": {"client": "acme", "secret": "acme-key-0123456789abcdef", "tenants": ["acme"]}}
NOPERM = r"(?i)no permissions|noperm"


@dataclass
class Plane:
    redis: PrivateRedis
    env: dict[str, str]
    worker: Proc
    store: StoreView
    log_dir: Path

    @property
    def node(self) -> str:
        assert self.worker.nodename is not None
        return self.worker.nodename

    def app(self, user: str, auth: ControlAuth | None = None) -> Any:
        return broker_app(f"control-{user}", self.redis.url(user), control_auth=auth,
                          broker_connection_retry=False)

    def fleet(self, *args: str, user: str = "client") -> subprocess.CompletedProcess[str]:
        env = {**self.env, "FLEET_REDIS_URL": self.redis.url(user)}
        return subprocess.run([FLEET, *args], env=env, cwd=str(ROOT), capture_output=True,
                              text=True, timeout=60)

    def health(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([FLEET, "health", "--component", "worker", *args],
                              env=self.worker.env, cwd=str(ROOT), capture_output=True,
                              text=True, timeout=60)

    def consumed(self, console: Any) -> list[str]:
        reply = console.control.inspect(destination=[self.node], timeout=2).active_queues()
        assert reply is not None, "the worker did not answer"
        return sorted(q["name"] for q in reply[self.node])

    def drive_completes(self) -> None:
        started = self.fleet("start", "acl-steps", "--input", "1")
        assert started.returncode == 0, started.stderr
        self.store.until(started.stdout.strip(), "completed", timeout=30)


def operator(**options: Any) -> ControlAuth:
    return ControlAuth(KeySource({"ops-1": OPS_KEY}), **options)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    log_dir = tmp_path_factory.mktemp("control-plane")
    server = PrivateRedis("redis", log_dir / "redis")
    try:
        with throwaway_database() as database_url:
            env = process_env({
                "FLEET_DATABASE_URL": database_url, "FLEET_QUEUE": QUEUE,
                "FLEET_FLOWS": acl_flows.ALL, "FLEET_CONTROL_KEYS": json.dumps(RING),
                "FLEET_HEARTBEAT_DIR": str(log_dir / "heartbeats"),
                "FLEET_STATS_INTERVAL_S": "0.5"})
            done = subprocess.run([FLEET, "db", "upgrade"], cwd=str(ROOT), timeout=60,
                                  env={**env, "FLEET_REDIS_URL": server.url("client")},
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            node = nodename("w", "control")
            worker = Proc("worker", ["worker", "--concurrency", "2", "-n", node],
                          {**env, "FLEET_REDIS_URL": server.url("worker")}, log_dir, node)
            store = StoreView(FleetSettings(database_url=database_url), "control-store")
            console = broker_app("console", server.url("flower"))
            try:
                wait_ready(worker, console)
                yield Plane(server, env, worker, store, log_dir)
            finally:
                console.close()
                worker.stop()
                store.close()
    finally:
        server.stop()


def test_no_redis_user_but_the_consoles_may_broadcast_a_control_command(plane: Plane) -> None:
    """The dispatchers' user and the worker's own (flow code in any worker pod) are
    refused at the PUBLISH, through Celery and raw; so is everyone else; nothing
    reaches the worker, which still drives."""
    plane.redis.reset_denials()
    for user in ("client", "worker"):
        app = plane.app(user, operator())  # even holding an operator key
        try:
            for command, arguments in (("cancel_consumer", {"queue": QUEUE}),
                                       ("shutdown", {})):
                with pytest.raises((redis.exceptions.NoPermissionError, OperationalError),
                                   match=NOPERM):
                    app.control.broadcast(command, arguments=arguments, reply=False)
        finally:
            app.close()
    forged = json.dumps({"body": "", "headers": {}, "properties": {}})
    for user in (u for u in USERS if u not in ("admin", "flower")):
        client = plane.redis.client(user)
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.publish("/0.celery.pidbox", forged)
        finally:
            client.close()
    refused = {e["username"] for e in plane.redis.denials() if e["object"] in (
        "publish", "/0.celery.pidbox")}
    assert refused >= {u for u in USERS if u not in ("admin", "flower", "default")}
    assert plane.worker.alive()
    plane.drive_completes()
    assert plane.health().returncode == 0


class _Tampered(ControlAuth):
    """Signs a command for another queue, then names fleet.drive (what a forger who
    captured a signed command would try)."""

    def sign(self, message: Any, *, now_ms: int | None = None) -> dict[str, Any]:
        signed = super().sign({**message, "arguments": {"queue": "fleet.elsewhere"}},
                              now_ms=now_ms)
        signed["arguments"] = dict(message["arguments"])
        return signed


class _Stale(ControlAuth):
    def sign(self, message: Any, *, now_ms: int | None = None) -> dict[str, Any]:
        return super().sign(message, now_ms=time.time_ns() // 1_000_000 - 600_000)


def test_the_worker_obeys_no_command_that_an_operator_key_did_not_sign(plane: Plane) -> None:
    """The console's Redis password alone (leaked, or a Flower user without the role
    whose request went out unsigned) changes nothing: every variant is answered
    "refused by fleet", logged, and the worker keeps consuming."""
    attempts = {
        "unsigned": None,
        "unknown key": ControlAuth(KeySource({"ops-9": "some-other-key-0123456789abcdef"})),
        "a tenant's key": ControlAuth(KeySource({"acme-1": RING["acme-1"]})),
        "tampered": _Tampered(KeySource({"ops-1": OPS_KEY})),
        "expired": _Stale(KeySource({"ops-1": OPS_KEY})),
    }
    expected = {"unsigned": "unsigned", "unknown key": "unknown key 'ops-9'",
                "a tenant's key": "a tenant's, not an operator's",
                "tampered": "bad signature", "expired": "expired"}
    plane.redis.reset_denials()
    for name, auth in attempts.items():
        app = plane.app("flower", auth)
        try:
            for command, arguments in (("cancel_consumer", {"queue": QUEUE}),
                                       ("shutdown", {}), ("pool_restart", {})):
                replies = app.control.broadcast(command, arguments=arguments,
                                                destination=[plane.node], reply=True,
                                                timeout=3)
                assert replies == [{plane.node: {"error": replies[0][plane.node]["error"]}}]
                error = replies[0][plane.node]["error"]
                assert error.startswith("refused by fleet: "), (name, error)
                assert expected[name] in error, (name, error)
        finally:
            app.close()
    assert plane.redis.denials() == []  # Redis let the console publish: the worker refused
    console = plane.app("flower")
    try:
        assert QUEUE in plane.consumed(console)
    finally:
        console.close()
    assert plane.worker.alive()
    assert "control command 'cancel_consumer' refused: unsigned" in plane.worker.log()
    # Counted and reported (the Fleet page's control_refused alarm), across processes.
    until(lambda: _alarms(_report(plane)).get("control_refused", 0) >= 15,
          "the refusals in the worker's report", 15)
    plane.drive_completes()
    assert plane.health("--liveness").returncode == 0


def _alarms(fleet: Any) -> dict[str, float]:
    """The Fleet page's alarms now, by kind (decision 0047)."""
    return {a.kind: a.value for a in fleet_alarms(fleet, parked=None, now=time.time(),
                                                   window_s=900)}


def _report(plane: Plane) -> Any:
    client = plane.redis.client("flower")
    try:
        return read_fleet(client, stale_s=10)
    finally:
        client.close()


def test_an_operators_signed_cancel_is_obeyed_and_the_idle_worker_is_unhealthy(
        plane: Plane) -> None:
    """The positive control: an operator's key does stop consumption, and a worker that
    consumes no fleet queue is then unhealthy everywhere an operator looks: its probe
    (liveness included, so it is restarted), its report, the Fleet page's alarm."""
    ops = plane.app("flower", operator())
    try:
        replies = ops.control.broadcast("cancel_consumer", arguments={"queue": QUEUE},
                                        destination=[plane.node], reply=True, timeout=3)
        assert replies == [{plane.node: {"ok": f"no longer consuming from {QUEUE}"}}]
        assert QUEUE not in plane.consumed(ops)

        def red() -> subprocess.CompletedProcess[str] | None:
            done = plane.health("--liveness")
            return done if done.returncode == 1 else None
        done = until(red, "the worker's probe to fail", 15)
        assert "consumes no fleet queue" in done.stderr, done.stderr

        def reported() -> Any:
            fleet = _report(plane)
            mine = [p for p in fleet.processes if p.name.startswith(plane.node)]
            return fleet if mine and mine[0].problems else None
        fleet = until(reported, "the worker's report to carry the problem", 15)
        assert _alarms(fleet).get("unhealthy") == 1
        (worker,) = [p for p in fleet.processes if p.name.startswith(plane.node)]
        assert "consumes no fleet queue" in worker.problems[0]

        replies = ops.control.broadcast("add_consumer", arguments={"queue": QUEUE},
                                        destination=[plane.node], reply=True, timeout=3)
        assert replies == [{plane.node: {"ok": f"add consumer {QUEUE}"}}]
        until(lambda: plane.health("--liveness").returncode == 0, "the worker to be healthy",
              15)
        plane.drive_completes()
        until(lambda: not [p for p in _report(plane).processes
                           if p.name.startswith(plane.node) and p.problems],
              "the report to clear", 15)
        # Last: a signed shutdown ends the worker (this module's fixture is done with it).
        ops.control.broadcast("shutdown", destination=[plane.node], reply=False)
        plane.worker.wait_exit(30)
        assert plane.worker.proc.returncode == 0
    finally:
        ops.close()
