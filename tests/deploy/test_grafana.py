"""deploy/grafana/fleet-dashboard.json: valid JSON, and every metric a panel queries is
one the fleet exports (fleet.services.metrics over fleet.services.counters)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fleet.services.counters import GAUGES, SERVICE_COUNTERS, WORKER_COUNTERS
from fleet.services.metrics import metric_name

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "fleet-dashboard.json"
FIXED = {"fleet_process_stale", "fleet_process_report_age_seconds", "fleet_stream_length",
         "fleet_stream_group_lag", "fleet_stream_dead_letters", "fleet_executions_parked",
         "fleet_processes_live", "fleet_executions_unowned",
         "fleet_executions_unowned_oldest_seconds", "fleet_timers_due",
         "fleet_timers_late_seconds"}


def exported() -> set[str]:
    names = set(FIXED)
    for counter in {*WORKER_COUNTERS, *(c for cs in SERVICE_COUNTERS.values() for c in cs)}:
        base = metric_name(counter)
        names.add(base if counter in GAUGES else f"{base}_total")
    return names


def test_every_panel_queries_a_metric_the_fleet_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "fleet-overview"
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"\bfleet_[a-z_]+", target["expr"]))
    assert queried, "no panel queries a fleet metric"
    assert queried - exported() == set()
    # The first row is what needs an operator.
    first = {p["title"] for p in dashboard["panels"] if p["gridPos"]["y"] == 0}
    assert {"Diverged executions parked now", "Missing processes", "Dead letters"} <= first


def test_the_check_catches_a_metric_nobody_exports() -> None:
    assert "fleet_drives_total" in exported()
    assert "fleet_no_such_thing_total" not in exported()
