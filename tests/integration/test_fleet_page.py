"""What an operator sees, true across processes (issue 14): every fleet process's
counters in Redis, ``fleet status``, the Fleet page inside a real Flower, its JSON
API, Retry of diverged executions, ``fleet diverged``, and ``/metrics``.

Real processes throughout: two ``fleet worker`` subprocesses, ``fleet timers``,
``recovery``, ``attacher`` and ``relay``, ``fleet flower`` (unauthenticated, then
one with basic auth for the operator-role tests), on Redis and a throwaway
Postgres database. Keys, streams and queues carry a random token; the stats
prefix too (FLEET_STATS_PREFIX), so other fleets on the same Redis are not read.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from base64 import b64encode
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from chromium_kit import chromium, png_pixels
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
from prometheus_client.parser import text_string_to_metric_families
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.services.counters import WORKER_COUNTERS, CountersReader

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REDIS_DB = 13
PRODUCER, SECRET = "p1", "test-secret"
OPERATOR = "operator:oncall"


@dataclass
class Fleet:
    env: dict[str, str]
    settings: FleetSettings
    store: StoreView
    log_dir: Path
    token: str
    procs: dict[str, Proc] = field(default_factory=dict)
    flower_url: str = ""
    metrics_port: int = 0  # the timers service's own /metrics
    flower_metrics_port: int = 0  # the fleet's one scrape target (decision 0046)

    def env_for(self, name: str, **extra: str) -> dict[str, str]:
        env = dict(self.env)
        env["FLEET_HEARTBEAT_DIR"] = str(self.log_dir / "heartbeats" / name)
        env.update(extra)
        return env

    def start_worker(self, name: str) -> Proc:
        node = nodename(name, self.token)
        proc = Proc(name, ["worker", "--concurrency", "4", "-n", node, "-E",
                           "--without-mingle", "--without-gossip"],
                    self.env_for(name), self.log_dir, node)
        self.procs[name] = proc
        return proc

    def start_service(self, component: str, name: str | None = None, **env: str) -> Proc:
        name = name or component
        proc = Proc(name, [component], self.env_for(name, **env), self.log_dir)
        self.procs[name] = proc
        return proc

    def start_flower(self, name: str, *args: str, **env: str) -> str:
        port = free_port()
        proc = Proc(name, ["flower", "--port", str(port), "--address", "127.0.0.1",
                           "--inspect_timeout=1000", *args], self.env_for(name, **env),
                    self.log_dir)
        self.procs[name] = proc
        base = f"http://127.0.0.1:{port}"
        headers = {}
        if "FLOWER_BASIC_AUTH" in env:
            user = env["FLOWER_BASIC_AUTH"].split(",")[0]
            headers["Authorization"] = "Basic " + b64encode(user.encode()).decode()
        wait_ready(proc, healthcheck=f"{base}/healthcheck", headers=headers)
        return base

    def cli(self, *args: str, check: bool = True, **env: str
            ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([FLEET, *args], env=self.env_for("cli", **env), cwd=str(ROOT),
                              capture_output=True, text=True, timeout=90)
        if check:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    def counters(self) -> Any:
        reader = CountersReader(self.settings)
        try:
            return reader.read()
        finally:
            reader.close()

    def total(self, name: str) -> float:
        return float(self.counters().totals.get(name, 0))

    def settled(self, name: str) -> float:
        """``total(name)`` once two reads a few report intervals apart agree (what an
        earlier test set moving has been reported)."""
        last = self.total(name)
        while True:
            time.sleep(1.5)  # three FLEET_STATS_INTERVAL_S
            now = self.total(name)
            if now == last:
                return now
            last = now


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    token = secrets.token_hex(3)
    broker = url_with_db(REDIS_DB)
    log_dir = tmp_path_factory.mktemp("fleet-page")
    with throwaway_database() as database_url:
        settings_env = {
            "FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker,
            "FLEET_REDIS_URL": broker, "FLEET_QUEUE": f"fleet.page-{token}",
            "FLEET_FLOWS": ALL, "FLEET_DIVERGENCE": "fail",
            "FLEET_LEASE_MS": "5000", "FLEET_RECOVERY_GRACE_MS": "3000",
            "FLEET_RECOVERY_INTERVAL_S": "0.5", "FLEET_TIMER_INTERVAL_S": "0.2",
            "FLEET_WORKER_DRAIN_S": "2",
            "FLEET_STATS_PREFIX": f"fleet-test:{token}:stats:", "FLEET_STATS_INTERVAL_S": "0.5",
            "FLEET_METRICS_REFRESH_S": "0.5",
            "FLEET_STATS_STALE_S": "3",
            "FLEET_OPERATOR": OPERATOR, "FLEET_OPERATORS": "ops",
            "FLEET_REWARD_KEYS": json.dumps({PRODUCER: SECRET}),
            "FLEET_REWARDS_STREAM": f"fleet-test:{token}:rewards",
            "FLEET_REWARDS_DEAD": f"fleet-test:{token}:rewards:dead",
            "FLEET_REWARDS_GROUP": f"fleet-test-{token}",
            "FLEET_EVENTS_STREAM": f"fleet-test:{token}:events"}
        env = process_env(settings_env)
        settings = FleetSettings(**{k[len("FLEET_"):].lower(): v  # type: ignore[arg-type]
                                    for k, v in settings_env.items()
                                    if k not in ("FLEET_REWARD_KEYS",)})
        store = StoreView(settings)
        built = Fleet(env, settings, store, log_dir, token)
        try:
            built.cli("db", "upgrade")
            built.metrics_port = free_port()
            starting = [built.start_worker("a"), built.start_worker("b"),
                        built.start_service("timers",
                                            FLEET_METRICS_PORT=str(built.metrics_port)),
                        *(built.start_service(c) for c in ("recovery", "attacher", "relay"))]

            def reported() -> bool:
                for proc in starting:
                    if not proc.alive():
                        raise AssertionError(f"{proc.name} exited:\n{proc.log()[-4000:]}")
                roles = [p.role for p in built.counters().processes if not p.stale]
                return roles.count("worker") >= 2 and all(
                    r in roles for r in ("timers", "recovery", "attacher", "relay"))
            until(reported, "every process to report", 90)
            built.flower_metrics_port = free_port()
            built.flower_url = built.start_flower(
                "flower", "--unauthenticated",
                FLEET_METRICS_PORT=str(built.flower_metrics_port))
            yield built
        finally:
            stop_all(built.procs.values())
            store.close()


# -- the counters in Redis, fleet status ------------------------------------------------

def test_every_process_reports_its_counters_and_heartbeat(fleet: Fleet) -> None:
    counters = fleet.counters()
    by_role = {p.role: p for p in counters.processes if not p.stale}
    assert set(by_role) == {"worker", "timers", "recovery", "attacher", "relay"}
    workers = sorted(p.name for p in counters.of("worker"))
    assert workers == sorted(fleet.procs[n].nodename or "" for n in ("a", "b"))
    ours = {proc.proc.pid for name, proc in fleet.procs.items() if name in (
        "a", "b", "timers", "recovery", "attacher", "relay")}
    for process in counters.processes:
        if process.pid not in ours:
            continue  # test_a_stopped_service_turns_stale's, if it ran first
        assert not process.stale, process
        assert process.age_s < 3, process
        assert process.pid
        assert process.host
    assert {"drives", "divergence_parked", "fenced_out"} <= set(by_role["worker"].counters)
    assert {"timers_fired", "fired", "enqueued"} <= set(by_role["timers"].counters)
    assert {"outcomes_attached", "outcomes_dead_lettered"} <= set(
        by_role["attacher"].counters)
    assert {"published", "lag_ms"} <= set(by_role["relay"].counters)


def test_a_reward_attached_and_a_timer_fired_read_true_in_fleet_status(fleet: Fleet) -> None:
    attached, fired = fleet.total("outcomes_attached"), fleet.total("timers_fired")
    eid = fleet.cli("start", "page-decide", "--input", "7").stdout.strip()
    fleet.store.until(eid, "completed")
    fleet.cli("reward", "submit", "--execution", eid, "--decision", "size",
              "--producer", PRODUCER, "--key", "csat:1", "--score", "0.9",
              FLEET_REWARD_KEYS=json.dumps({PRODUCER: SECRET}))
    until(lambda: fleet.total("outcomes_attached") == attached + 1, "outcomes_attached")
    timed = fleet.cli("start", "page-timer", "--input", "2.5").stdout.strip()
    fleet.store.until(timed, "completed", timeout=30)
    until(lambda: fleet.total("timers_fired") >= fired + 1, "timers_fired")
    status = json.loads(fleet.cli("status", "--json", check=False).stdout)
    services = {s["role"]: s for s in status["services"]}
    assert services["attacher"]["counters"]["outcomes_attached"] == attached + 1
    assert services["timers"]["counters"]["timers_fired"] >= fired + 1
    assert status["totals"]["outcomes_attached"] == attached + 1
    table = fleet.cli("status", check=False, COLUMNS="80").stdout
    assert "divergence_warnings=" in table  # 80 columns: each worker in two lines
    assert "divergence_parked=" in table
    assert "outcomes_attached=" in table
    assert max(len(line) for line in table.splitlines()) <= 80


# -- the Fleet page in Flower -------------------------------------------------------------

class Browser:
    """An HTTP client with a cookie jar (the xsrf cookie), optionally basic auth."""

    def __init__(self, base: str, user: str | None = None) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar),
                                                  _NoRedirect())
        self.headers = {}
        if user:
            self.headers["Authorization"] = "Basic " + b64encode(user.encode()).decode()

    def get(self, path: str) -> tuple[int, str]:
        request = urllib.request.Request(self.base + path, headers=self.headers)
        try:
            with self.opener.open(request, timeout=60) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def json(self, path: str) -> Any:
        status, body = self.get(path)
        assert status == 200, (status, body[:2000])
        return json.loads(body)

    def xsrf(self) -> str:
        return next(c.value for c in self.jar if c.name == "_xsrf")

    def post(self, path: str, form: dict[str, str] | None = None) -> tuple[int, str, str]:
        data = urllib.parse.urlencode(form or {}).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=self.headers,
                                         method="POST")
        try:
            with self.opener.open(request, timeout=90) as reply:
                return reply.status, reply.read().decode(), reply.headers.get("Location", "")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace"), exc.headers.get(
                "Location", "")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def status_when(browser: Browser, check: Callable[[dict[str, Any]], bool], what: str
                ) -> dict[str, Any]:
    def read() -> dict[str, Any] | None:
        data: dict[str, Any] = browser.json("/fleet/api/status")
        return data if check(data) else None
    return until(read, what)


def cell(html: str, row_attr: str, counter: str) -> str:
    """The text of the ``data-counter`` cell in the row with ``row_attr``."""
    row = html[html.index(row_attr):]
    row = row[:row.index("</tr>")]
    match = re.search(rf'data-counter="{counter}"[^>]*>([^<]*)<', row)
    assert match, (row_attr, counter, row[:3000])
    return match.group(1).strip().replace(",", "")


def total_card(html: str, counter: str) -> float:
    """The number on the page's totals card of ``counter``."""
    match = re.search(rf'data-counter="{counter}">\s*<p class="metric-label">{counter}</p>'
                      rf'\s*<p class="metric-value[^"]*">([^<]*)<', html)
    assert match, (counter, html[:3000])
    return float(match.group(1).strip().replace(",", ""))


def service_counter(html: str, role: str, counter: str) -> float:
    text = cell(html, f'data-service="{role}"', counter)
    return float(text.split()[-1])


def test_the_fleet_page_is_one_click_from_flowers_first_page(fleet: Fleet) -> None:
    browser = Browser(fleet.flower_url)
    status, first = browser.get("/")
    assert status == 200
    link = re.search(r'id="fleet-nav"\s+href="([^"]+)"', first)
    assert link, first[:3000]
    assert link.group(1) == "/fleet"
    status, page = browser.get(link.group(1))
    assert status == 200
    assert "css/bootstrap.min.css" in page  # Flower's look: its own base template
    assert 'aria-current="page">Fleet</a>' in page
    for table in ("fleet-workers", "fleet-services", "fleet-streams", "fleet-parked"):
        assert f'id="{table}"' in page
    for worker in ("a", "b"):
        assert f'data-worker="{fleet.procs[worker].nodename}"' in page
    for role in ("timers", "recovery", "attacher", "relay"):
        assert f'data-service="{role}"' in page
    # A column per counter, not a dict in a cell.
    assert page.count('data-counter="divergence_parked"') >= 3
    api = browser.json("/fleet/api/status")
    assert {p["role"] for p in api["processes"]} == {"worker", "timers", "recovery",
                                                     "attacher", "relay"}
    assert {s["stream"] for s in api["streams"]} == {fleet.env["FLEET_EVENTS_STREAM"],
                                                     fleet.env["FLEET_REWARDS_STREAM"]}


def test_page_and_api_show_a_reward_attached_and_a_timer_fired(fleet: Fleet) -> None:
    browser = Browser(fleet.flower_url)
    before = browser.json("/fleet/api/status")["totals"]
    _, page = browser.get("/fleet")
    attached = service_counter(page, "attacher", "outcomes_attached")
    assert attached == before["outcomes_attached"]
    eid = fleet.cli("start", "page-decide", "--input", "8").stdout.strip()
    fleet.store.until(eid, "completed")
    fleet.cli("reward", "submit", "--execution", eid, "--decision", "size",
              "--producer", PRODUCER, "--key", "csat:2", "--score", "0.5",
              FLEET_REWARD_KEYS=json.dumps({PRODUCER: SECRET}))
    timed = fleet.cli("start", "page-timer", "--input", "2.5").stdout.strip()
    fleet.store.until(timed, "completed", timeout=30)
    def moved() -> dict[str, float] | None:
        totals: dict[str, float] = browser.json("/fleet/api/status")["totals"]
        if (totals["outcomes_attached"] == before["outcomes_attached"] + 1
                and totals["timers_fired"] > before["timers_fired"]):
            return totals
        return None
    after = until(moved, "the API to show the reward and the timer")
    assert after["drives"] > before["drives"]
    _, page = browser.get("/fleet")
    assert service_counter(page, "attacher", "outcomes_attached") == attached + 1
    assert service_counter(page, "timers", "timers_fired") == after["timers_fired"]


def test_page_and_api_show_a_schedule_its_next_tick_last_run_and_skipped_ticks(
        fleet: Fleet) -> None:
    # Every second, skip: its first run waits on a gate (still running), so the ticks that
    # fall meanwhile are skipped, and the page counts them as they fall (decision 0058).
    fleet.cli("schedule", "create", "page-every", "page-gate", "--every", "1s",
              "--input", "4")
    browser = Browser(fleet.flower_url)

    def shown() -> dict[str, Any] | None:
        for s in browser.json("/fleet/api/status")["schedules"]:
            if s["scheduleId"] == "page-every" and s["runs"] == 1 and s["skipped"] >= 2:
                return dict(s)
        return None
    api = until(shown, "the API to show the schedule's run and skipped ticks")
    assert api["lastRun"].startswith("page-every@")
    assert api["lastRunStatus"] == "parked"
    assert (api["flow"], api["overlap"], api["every"]) == ("page-gate", "skip", 1.0)
    assert api["nextTick"] is not None
    _, page = browser.get("/fleet")
    assert 'id="fleet-schedules"' in page
    assert f'data-last-run="{api["lastRun"]}"' in page
    assert cell(page, 'data-schedule="page-every"', "runs") == "1"
    assert int(cell(page, 'data-schedule="page-every"', "skipped")) >= api["skipped"]
    fleet.cli("schedule", "delete", "page-every")
    fleet.cli("resume", api["lastRun"], "approval", "--payload", '"ok"')
    assert all(s["scheduleId"] != "page-every"
               for s in browser.json("/fleet/api/status")["schedules"])


# -- diverged executions: the list, Retry, the operator role -----------------------------

def diverge(fleet: Fleet, tmp_path: Path) -> tuple[str, Path]:
    """Start page-shape, then change its shape (the marker) and resume it: it diverges."""
    marker = tmp_path / f"shape-{secrets.token_hex(3)}"
    eid = fleet.cli("start", "page-shape", "--input", json.dumps(str(marker))).stdout.strip()
    fleet.store.until(eid, "parked", "go")
    marker.write_text("the code changed shape\n")
    fleet.cli("resume", eid, "go", "--payload", '"yes"')
    fleet.store.until(eid, "parked", "__fleet_diverged__")
    return eid, marker


def test_a_diverged_run_is_listed_with_its_reason_and_retry_reparks_until_fixed(
        fleet: Fleet, tmp_path: Path) -> None:
    browser = Browser(fleet.flower_url)
    before = fleet.settled("divergence_parked")
    eid, marker = diverge(fleet, tmp_path)
    # The counter, on the page and in the API, from the worker that parked it.
    api = status_when(browser, lambda d: d["totals"]["divergence_parked"] == before + 1,
                      "divergence_parked to move")
    (listed,) = [p for p in api["parked"] if p["executionId"] == eid]
    assert listed["flow"] == "page-shape"
    assert listed["version"] == 3
    assert listed["reason"] == "skipped 1: a"
    assert listed["kind"] == "diverged"
    assert listed["parkedAt"] > 0
    # The worker that parked it (its report names it: the index forgot the holder).
    assert listed["worker"] in {fleet.procs[n].nodename for n in ("a", "b")}
    api = status_when(browser, lambda d: "executions parked diverged" in d["alarms"],
                      "the park to be read from the store")
    alarm = api["alarms"]["executions parked diverged"]
    assert alarm["value"] == api["parked_now"]["diverged"] >= 1
    assert alarm["do"].startswith("Fix, pin or migrate the flow")
    assert alarm["runbook"] == "/fleet/runbook#executions-parked-on-the-divergence-gate"
    parked_then = api["parked_now"]["diverged"]
    _, page = browser.get("/fleet")
    assert total_card(page, "divergence_parked") == before + 1
    row = page[page.index(f'data-execution="{eid}"'):]
    row = row[:row.index("</tr>")]
    assert "skipped 1: a" in row
    assert 'class="table-danger"' in page[:page.index(f'data-execution="{eid}"') + 40]
    assert "needs the operator role" in row  # FLEET_OPERATORS=ops; open Flower: no user
    assert f'href="/fleet/execution/{eid}"' in row
    status, log_page = browser.get(f"/fleet/execution/{eid}")
    assert status == 200
    assert "EXECUTION_SUSPENDED" in log_page
    assert "__fleet_diverged__" in log_page
    assert 'id="fleet-alarms"' in page
    workers = [w for w in api["processes"] if w["role"] == "worker"]
    assert sum(w["counters"]["divergence_parked"] for w in workers) == before + 1
    # fleet diverged list: the same row.
    listed_cli = [json.loads(line) for line in
                  fleet.cli("diverged", "list", "--json").stdout.splitlines()]
    assert [(p["reason"], p["worker"]) for p in listed_cli if p["executionId"] == eid] == [
        ("skipped 1: a", listed["worker"])]
    assert eid in fleet.cli("diverged", "list", COLUMNS="200").stdout
    # Retry before the code is fixed: parked again, and the answer says so.
    retried = fleet.cli("diverged", "retry", eid, "--json", check=False)
    assert retried.returncode == 2, (retried.stdout, retried.stderr)
    result = json.loads(retried.stdout)
    assert result["reparked"] is True
    assert "diverged again" in result["message"]
    resumed = [e for e in fleet.store.read(eid) if str(e.type) == "EXECUTION_RESUMED"]
    assert resumed[-1].payload["gate"] == "__fleet_diverged__"
    assert resumed[-1].payload["by"] == OPERATOR  # the audit: who retried
    until(lambda: browser.json("/fleet/api/status")["totals"]["divergence_parked"]
          == before + 2, "the re-park to count")
    assert total_card(browser.get("/fleet")[1], "divergence_parked") == before + 2
    # Fixed (the marker gone): the retry runs on; it waits on its gate again.
    marker.unlink()
    done = json.loads(fleet.cli("diverged", "retry", eid, "--json").stdout)
    assert done["reparked"] is False
    assert done["settled"] is True
    assert done["status"] == "completed"
    assert fleet.store.read(eid)[-1].payload["output"] == {"b": 5, "go": "yes"}
    after = status_when(browser, lambda d: d["parked_now"]["diverged"] < parked_then,
                        "what is parked now to go down")
    assert [p for p in after["parked"] if p["executionId"] == eid] == []
    # What is parked now went down with it; divergence_parked (a total) did not.
    assert after["parked_now"]["diverged"] == parked_then - 1
    assert after["totals"]["divergence_parked"] == before + 2
    assert "divergence_parked" not in after["alarms"]


def test_retry_on_the_page_needs_the_operator_role_and_the_xsrf_token(
        fleet: Fleet, tmp_path: Path) -> None:
    # viewer: no role, reads every tenant (FLEET_FLOWER_TENANTS; issue 25 item 11).
    base = fleet.start_flower("flower-auth", FLOWER_BASIC_AUTH="ops:pw1,viewer:pw2",
                              FLEET_FLOWER_TENANTS=json.dumps({"viewer": ["*"]}))
    eid, _ = diverge(fleet, tmp_path)
    count = len(fleet.store.read(eid))
    viewer = Browser(base, "viewer:pw2")
    status, page = viewer.get("/fleet")
    assert status == 200
    assert f'data-execution="{eid}"' in page
    assert "needs the operator role" in page  # no Retry button for a viewer
    refused = viewer.post(f"/fleet/diverged/{eid}/retry", {"_xsrf": viewer.xsrf()})
    assert refused[0] == 403
    assert "operator role" in refused[1]
    refused = viewer.post(f"/fleet/api/diverged/{eid}/retry", {"_xsrf": viewer.xsrf()})
    assert refused[0] == 403
    assert json.loads(refused[1])["error"] == "operator_role_required"
    assert Browser(base).get("/fleet")[0] == 401  # no credentials: Flower's own auth
    # /metrics behind the same login as every page (Flower's own handler asks none).
    assert Browser(base).get("/metrics")[0] == 401
    assert Browser(base, "viewer:wrong").get("/metrics")[0] == 401
    status, text = viewer.get("/metrics")
    assert status == 200
    assert "fleet_drives_total" in text
    ops = Browser(base, "ops:pw1")
    _, page = ops.get("/fleet")
    assert "Retry</button>" in page
    # An operator without the token (a forged cross-site form): refused.
    assert ops.post(f"/fleet/diverged/{eid}/retry")[0] == 403
    assert ops.post(f"/fleet/diverged/{eid}/retry", {"_xsrf": "forged"})[0] == 403
    assert len(fleet.store.read(eid)) == count  # the log untouched by every refusal
    status, _, location = ops.post(f"/fleet/diverged/{eid}/retry", {"_xsrf": ops.xsrf()})
    assert status == 303
    _, page = ops.get(location)
    assert "diverged again" in page  # the code is not fixed: the page says so
    assert 'id="fleet-message"' in page
    events = fleet.store.read(eid)
    assert [e.payload.get("by") for e in events if str(e.type) == "EXECUTION_RESUMED"
            ][-1] == OPERATOR
    # Not parked on the divergence gate: a clear refusal, nothing written.
    gate = fleet.cli("start", "page-gate", "--input", "1").stdout.strip()
    fleet.store.until(gate, "parked", "approval")
    written = len(fleet.store.read(gate))
    wrong = ops.post(f"/fleet/api/diverged/{gate}/retry", {"_xsrf": ops.xsrf()})
    assert wrong[0] == 409
    assert json.loads(wrong[1])["error"] == "gate_mismatch"
    assert len(fleet.store.read(gate)) == written


def test_retry_all_retries_every_diverged_run_of_a_flow_as_the_operator(
        fleet: Fleet, tmp_path: Path) -> None:
    """Issue 29.5: the Fleet page's bulk Retry (each run retried and audited as the single
    Retry, paced, capped a click), for operators only, with the XSRF token."""
    base = fleet.start_flower("flower-bulk", FLOWER_BASIC_AUTH="ops:pw1,viewer:pw2")
    eids = [diverge(fleet, tmp_path)[0] for _ in range(2)]
    counts = {eid: len(fleet.store.read(eid)) for eid in eids}
    viewer = Browser(base, "viewer:pw2")
    assert 'id="fleet-retry-all"' not in viewer.get("/fleet")[1]
    form = {"_xsrf": viewer.xsrf(), "flow": "page-shape"}
    assert viewer.post("/fleet/api/diverged/retry", form)[0] == 403
    ops = Browser(base, "ops:pw1")
    assert 'id="fleet-retry-all"' in ops.get("/fleet")[1]
    assert ops.post("/fleet/api/diverged/retry", {"flow": "page-shape"})[0] == 403  # no token
    assert {eid: len(fleet.store.read(eid)) for eid in eids} == counts  # nothing written
    status, body, _ = ops.post("/fleet/api/diverged/retry",
                               {"_xsrf": ops.xsrf(), "flow": "page-shape", "dry_run": "1"})
    assert status == 200
    assert json.loads(body)["matched"] >= 2
    assert {eid: len(fleet.store.read(eid)) for eid in eids} == counts  # a dry run
    status, body, _ = ops.post("/fleet/api/diverged/retry",
                               {"_xsrf": ops.xsrf(), "flow": "page-shape"})
    assert status == 200, body
    assert json.loads(body)["acted"] >= 2
    for eid in eids:
        resumed = [e for e in fleet.store.read(eid) if str(e.type) == "EXECUTION_RESUMED"]
        assert (resumed[-1].payload["gate"], resumed[-1].payload["by"]) == (
            "__fleet_diverged__", OPERATOR)


# -- tasks an operator can read ---------------------------------------------------------

def test_drive_tasks_in_flower_name_the_execution_and_flow_and_say_how_the_run_ended(
        fleet: Fleet, tmp_path: Path) -> None:
    browser = Browser(fleet.flower_url)
    eid, _ = diverge(fleet, tmp_path)

    def drives() -> list[dict[str, Any]] | None:
        tasks = browser.json("/api/tasks?taskname=fleet.drive&limit=1000")
        mine = [t for t in tasks.values() if eid in str(t.get("args"))
                and t.get("state") == "SUCCESS"]
        return mine if len(mine) >= 2 else None
    mine = sorted(until(drives, "Flower to see both drives"),
                  key=lambda t: t.get("succeeded") or 0)
    for task in mine:
        assert "page-shape" in str(task["kwargs"]), task  # the flow, beside the id
    results = [str(t["result"]) for t in mine]
    assert "parked on go (gate)" in results[0]
    assert "parked on __fleet_diverged__ (diverged: skipped 1: a)" in results[-1]
    assert "the replay diverged" in results[-1]


# -- Prometheus ----------------------------------------------------------------------------

def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_flowers_metrics_parse_and_carry_every_counter_by_process(
        fleet: Fleet, tmp_path: Path) -> None:
    browser = Browser(fleet.flower_url)
    before = fleet.settled("divergence_parked")
    diverge(fleet, tmp_path)

    def scraped() -> dict[str, Any] | None:
        status, text = browser.get("/metrics")
        assert status == 200
        found = families(text)
        moved = sum(s.value for s in found["fleet_divergence_parked"].samples
                    if s.name == "fleet_divergence_parked_total") >= before + 1
        return found if moved else None
    # (>=: a re-park by an earlier test may land in a report after `before` was read)
    found = until(scraped, "fleet_divergence_parked_total to move")
    assert "flower_events" in found  # Flower's own metrics are still there
    for counter in WORKER_COUNTERS:
        assert f"fleet_{counter}" in found, counter
    drives = found["fleet_drives"]
    assert drives.type == "counter"
    by_process = {(s.labels["role"], s.labels["process"]): s.value for s in drives.samples
                  if s.name == "fleet_drives_total"}
    assert {(role, name) for role, name in by_process if role == "worker"} == {
        ("worker", fleet.procs[n].nodename) for n in ("a", "b")}
    assert found["fleet_active"].type == "gauge"
    services = {s.labels["role"] for s in found["fleet_timers_fired"].samples}
    assert "timers" in services
    assert {s.labels["role"] for s in found["fleet_outcomes_attached"].samples} >= {"attacher"}
    assert "relay" in {s.labels["role"] for s in found["fleet_published"].samples}
    stale = {s.labels["role"]: s.value for s in found["fleet_process_stale"].samples}
    assert set(stale) == {"worker", "timers", "recovery", "attacher", "relay"}
    parked = {s.labels["gate"]: s.value for s in found["fleet_executions_parked"].samples}
    assert parked["diverged"] >= 1
    scraped_total = sum(s.value for s in found["fleet_divergence_parked"].samples
                        if s.name == "fleet_divergence_parked_total")
    # The API reads the same reports, a moment later: never less.
    assert browser.json("/fleet/api/status")["totals"]["divergence_parked"] >= scraped_total
    assert "fleet_stream_dead_letters" in found
    assert "fleet_stream_group_lag" in found


def test_a_scrape_never_waits_on_the_store_nor_holds_flowers_loop(fleet: Fleet) -> None:
    """Issue 25 item 6: while the store does not answer (a lock the test holds on the
    index), scrapes answer at once with the last numbers read, and Flower its health
    check and its pages; the numbers catch up once the store answers."""
    import threading

    import asyncpg
    from postgres_server import run_async

    url = fleet.settings.database_url
    held = threading.Event()
    release = threading.Event()

    async def hold_the_index() -> None:
        conn = await asyncpg.connect(url)
        try:
            async with conn.transaction():
                await conn.execute("LOCK TABLE executions IN ACCESS EXCLUSIVE MODE")
                held.set()
                await asyncio.to_thread(release.wait, 60)
        finally:
            await conn.close()

    async def waiting_on_the_lock() -> bool:
        conn = await asyncpg.connect(url)
        try:
            return bool(await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%fleet_backlog%'"))
        finally:
            await conn.close()

    browser = Browser(fleet.flower_url)
    assert "fleet_executions_unowned" in families(browser.get("/metrics")[1])  # it reads
    holder = threading.Thread(target=lambda: run_async(hold_the_index), daemon=True)
    holder.start()
    try:
        assert held.wait(30)
        until(lambda: run_async(waiting_on_the_lock), "the exporter to wait on the store")
        for _ in range(3):
            status, text = browser.get("/metrics")
            assert status == 200
            found = families(text)
            assert "fleet_executions_unowned" in found  # the last numbers read
            assert "fleet_drives" in found
            (age,) = found["fleet_backlog_age_seconds"].samples
        for path in ("/healthcheck", "/fleet/runbook"):
            assert browser.get(path)[0] == 200, path
        assert holder.is_alive()  # all of that while the index stayed locked
    finally:
        release.set()
        holder.join(30)

    def fresh() -> bool:
        (now,) = families(browser.get("/metrics")[1])["fleet_backlog_age_seconds"].samples
        return now.value < age.value
    until(fresh, "the numbers to be read again")


def scrape_port(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        return families(reply.read().decode())


def test_each_fact_has_one_scrape_target(fleet: Fleet) -> None:
    """Decision 0046: a service's own /metrics carries its process metrics and no fleet_*
    family; Flower's metrics port carries every process's counters, once each."""
    own = scrape_port(fleet.metrics_port)
    assert "process_cpu_seconds" in own  # what only that process knows
    assert [name for name in own if name.startswith("fleet_")] == []
    found = scrape_port(fleet.flower_metrics_port)
    samples = [s for s in found["fleet_timers_fired"].samples
               if s.name == "fleet_timers_fired_total"]
    keys = [(s.labels["role"], s.labels["process"]) for s in samples]
    assert len(keys) == len(set(keys))  # one series per process
    reported = {p.name: p for p in fleet.counters().processes if p.role == "timers"}
    timers = fleet.procs["timers"]
    (sample,) = [s for s in samples if s.labels["role"] == "timers"
                 and reported[s.labels["process"]].pid == timers.proc.pid]
    assert sample.value <= reported[sample.labels["process"]].counters["timers_fired"]
    for name in ("fleet_executions_unowned", "fleet_executions_unowned_oldest_seconds",
                 "fleet_timers_due", "fleet_timers_late_seconds", "fleet_executions_parked",
                 "fleet_processes_live", "flower_events"):
        assert name in found, name
    live = {s.labels["role"]: s.value for s in found["fleet_processes_live"].samples}
    assert live["worker"] >= 2
    assert live["relay"] >= 1


# -- stale --------------------------------------------------------------------------------

def test_a_stopped_service_leaves_the_page_at_once_and_a_killed_one_is_missing_until_replaced(
        fleet: Fleet) -> None:
    """Decision 0047: a clean stop is no alarm; a process that vanished is red while it
    is expected back, and no longer once a newer process of its role took its place."""
    browser = Browser(fleet.flower_url)

    def mine(proc: Proc) -> dict[str, Any] | None:
        data = browser.json("/fleet/api/status")
        return next((p for p in data["processes"] if p["pid"] == proc.proc.pid), None)

    def reported(proc: Proc) -> dict[str, Any]:
        return until(lambda: (m := mine(proc)) and m["state"] == "live"
                     and m["counters"]["ticks"] > 0 and m, f"{proc.name} to report ticks")

    # A clean stop (SIGTERM): it leaves the page and the metrics at once, no alarm.
    clean = fleet.start_service("timers", "timers-clean")
    live = reported(clean)
    clean.stop()
    stopped = until(lambda: (m := mine(clean)) and m["state"] == "stopped" and m,
                    "the stopped report", 20)
    assert stopped["counters"]["ticks"] >= live["counters"]["ticks"] > 0
    _, page = browser.get("/fleet")
    assert f'data-process="{stopped["name"]}"' not in page
    data = browser.json("/fleet/api/status")
    assert "missing processes" not in data["alarms"]
    assert stopped["counters"]["ticks"] <= data["totals"]["ticks"]  # it still counts
    stale = {s.labels["process"] for s in scrape_port(
        fleet.flower_metrics_port)["fleet_process_stale"].samples}
    assert stopped["name"] not in stale
    # Killed (SIGKILL: no last report): missing, red, its last values, what to do.
    killed = fleet.start_service("timers", "timers-killed")
    before = reported(killed)
    killed.signal(signal.SIGKILL)
    killed.wait_exit(10)
    missing = until(lambda: (m := mine(killed)) and m["state"] == "missing" and m,
                    "it to be missing", 20)
    assert missing["counters"]["ticks"] >= before["counters"]["ticks"] > 0  # not zeros
    data = browser.json("/fleet/api/status")
    alarm = data["alarms"]["missing processes"]
    assert f"timers {missing['name']} silent" in alarm["detail"]
    assert alarm["runbook"] == "/fleet/runbook#missing-processes"
    _, page = browser.get("/fleet")
    row = page[page.index(f'data-process="{missing["name"]}"'):]
    assert "missing" in row[:row.index("</tr>")]
    assert 'href="/fleet/runbook#missing-processes"' in page
    flags = {s.labels["process"]: s.value for s in scrape_port(
        fleet.flower_metrics_port)["fleet_process_stale"].samples}
    assert flags[missing["name"]] == 1
    # A replacement of its role starts (a pod replaced): the killed one is gone.
    reported(fleet.start_service("timers", "timers-replacement"))
    gone = until(lambda: (m := mine(killed)) and m["state"] == "gone" and m,
                 "the killed one to be replaced", 20)
    assert gone["counters"] == missing["counters"]
    data = browser.json("/fleet/api/status")
    assert "missing processes" not in data["alarms"]
    _, page = browser.get("/fleet")
    assert f'data-process="{gone["name"]}"' not in page
    assert 'id="fleet-hidden"' in page


def test_the_runbook_flower_serves_has_an_entry_for_every_alarm(fleet: Fleet) -> None:
    from fleet.services.alarms import RUNBOOK

    status, page = Browser(fleet.flower_url).get("/fleet/runbook")
    assert status == 200
    for entry in RUNBOOK.values():
        assert f'id="{entry.anchor}"' in page
        assert entry.title in page


# -- a real browser: headless Chromium ------------------------------------------------------
# Debian's chromium (tests/kits/chromium_kit.py). FLEET_UPDATE_SCREENSHOT=1 also
# writes the screenshot to docs/fleet-page.png, which the README shows.

def test_chromium_renders_the_fleet_page_with_a_diverged_execution(
        fleet: Fleet, tmp_path: Path) -> None:
    eid, _ = diverge(fleet, tmp_path)
    # A Flower where everyone it lets in is an operator: the Retry button shows. (An
    # open Flower has no operator, whatever FLEET_OPERATORS says: issue 25 item 5.)
    base = fleet.start_flower("flower-shot", FLOWER_BASIC_AUTH="shot:pw-shot",
                              FLEET_OPERATORS="*")
    url = base.replace("http://", "http://shot:pw-shot@") + "/fleet"
    dom = chromium("--dump-dom", url)
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-2000:]
    html = dom.stdout.decode()
    assert f'data-execution="{eid}"' in html
    assert "skipped 1: a" in html
    assert 'id="fleet-nav"' in html  # Flower's navbar, with the Fleet link
    assert "Retry</button>" in html
    shot = tmp_path / "fleet-page.png"
    done = chromium(f"--screenshot={shot}", "--window-size=1440,1500", url)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    width, height, pixels = png_pixels(shot.read_bytes())
    assert (width, height) == (1440, 1500)
    # Bootstrap's danger red (#dc3545 and its table tint): the alarms, the parked row.
    red = sum(1 for r, g, b in pixels if r > 180 and g < 90 and b < 100)
    assert red > 500, red
    assert len(set(pixels[::97])) > 20  # a page, not a blank or an error screen
    if os.environ.get("FLEET_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "fleet-page.png")


def test_the_workers_and_parked_tables_fit_a_1280_pixel_screen(fleet: Fleet,
                                                               tmp_path: Path) -> None:
    """Issue 29.11: at a 1280 px window the Workers table (and the parked list) need no
    sideways scrolling. Measured in headless Chromium: the page as Flower serves it,
    with a script after it that writes each table's width and its box's."""
    diverge(fleet, tmp_path)
    base = fleet.start_flower("flower-1280", "--unauthenticated", FLEET_OPERATORS="*")
    with urllib.request.urlopen(f"{base}/fleet", timeout=60) as reply:
        page = reply.read().decode()
    probe = ('<script>window.addEventListener("load", () => { const out = {};'
             ' for (const id of ["fleet-workers", "fleet-parked"]) {'
             '  const t = document.getElementById(id);'
             '  out[id] = [t.scrollWidth, t.closest("figure").clientWidth]; }'
             ' out.page = [document.documentElement.scrollWidth, window.innerWidth];'
             ' document.body.setAttribute("data-measured", JSON.stringify(out)); });</script>')
    local = tmp_path / "fleet.html"
    local.write_text(page.replace("<head>", f'<head><base href="{base}/">', 1)
                     .replace("</body>", probe + "</body>", 1))
    dom = chromium("--dump-dom", "--window-size=1280,900", local.as_uri())
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-2000:]
    found = re.search(r'data-measured="([^"]+)"', dom.stdout.decode())
    assert found, dom.stdout.decode()[-2000:]
    measured = json.loads(found.group(1).replace("&quot;", '"'))
    workers = [p for p in fleet_status(base)["processes"] if p["role"] == "worker"]
    assert workers  # the table has rows to measure
    for table in ("fleet-workers", "fleet-parked"):
        width, box = measured[table]
        assert width <= box, (table, measured)
    assert measured["page"][0] <= 1280, measured


def fleet_status(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base}/fleet/api/status", timeout=60) as reply:
        return dict(json.loads(reply.read()))
