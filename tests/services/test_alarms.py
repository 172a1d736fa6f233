"""Alarms that tell the truth (issue 28 item 5, decision 0047), and what the exporter makes
of the counters and the backlog (decision 0046): pure data in, judgements out.

The same code runs against real processes in ``integration/test_fleet_page.py``
(the page, the API, the metrics port) and ``integration/test_backlog_gauges.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleet.kernel.store.backlog import Backlog, BacklogGroup
from fleet.services.alarms import RUNBOOK, Alarm, fleet_alarms
from fleet.services.backlog import BacklogSnapshot, QueueBacklog, route_backlog
from fleet.services.counters import (
    GONE,
    LIVE,
    MISSING,
    STOPPED,
    FleetCounters,
    ProcessReport,
    StatsReporter,
    StreamInfo,
    classify,
    parse_report,
)
from fleet.services.metrics import FleetCollector

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
NOW = 1_800_000_000.0


def report(role: str, name: str, *, age: float = 1.0, started: float = NOW - 3600,
           stopped: bool = False, counters: dict[str, float] | None = None,
           rose: dict[str, float] | None = None, stale_s: float = 10.0,
           problems: list[str] | None = None) -> ProcessReport:
    """A report as ``parse_report`` reads it from the hash a reporter wrote."""
    raw = {"role": role, "name": name, "at": str(NOW - age), "interval_s": "2",
           "started_at": str(started), "stopped_at": str(NOW - age) if stopped else "",
           "counters": json.dumps(counters or {"drives": 5}), "rose": json.dumps(rose or {}),
           "problems": json.dumps(problems or [])}
    parsed = parse_report(raw, now=NOW, stale_s=stale_s)
    assert parsed is not None
    return parsed


def states(reports: list[ProcessReport], missing_s: float = 900) -> dict[str, str]:
    return {r.name: r.state for r in classify(reports, missing_s=missing_s)}


# -- which processes are shown, and which are red ----------------------------------------------


def test_a_process_that_stopped_cleanly_is_stopped_at_once_and_not_shown() -> None:
    judged = classify([report("worker", "w1", age=0.5, stopped=True)], missing_s=900)
    assert [(r.state, r.shown, r.stale) for r in judged] == [(STOPPED, False, True)]


def test_a_silent_process_is_missing_until_replaced_or_silent_too_long() -> None:
    silent = report("worker", "w1", age=30)  # died 30 s ago
    assert states([silent]) == {"w1": MISSING}
    assert states([silent], missing_s=20) == {"w1": GONE}
    # A new worker started after w1's last report takes its place (a pod replaced).
    newer = report("worker", "w2", started=NOW - 10)
    assert states([silent, newer]) == {"w1": GONE, "w2": LIVE}
    # One that was already running does not: w1 died beside it and is still missing.
    older = report("worker", "w3", started=NOW - 600)
    assert states([silent, older]) == {"w1": MISSING, "w3": LIVE}
    # Nor does a new process of another role.
    assert states([silent, report("timers", "t1", started=NOW - 10)])["w1"] == MISSING
    # One replacement for one silent process: of two that died, the latest is replaced.
    first, second = report("worker", "w1", age=40), report("worker", "w4", age=20)
    assert states([first, second, newer]) == {"w1": MISSING, "w4": GONE, "w2": LIVE}


def test_the_reporter_records_when_an_alarm_counter_last_rose() -> None:
    values = {"fenced_out": 0.0, "drives": 1.0}
    reporter = StatsReporter("redis://unused", "worker", "w1", lambda: dict(values))
    first = reporter.fields()
    assert json.loads(first["rose"]) == {}  # 0: nothing rose
    values.update(fenced_out=2, drives=5)  # drives is no alarm
    rose = json.loads(reporter.fields()["rose"])
    assert set(rose) == {"fenced_out"}
    at = rose["fenced_out"]
    assert json.loads(reporter.fields()["rose"]) == {"fenced_out": at}  # unchanged: same time
    parsed = parse_report({**reporter.fields(), "at": str(NOW)}, now=NOW, stale_s=10)
    assert parsed is not None
    assert parsed.rose == {"fenced_out": at}


# -- the alarms -----------------------------------------------------------------------------


def test_alarms_are_what_is_true_now_each_with_what_to_do() -> None:
    processes = classify([
        report("worker", "w1", counters={"fenced_out": 3, "divergence_parked": 9},
               rose={"fenced_out": NOW - 60}),
        report("worker", "w2", counters={"errors": 4}, rose={"errors": NOW - 4000}),
        report("timers", "t-dead", age=120),
        report("worker", "w-stopped", stopped=True, counters={"failed": 1},
               rose={"failed": NOW - 30}),
    ], missing_s=900)
    streams = (StreamInfo("fleet:rewards", 10, {}, "fleet:rewards:dead", 2),)
    counters = FleetCounters(tuple(processes), streams)
    alarms = fleet_alarms(counters, parked={"diverged": 2, "in-doubt": 0}, now=NOW,
                          window_s=900)
    by_name = {a.name: a for a in alarms}
    assert list(by_name) == ["executions parked diverged", "missing processes", "fenced_out",
                             "failed", "dead letters on fleet:rewards:dead"]
    assert by_name["executions parked diverged"].value == 2
    assert by_name["missing processes"].detail == "timers t-dead silent 120 s"
    assert by_name["fenced_out"].detail == "rose 60 s ago"
    # A stopped process's rise still counts (it happened, lately); its row is not shown.
    assert by_name["failed"].value == 1
    # errors rose more than the window ago: no alarm; divergence_parked (a counter that
    # only grows) is judged by what is parked now, never by itself.
    assert "errors" not in by_name
    assert "divergence_parked" not in by_name
    for alarm in alarms:
        shown = alarm.to_dict("/fleet/runbook")
        assert shown["runbook"] == f"/fleet/runbook#{alarm.entry.anchor}"
        assert shown["do"] == alarm.entry.do
    quiet = fleet_alarms(FleetCounters(tuple(processes[:2])), parked={}, now=NOW + 3600,
                         window_s=900)
    assert quiet == []  # an hour later, nothing rose lately, nothing is parked: all clear


def test_a_live_process_that_reports_a_problem_is_an_alarm_until_it_stops() -> None:
    """Issue 25's problems (no fleet queue, an unreadable key file) are red while the
    process lives with them; a stopped or silent one is not unhealthy (it is gone or
    missing)."""
    problem = "keys: FLEET_DISPATCH_KEYS_FILE cannot be read"
    processes = classify([report("worker", "w1", problems=[problem]),
                          report("worker", "w2"),
                          report("worker", "w-stopped", stopped=True, problems=[problem])],
                         missing_s=900)
    alarms = fleet_alarms(FleetCounters(tuple(processes)), parked={}, now=NOW, window_s=900)
    assert [(a.kind, a.value, a.detail) for a in alarms] == [
        ("unhealthy", 1, f"worker w1: {problem}")]
    assert alarms[0].entry == RUNBOOK["unhealthy"]
    healthy = classify([report("worker", "w1"), report("worker", "w2")], missing_s=900)
    assert fleet_alarms(FleetCounters(tuple(healthy)), parked={}, now=NOW,
                        window_s=900) == []


def test_an_alarm_counter_without_an_entry_of_its_own_links_the_general_one() -> None:
    # A counter added to ALARMS later (another issue's) still says what to do.
    alarm = Alarm("some_new_counter", "some_new_counter", 1, "rose 1 s ago")
    assert alarm.entry == RUNBOOK["other"]
    assert alarm.to_dict("/r")["runbook"] == "/r#other-counters-that-rose"


def test_every_runbook_entry_is_a_heading_of_the_operations_guide_with_its_sentences() -> None:
    text = DOCS.read_text()
    section = text[text.index("\n## Runbook\n"):]
    section = section[:section.index("\n## ", 5)] if "\n## " in section[5:] else section
    headings = {_slug(h): h for h in re.findall(r"^### (.+)$", section, flags=re.M)}
    for key, entry in RUNBOOK.items():
        assert entry.anchor in headings, (key, entry.anchor, sorted(headings))
        assert headings[entry.anchor] == entry.title
        body = section[section.index(f"### {entry.title}\n"):]
        body = " ".join(body.split("\n### ", 1)[0].split())
        assert " ".join(entry.means.split()) in body, key
        assert " ".join(entry.do.split()) in body, key


def _slug(title: str) -> str:
    """GitHub's anchor for a heading."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


# -- the exporter ----------------------------------------------------------------------------


def test_the_backlog_is_routed_to_queues_and_aged_in_seconds() -> None:
    backlog = Backlog((BacklogGroup("light", "acme", 5, 1_000, 2, 4_000),
                       BacklogGroup("light", "noisy", 3, 2_000, 0, None),
                       BacklogGroup("heavy", None, 1, 9_000, 1, 9_500)))
    routes = {"flow:heavy": "fleet.heavy", "tenant:noisy": "fleet.noisy"}

    def route(flow: str, tenant: str | None) -> str:
        if f"flow:{flow}" in routes:
            return routes[f"flow:{flow}"]
        return routes.get(f"tenant:{tenant}", "fleet.drive") if tenant else "fleet.drive"
    rows = route_backlog(backlog, now_ms=10_000, route=route)
    assert rows == (QueueBacklog("fleet.drive", "light", 5, 9.0, 2, 6.0),
                    QueueBacklog("fleet.heavy", "heavy", 1, 1.0, 1, 0.5),
                    QueueBacklog("fleet.noisy", "light", 3, 8.0, 0, 0.0))


def _scrape(collector: FleetCollector) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_the_collector_exports_shown_processes_and_the_backlog_once() -> None:
    processes = classify([report("worker", "w1", counters={"drives": 7, "active": 2}),
                          report("worker", "w-gone", stopped=True, counters={"drives": 100}),
                          report("timers", "t1", age=60, counters={"fired": 4})],
                         missing_s=900)
    snapshot = BacklogSnapshot((QueueBacklog("fleet.drive", "light", 12, 3.5, 1, 0.25),),
                               {"diverged": 1, "in-doubt": 0})
    found = _scrape(FleetCollector(lambda: FleetCounters(tuple(processes)), lambda: snapshot))
    assert found["fleet_drives_total"] == {(("process", "w1"), ("role", "worker")): 7}
    assert found["fleet_active"] == {(("process", "w1"), ("role", "worker")): 2}
    assert found["fleet_process_stale"] == {(("process", "t1"), ("role", "timers")): 1,
                                            (("process", "w1"), ("role", "worker")): 0}
    live = {dict(k)["role"]: v for k, v in found["fleet_processes_live"].items()}
    assert (live["worker"], live["timers"]) == (1, 0)
    key = (("flow", "light"), ("queue", "fleet.drive"))
    assert found["fleet_executions_unowned"] == {key: 12}
    assert found["fleet_executions_unowned_oldest_seconds"] == {key: 3.5}
    assert found["fleet_timers_due"] == {key: 1}
    assert found["fleet_timers_late_seconds"] == {key: 0.25}
    assert found["fleet_executions_parked"] == {(("gate", "diverged"),): 1,
                                                (("gate", "in-doubt"),): 0}


def test_a_part_that_cannot_be_read_leaves_the_rest_served() -> None:
    def broken() -> BacklogSnapshot:
        raise ConnectionError("the store is down")
    found = _scrape(FleetCollector(lambda: FleetCounters((report("worker", "w1"),)), broken))
    assert "fleet_drives_total" in found
    assert "fleet_executions_unowned" not in found


def test_the_page_shows_the_runbooks_code_as_code_and_escapes_everything() -> None:
    from fleet.flowerui.views import code_spans

    assert code_spans("run `fleet resume <id>` & <b>x</b>") == (
        "run <code>fleet resume &lt;id&gt;</code> &amp; &lt;b&gt;x&lt;/b&gt;")
    assert code_spans("`<script>`") == "<code>&lt;script&gt;</code>"
