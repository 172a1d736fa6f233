"""bench/temporal.py's pure parts: the arguments, how load is split, the settings it
passes and how rows are compared. The benchmark itself is never run as a test."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import _common
from bench import temporal as bench


def test_defaults_are_the_issue_s_rows_at_32_and_1_in_flight() -> None:
    args = bench.build_parser().parse_args([])
    assert args.in_flight == [32, 1]
    assert args.rows == ["temporal", "temporal-local", "fleet"]
    assert (args.workers, args.repeat, args.temporal_db) == (2, 3, "memory")


def test_in_flight_and_rows_parse() -> None:
    args = bench.build_parser().parse_args(["--in-flight", "8,64", "--rows", "fleet,temporal"])
    assert args.in_flight == [8, 64]
    assert args.rows == ["fleet", "temporal"]


@pytest.mark.parametrize("text", ["", "0", "32,-1", "a", "32,32", "1.5"])
def test_in_flight_refuses_what_is_not_distinct_positive_integers(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_counts(text)


@pytest.mark.parametrize("text", ["", "dbos", "fleet,restate"])
def test_rows_refuse_unknown_names(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="temporal-local"):
        bench.parse_rows(text)


@pytest.mark.parametrize(("n", "in_flight", "processes"),
                         [(1000, 32, 2), (100, 1, 2), (7, 32, 2), (10, 3, 4), (5, 5, 3),
                          (0, 32, 2), (33, 32, 3)])
def test_split_load_keeps_the_totals_and_gives_every_lane_work(n: int, in_flight: int,
                                                               processes: int) -> None:
    shares = bench.split_load(n, in_flight, processes)
    assert len(shares) == processes
    assert sum(s for s, _ in shares) == n
    assert sum(c for _, c in shares) == min(in_flight, n)
    for share, lanes in shares:
        assert share >= lanes  # no lane idles for want of an execution
        assert (share == 0) == (lanes == 0)  # and nothing to start without a lane


def test_one_in_flight_runs_in_one_process() -> None:
    assert bench.split_load(100, 1, 2) == [(100, 1), (0, 0)]


def test_dynamic_config_flags_pass_json_values() -> None:
    flags = bench.dynamic_config_flags({"a.intKey": (10, "why"), "b.boolKey": (True, "why"),
                                        "c.strKey": ("x", "why")})
    assert flags == ["--dynamic-config-value", "a.intKey=10", "--dynamic-config-value",
                     "b.boolKey=true", "--dynamic-config-value", 'c.strKey="x"']


def test_every_knob_says_why() -> None:
    for key, (value, why) in bench.DYNAMIC_CONFIG.items():
        assert "." in key, key  # service.name, as the server registers them
        assert json.dumps(value), key
        assert len(why) > 10, key
    for key, (value, why) in bench.WORKER_TUNING.items():
        assert value >= 1, key
        assert len(why) > 10, key


def test_unknown_keys_are_those_missing_from_the_binary(tmp_path: Path) -> None:
    binary = tmp_path / "temporal"
    binary.write_bytes(b"\x00go\x00history.transferProcessorMaxPollRPSmatching.rpsX\x00")
    assert bench.unknown_keys(binary, ["history.transferProcessorMaxPollRPS", "matching.rps",
                                       "history.transferProcessorMaxPollRate"]) == [
        "history.transferProcessorMaxPollRate"]


def test_server_versions_parse_the_cli_banner() -> None:
    assert bench.server_versions("temporal version 1.9.1 (Server 1.32.0, UI 2.54.1)\n") == {
        "cli": "1.9.1", "server": "1.32.0", "ui": "2.54.1"}
    assert bench.server_versions("something else\n") == {"cli": "something else"}


def test_summarize_keeps_every_run_and_divides_fleet_by_temporal_per_load() -> None:
    runs = {("fleet", 32): [{"executions_per_s": 200.0, "load_1min": 3.0},
                            {"executions_per_s": 250.0, "load_1min": 1.0,
                             "cpu_ms_per_execution": {"workers": 4.0, "postgres": 1.0}}],
            ("temporal", 32): [{"executions_per_s": 25.0, "eager_started": 1.0,
                                "cpu_ms_per_execution": {"server": 30.0, "workers": 10.0}},
                               {"executions_per_s": 20.0, "eager_started": 0.5}],
            ("temporal-local", 1): [{"executions_per_s": 40.0}]}
    rows = {(r["row"], r["in_flight"]): r for r in bench.summarize(runs)}
    fleet = rows[("fleet", 32)]
    assert fleet["runs"] == [200.0, 250.0]
    assert fleet["runs_load_1min"] == [3.0, 1.0]
    assert fleet["executions_per_s"] == 250.0
    assert "fleet_x" not in fleet
    temporal = rows[("temporal", 32)]
    assert temporal["fleet_x"] == 10.0
    assert temporal["cpu_x_fleet"] == 8.0  # (30 + 10) / (4 + 1): the best runs' CPU
    assert temporal["eager_started"] == 1.0  # the best run's own figures
    assert "fleet_x" not in rows[("temporal-local", 1)]  # no fleet row at that load


def test_fleet_workers_get_the_deployed_settings_and_nothing_from_this_shell(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_GROUP_COMMIT", "true")
    env = bench.fleet_worker_env("postgresql://db", "redis://r/12", "q", "s")
    fleet = {k: v for k, v in env.items() if k.startswith("FLEET_")}
    assert "FLEET_GROUP_COMMIT" not in fleet
    assert fleet["FLEET_WORKER_DRIVES"] == "64"
    assert fleet["FLEET_LEASE_MS"] == "30000"
    assert fleet["FLEET_EVENTS_STREAM"] == "s"
    assert fleet["FLEET_QUEUE"] == "q"
    assert env["PYTHONPATH"] == str(_common.ROOT)


@pytest.mark.parametrize(("base", "url"), [("redis://h:6379", "redis://h:6379/12"),
                                           ("redis://h:6379/0", "redis://h:6379/12"),
                                           ("redis://h:6379/", "redis://h:6379/12")])
def test_benches_use_their_own_redis_database(base: str, url: str) -> None:
    assert _common.bench_redis_url(base) == url
