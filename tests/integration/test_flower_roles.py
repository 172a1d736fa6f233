"""Issue 25 items 5 and 11: roles in Flower go past Retry, and reads stop at the tenant.

Real processes: one ``fleet worker`` (with the operators' key ring, so a command
Flower signs is obeyed), and two ``fleet flower``s on it: one open
(``--unauthenticated``, ``FLOWER_UNAUTHENTICATED_API``) and one with basic auth
for four users: ``ops`` (``FLEET_OPERATORS``), ``viewer`` (no role, no tenant),
``acme`` (``FLEET_FLOWER_TENANTS``: acme) and ``auditor`` (every tenant). Redis
and a throwaway Postgres database.

- Every one of Flower's mutating endpoints (shutdown, pool restart/grow/shrink/
  autoscale, add/cancel consumer, revoke, rate and time limits, apply,
  async-apply, send-task, abort) and the Fleet page's Retry: refused (403) on the
  open Flower whatever ``Authorization: Basic`` header is forged, and for every
  authenticated user but the operator; nothing reaches the worker, which keeps
  consuming and driving. The operator's ``cancel-consumer`` (signed by Flower) is
  obeyed, and ``add-consumer`` undoes it: the guard refuses roles, not work.
- Reads: an execution's log is "no such execution" (404, the same answer as for
  an id that does not exist) to a user whose tenants do not include its tenant;
  the Fleet page's parked list shows only the user's tenants' executions;
  Flower's task and worker pages (every task's arguments) need every tenant.
"""

from __future__ import annotations

import http.cookiejar
import json
import secrets
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fleet_page_flows import ALL
from fleet_procs_kit import (
    FLEET,
    ROOT,
    Proc,
    StoreView,
    nodename,
    process_env,
    stop_all,
    until,
    wait_ready,
)
from fleet_worker_kit import free_port
from postgres_server import throwaway_database
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.host.celery_api import broker_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REDIS_DB = 15
OPS_KEY = "operator-key-0123456789abcdef0123"
USERS = "ops:pw1,viewer:pw2,acme:pw3,auditor:pw4"


@dataclass
class Fleet:
    env: dict[str, str]
    store: StoreView
    log_dir: Path
    queue: str
    worker: Proc
    console: Any
    open_url: str = ""
    auth_url: str = ""
    procs: list[Proc] = field(default_factory=list)
    eids: dict[str, str] = field(default_factory=dict)

    @property
    def node(self) -> str:
        assert self.worker.nodename is not None
        return self.worker.nodename

    def cli(self, *args: str) -> str:
        done = subprocess.run([FLEET, *args], env=self.env, cwd=str(ROOT), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout.strip()

    def consumed(self) -> list[str]:
        reply = self.console.control.inspect(destination=[self.node], timeout=2).active_queues()
        assert reply is not None, "the worker did not answer"
        return sorted(q["name"] for q in reply[self.node])

    def drives(self) -> None:
        eid = self.cli("start", "page-gate", "--input", "1")
        self.store.until(eid, "parked", "approval")


def request(url: str, *, user: str | None = None, method: str = "GET",
            data: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
            form: bool = False) -> tuple[int, str]:
    sent = dict(headers or {})
    if user is not None:
        sent["Authorization"] = "Basic " + b64encode(user.encode()).decode()
    body = None
    if method != "GET":
        if form:
            body = urllib.parse.urlencode(data or {}).encode()
            sent["Content-Type"] = "application/x-www-form-urlencoded"
        else:
            body = json.dumps(data or {}).encode()
            sent["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=body, method=method, headers=sent)
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    token = secrets.token_hex(3)
    broker = url_with_db(REDIS_DB)
    log_dir = tmp_path_factory.mktemp("flower-roles")
    queue = f"fleet.roles-{token}"
    with throwaway_database() as database_url:
        env = process_env({
            "FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker,
            "FLEET_REDIS_URL": broker, "FLEET_QUEUE": queue, "FLEET_FLOWS": ALL,
            "FLEET_DIVERGENCE": "fail", "FLEET_STATS_PREFIX": f"fleet-test:{token}:stats:",
            "FLEET_CONTROL_KEYS": json.dumps({"ops-1": OPS_KEY}),
            "FLEET_OPERATOR": "operator:oncall", "FLEET_OPERATORS": "ops",
            "FLEET_FLOWER_TENANTS": json.dumps({"acme": ["acme"], "auditor": ["*"]}),
            "FLEET_HEARTBEAT_DIR": str(log_dir / "heartbeats")})
        store = StoreView(FleetSettings(database_url=database_url), "roles-store")
        console = broker_app("roles-console", broker)
        procs: list[Proc] = []
        try:
            upgraded = subprocess.run([FLEET, "db", "upgrade"], env=env, cwd=str(ROOT),
                                      capture_output=True, text=True, timeout=60)
            assert upgraded.returncode == 0, upgraded.stderr
            node = nodename("w", token)
            worker = Proc("worker", ["worker", "--concurrency", "4", "-n", node,
                                     "--without-gossip"], env, log_dir, node)
            procs.append(worker)
            built = Fleet(env, store, log_dir, queue, worker, console, procs=procs)
            flowers = []
            for name, extra in (("open", {"FLOWER_UNAUTHENTICATED_API": "true"}),
                                ("auth", {"FLOWER_BASIC_AUTH": USERS})):
                port = free_port()
                args = ["flower", "--port", str(port), "--address", "127.0.0.1",
                        "--inspect_timeout=1000"]
                proc = Proc(f"flower-{name}", args + (["--unauthenticated"] if name == "open"
                                                      else []), {**env, **extra}, log_dir)
                procs.append(proc)
                flowers.append((proc, f"http://127.0.0.1:{port}"))
            wait_ready(worker, console)
            for proc, base in flowers:
                headers = {"Authorization": "Basic " + b64encode(b"ops:pw1").decode()}
                wait_ready(proc, healthcheck=f"{base}/healthcheck", headers=headers)
            built.open_url, built.auth_url = flowers[0][1], flowers[1][1]
            for tenant in ("acme", "globex"):
                eid = built.cli("start", "page-gate", "--input", "1", "--actor", f"{tenant}-u",
                                "--tenant", tenant)
                store.until(eid, "parked", "approval")
                built.eids[tenant] = eid
                marker = log_dir / f"shape-{tenant}"
                shaped = built.cli("start", "page-shape", "--input", json.dumps(str(marker)),
                                   "--actor", f"{tenant}-u", "--tenant", tenant)
                store.until(shaped, "parked", "go")
                marker.write_text("the code changed shape\n")
                built.cli("resume", shaped, "go", "--payload", '"yes"', "--actor",
                          f"{tenant}-u", "--tenant", tenant)
                store.until(shaped, "parked", "__fleet_diverged__")
                built.eids[f"{tenant}-diverged"] = shaped
            yield built
        finally:
            stop_all(procs)
            console.close()
            store.close()


def mutations(fleet: Fleet) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every endpoint of Flower's that changes something: path and body."""
    node = fleet.node
    return {
        "shutdown": (f"/api/worker/shutdown/{node}", {}),
        "pool restart": (f"/api/worker/pool/restart/{node}", {}),
        "pool grow": (f"/api/worker/pool/grow/{node}?n=1", {}),
        "pool shrink": (f"/api/worker/pool/shrink/{node}?n=1", {}),
        "autoscale": (f"/api/worker/pool/autoscale/{node}?min=1&max=2", {}),
        "add consumer": (f"/api/worker/queue/add-consumer/{node}?queue=fleet.x", {}),
        "cancel consumer": (f"/api/worker/queue/cancel-consumer/{node}?queue={fleet.queue}",
                            {}),
        "revoke": ("/api/task/revoke/some-task?terminate=true", {}),
        "rate limit": (f"/api/task/rate-limit/fleet.drive?workername={node}&ratelimit=1/h",
                       {}),
        "time limit": (f"/api/task/timeout/fleet.drive?workername={node}&hard=1", {}),
        "apply": ("/api/task/apply/fleet.drive", {"args": ["x"]}),
        "async-apply": ("/api/task/async-apply/fleet.drive", {"args": ["x"]}),
        "send-task": ("/api/task/send-task/fleet.drive", {"args": ["x"]}),
        "abort": ("/api/task/abort/some-task", {}),
    }


def _still_working(fleet: Fleet) -> None:
    assert fleet.worker.alive()
    assert fleet.queue in fleet.consumed()
    fleet.drives()
    assert "refused by fleet" not in fleet.worker.log()  # nothing even reached it


def test_an_open_flower_is_read_only_whatever_authorization_header_is_forged(
        fleet: Fleet) -> None:
    forged = {"Authorization": "Basic " + b64encode(b"ops:anything").decode()}
    for name, (path, body) in mutations(fleet).items():
        for headers in (forged, {}):
            status, text = request(fleet.open_url + path, method="POST", data=body,
                                   headers=headers)
            assert status == 403, (name, status, text[:300])
            assert "operator role" in text, (name, text[:300])
            assert "authenticates nobody" in text
    # The Fleet page's Retry, with its XSRF token: the forged header names nobody either.
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with opener.open(fleet.open_url + "/fleet", timeout=60) as page:
        assert page.status == 200
    token = next(c.value for c in jar if c.name == "_xsrf")
    eid = fleet.eids["acme-diverged"]
    retry = urllib.request.Request(
        f"{fleet.open_url}/fleet/api/diverged/{eid}/retry",
        data=urllib.parse.urlencode({"_xsrf": token}).encode(), method="POST",
        headers=forged)
    with pytest.raises(urllib.error.HTTPError) as refused:
        opener.open(retry, timeout=60)
    assert refused.value.code == 403
    assert json.loads(refused.value.read())["error"] == "operator_role_required"
    assert fleet.store.status(eid) == "parked"
    # Reading is open: every tenant's log, Flower's own pages.
    for tenant in ("acme", "globex"):
        assert request(f"{fleet.open_url}/fleet/execution/{fleet.eids[tenant]}")[0] == 200
    assert request(f"{fleet.open_url}/api/workers")[0] == 200
    _still_working(fleet)


def test_with_authentication_only_the_operator_changes_anything(fleet: Fleet) -> None:
    for user in ("viewer:pw2", "acme:pw3", "auditor:pw4"):
        for name, (path, body) in mutations(fleet).items():
            status, text = request(fleet.auth_url + path, user=user, method="POST", data=body)
            assert status == 403, (user, name, status, text[:300])
            assert "needs the operator role" in text
    assert request(fleet.auth_url + mutations(fleet)["shutdown"][0], user="ops:wrong",
                   method="POST")[0] == 401  # Flower's own check comes first
    _still_working(fleet)
    # The operator: Flower signs the command with the operators' key; the worker obeys.
    # (Flower acts only on workers its inspector has seen: a refresh first.)
    until(lambda: fleet.node in json.loads(request(f"{fleet.auth_url}/api/workers?refresh=1",
                                                   user="ops:pw1")[1]),
          "Flower to know the worker", 15)
    cancel = mutations(fleet)["cancel consumer"][0]
    status, text = request(fleet.auth_url + cancel, user="ops:pw1", method="POST")
    assert status == 200, text
    until(lambda: fleet.queue not in fleet.consumed(), "the operator's cancel to be obeyed", 10)
    status, text = request(f"{fleet.auth_url}/api/worker/queue/add-consumer/{fleet.node}"
                           f"?queue={fleet.queue}", user="ops:pw1", method="POST")
    assert status == 200, text
    until(lambda: fleet.queue in fleet.consumed(), "the queue to be consumed again", 10)
    fleet.drives()


def test_a_flower_user_reads_only_its_tenants_executions(fleet: Fleet) -> None:
    nothing = f"no-such-{secrets.token_hex(3)}"
    missing = request(f"{fleet.auth_url}/fleet/execution/{nothing}", user="acme:pw3")
    assert missing[0] == 404
    assert nothing in missing[1]
    for user, sees in (("acme:pw3", {"acme"}), ("viewer:pw2", set()),
                       ("auditor:pw4", {"acme", "globex"}), ("ops:pw1", {"acme", "globex"})):
        for tenant in ("acme", "globex"):
            eid = fleet.eids[tenant]
            status, text = request(f"{fleet.auth_url}/fleet/execution/{eid}", user=user)
            if tenant in sees:
                assert status == 200, (user, tenant, status)
                assert "EXECUTION_STARTED" in text
            else:  # the same answer as for an execution that does not exist: no oracle
                assert status == 404, (user, tenant, status)
                assert text.replace(eid, "X") == missing[1].replace(nothing, "X"), (
                    user, tenant)
        status, body = request(f"{fleet.auth_url}/fleet/api/status", user=user)
        assert status == 200
        data = json.loads(body)
        listed = {p["executionId"] for p in data["parked"]}
        diverged = {fleet.eids[f"{t}-diverged"] for t in sees}
        assert listed & {fleet.eids["acme-diverged"], fleet.eids["globex-diverged"]} == \
            diverged, (user, listed)
        page = request(f"{fleet.auth_url}/fleet", user=user)[1]
        other = {"acme", "globex"} - sees
        for tenant in other:
            assert fleet.eids[f"{tenant}-diverged"] not in page, (user, tenant)
        if sees != {"acme", "globex"}:
            assert all(not p["parks"] for p in data["processes"])  # no ids of other tenants
        every = sees == {"acme", "globex"}
        for path in ("/tasks", "/api/tasks", "/api/workers", f"/worker/{fleet.node}",
                     "/api/task/info/x"):
            status, _ = request(fleet.auth_url + path, user=user)
            if every:
                assert status in (200, 404), (user, path, status)
            else:
                assert status == 403, (user, path, status)
        for path in ("/", "/broker", "/fleet", "/api/queues/length"):
            assert request(fleet.auth_url + path, user=user)[0] == 200, (user, path)
    # The probe reads without credentials, as Flower has it; /metrics asks for Flower's
    # login like every page (issue 28 item 7): every user may read it, nobody without one.
    assert request(fleet.auth_url + "/healthcheck")[0] == 200
    assert request(fleet.auth_url + "/metrics")[0] == 401
    for user in USERS.split(","):  # "name:password", what request() sends as basic auth
        assert request(fleet.auth_url + "/metrics", user=user)[0] == 200, user
