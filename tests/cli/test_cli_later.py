"""``FLEET_QUEUES`` and ``fleet start --at/--in/--queue/--key/--priority/--debounce``: what
is refused, and with which words, before anything is written."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import click
import pytest
from click.testing import CliRunner

from fleet import Queue
from fleet.cli import main
from fleet.cli.dispatch import later_options, parse_duration, parse_time
from fleet.config import FleetSettings
from fleet.host.kernel import build_runtime, open_store
from fleet.kernel.errors import ConfigurationError


def test_fleet_queues_are_declared_on_every_roles_runtime(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_QUEUES", '{"mail": {"concurrency": 3, "rate": [10, 0.5]}, '
                                       '"users": {"per_key_concurrency": 1, "priority": true}}')
    settings = FleetSettings(database_url="memory:")
    assert settings.queue_declarations() == (
        Queue("mail", concurrency=3, rate=(10, timedelta(milliseconds=500))),
        Queue("users", per_key_concurrency=1, priority=True))
    runtime = build_runtime(settings, open_store(settings), role="worker")
    assert runtime.queues.declared() == ("mail", "users")


@pytest.mark.parametrize(("spec", "words"), [
    ({"mail": {"concurrency": 0}}, "'mail': concurrency"),
    ({"mail": {"concurrency": -2}}, "'mail': concurrency"),
    ({"mail": {"rate": [-1, 1.0]}}, "'mail': rate count"),
    ({"mail": {"rate": [10, 0]}}, "'mail': rate period"),
    ({"mail": {"rate": 10}}, "'mail': rate must be"),
    ({"mail": {"per_key": 1}}, "'mail': unknown setting"),
    ({"mail": 3}, "'mail': its settings must be an object"),
    ({"bad name": {}}, "'bad name' is not a queue name"),
])
def test_a_bad_fleet_queues_setting_names_the_setting_the_queue_and_the_field(
        spec: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigurationError, match=f"FLEET_QUEUES: .*{words}"):
        FleetSettings(database_url="memory:", queues=spec).queue_declarations()
    with pytest.raises(ConfigurationError, match="FLEET_QUEUES"):
        build_runtime(FleetSettings(database_url="memory:", queues=spec),
                      open_store(FleetSettings(database_url="memory:")), role="worker")


def test_durations_and_times_of_the_command_line() -> None:
    assert parse_duration("90s", "--in") == timedelta(seconds=90)
    assert parse_duration("15m", "--in") == timedelta(minutes=15)
    assert parse_duration("2h", "--in") == timedelta(hours=2)
    assert parse_duration("1d", "--in") == timedelta(days=1)
    assert parse_duration("250ms", "--in") == timedelta(milliseconds=250)
    assert parse_duration("12", "--in") == timedelta(seconds=12)
    for bad in ("", "soon", "-5s", "5 weeks", "1e3"):
        with pytest.raises(click.BadParameter):
            parse_duration(bad, "--in")
    assert parse_time("2027-01-01T09:00:00Z", "--at") == datetime(2027, 1, 1, 9, tzinfo=UTC)
    with pytest.raises(click.BadParameter, match="no time zone"):
        parse_time("2027-01-01T09:00:00", "--at")
    with pytest.raises(click.BadParameter, match="ISO 8601"):
        parse_time("next tuesday", "--at")
    assert later_options(None, "5s", "mail", "k", 2, None) == {
        "start_in": timedelta(seconds=5), "queue": "mail", "key": "k", "priority": 2}
    assert later_options(None, None, None, None, None, None) == {}


def test_fleet_start_refuses_a_bad_time_as_a_usage_error() -> None:
    for args in (["--in", "soon"], ["--at", "2027-01-01T09:00:00"], ["--debounce", "x"]):
        result = CliRunner().invoke(main, ["start", "any-flow", *args])
        assert result.exit_code == 2, result.output
        assert "Invalid value" in result.output
