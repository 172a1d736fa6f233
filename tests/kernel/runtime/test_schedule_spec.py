"""A schedule's settings and ticks (``fleet.kernel.schedule_spec``, decision 0058): pure.

Every bad setting is a ``ValidationError`` naming its field; ``every`` ticks on the
epoch's multiples; cron ticks in its time zone with Debian cron's daylight-saving
rules (a skipped time runs at the jump, a repeated one once); the catch-up plan; the
tick ids and ``scheduled_at``; the tick id form no caller may take.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from fleet import ReservedNameError, ValidationError
from fleet.kernel.fold import ExecutionState
from fleet.kernel.ids import check_explicit_id, is_derived
from fleet.kernel.schedule_spec import (
    LATE_GRACE_MS,
    MAX_CATCHUP_RUNS,
    ScheduleSpec,
    iso_utc,
    scheduled_at,
    tick_id,
)

RIGA = ZoneInfo("Europe/Riga")
MINUTE = 60_000


def spec(**kw: Any) -> ScheduleSpec:
    settings: dict[str, Any] = {"cron": None, "every": None, "timezone": "UTC",
                                "overlap": "skip", "catchup": timedelta(0)}
    settings.update(kw)
    return ScheduleSpec.build("nightly", "job", None, **settings)


def ms(when: datetime) -> int:
    return round(when.timestamp() * 1000)


def test_every_ticks_on_the_multiples_of_its_interval_since_the_epoch() -> None:
    hourly = spec(every=timedelta(hours=1))
    at = ms(datetime(2025, 6, 1, 3, 17, 5, tzinfo=UTC))
    assert hourly.next_after(at) == ms(datetime(2025, 6, 1, 4, tzinfo=UTC))
    on_the_hour = ms(datetime(2025, 6, 1, 4, tzinfo=UTC))
    assert hourly.next_after(on_the_hour) == on_the_hour + 3_600_000  # strictly after
    assert hourly.ticks(on_the_hour, on_the_hour + 3 * 3_600_000, 10) == [
        on_the_hour + k * 3_600_000 for k in range(4)]
    assert hourly.due(at, on_the_hour + 2 * 3_600_000) == (
        3, on_the_hour, on_the_hour + 2 * 3_600_000)
    assert hourly.due(on_the_hour, on_the_hour + 1) == (0, None, None)


def test_a_cron_schedule_keeps_its_time_zone_across_daylight_saving_changes() -> None:
    daily = spec(cron="30 3 * * *", timezone="Europe/Riga")
    # Spring forward (2025-03-30, 03:00 -> 04:00): 03:30 does not exist; it runs at the jump.
    before = ms(datetime(2025, 3, 29, 12, tzinfo=RIGA))
    ticks = daily.ticks(before, before + 3 * 86_400_000, 10)
    assert [datetime.fromtimestamp(t / 1000, RIGA).isoformat() for t in ticks] == [
        "2025-03-30T04:00:00+03:00", "2025-03-31T03:30:00+03:00",
        "2025-04-01T03:30:00+03:00"]
    # Fall back (2025-10-26, 04:00 -> 03:00): 03:30 happens twice; it runs once.
    before = ms(datetime(2025, 10, 25, 12, tzinfo=RIGA))
    ticks = daily.ticks(before, before + 2 * 86_400_000, 10)
    assert [datetime.fromtimestamp(t / 1000, RIGA).isoformat() for t in ticks] == [
        "2025-10-26T03:30:00+03:00", "2025-10-27T03:30:00+02:00"]
    # Resuming from the first 03:30 (or the hour it repeats) never runs it again.
    first = ticks[0]
    assert daily.next_after(first) == ticks[1]
    assert daily.next_after(first + 3_600_000) == ticks[1]
    # A job every half hour runs at every real half hour through the repeated hour.
    half = spec(cron="*/30 * * * *", timezone="Europe/Riga")
    start = ms(datetime(2025, 10, 26, 2, 0, tzinfo=RIGA))
    real = half.ticks(start + 1, start + 3 * 3_600_000, 10)
    assert [b - a for a, b in itertools.pairwise(real)] == [30 * MINUTE] * (
        len(real) - 1)


def test_the_latest_missed_tick_runs_within_the_grace_and_older_ones_within_catchup() -> None:
    minutely = spec(every=timedelta(minutes=1))
    last = 10 * MINUTE
    # On time (the timer service's lag): the due tick runs.
    on_time = minutely.plan(last, 11 * MINUTE + 300)
    assert (on_time.run, on_time.missed, on_time.latest) == ([11 * MINUTE], 0, 11 * MINUTE)
    # A 10-minute outage, catchup 0: the latest (under a minute late) runs, 9 are missed.
    outage = minutely.plan(last, 20 * MINUTE + 500)
    assert (outage.run, outage.missed, outage.latest) == ([20 * MINUTE], 9, 20 * MINUTE)
    # Catchup 3 minutes: the ticks of the last 3 minutes run, once each, oldest first.
    caught = spec(every=timedelta(minutes=1), catchup=timedelta(minutes=3)).plan(
        last, 20 * MINUTE + 500)
    assert (caught.run, caught.missed) == ([18 * MINUTE, 19 * MINUTE, 20 * MINUTE], 7)
    # Nothing due yet.
    assert minutely.plan(last, last + 59_999).run == []
    # A daily job whose tick is more than the grace late, catchup 0: missed, not run.
    daily = spec(cron="0 3 * * *")
    three = ms(datetime(2025, 6, 2, 3, tzinfo=UTC))
    late = daily.plan(three - 86_400_000, three + LATE_GRACE_MS + 1)
    assert (late.run, late.missed, late.latest) == ([], 1, three)
    in_grace = daily.plan(three - 86_400_000, three + LATE_GRACE_MS)
    assert (in_grace.run, in_grace.missed) == ([three], 0)
    # Catchup covers it: it runs.
    assert spec(cron="0 3 * * *", catchup=timedelta(hours=1)).plan(
        three - 86_400_000, three + 30 * MINUTE).run == [three]


def test_a_catch_up_runs_at_most_its_cap_and_counts_the_rest_missed() -> None:
    every_second = spec(every=timedelta(seconds=1), catchup=timedelta(days=1))
    plan = every_second.plan(0, 3_000_000)  # 3,000 ticks in the window
    assert len(plan.run) == MAX_CATCHUP_RUNS
    assert plan.run[-1] == 3_000_000
    assert plan.missed == 3_000 - MAX_CATCHUP_RUNS
    per_minute = spec(cron="* * * * *", catchup=timedelta(days=1))
    start = ms(datetime(2025, 6, 1, tzinfo=UTC))
    plan = per_minute.plan(start, start + 2_000 * MINUTE)
    assert len(plan.run) == MAX_CATCHUP_RUNS
    assert plan.missed == 2_000 - MAX_CATCHUP_RUNS


@pytest.mark.parametrize(("settings", "field"), [
    ({"cron": "61 * * * *"}, "cron"),
    ({"cron": "0 3 * * * *"}, "cron"),            # six fields: seconds are not crontab's
    ({"cron": "@daily"}, "cron"),
    ({"cron": 5}, "cron"),
    ({"cron": "0 3 * * *", "every": timedelta(hours=1)}, "cron"),
    ({}, "every"),
    ({"every": timedelta(0)}, "every"),
    ({"every": timedelta(seconds=-5)}, "every"),
    ({"every": timedelta(milliseconds=1500)}, "every"),
    ({"every": 60}, "every"),
    ({"every": timedelta(hours=1), "timezone": "Europe/Riga"}, "timezone"),
    ({"cron": "0 3 * * *", "timezone": "Mars/Olympus_Mons"}, "timezone"),
    ({"cron": "0 3 * * *", "timezone": ""}, "timezone"),
    ({"every": timedelta(hours=1), "overlap": "queue"}, "overlap"),
    ({"every": timedelta(hours=1), "catchup": timedelta(seconds=-1)}, "catchup"),
    ({"every": timedelta(hours=1), "catchup": 30}, "catchup"),
])
def test_each_bad_setting_is_refused_naming_its_field(settings: dict[str, Any],
                                                      field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        spec(**settings)
    assert refused.value.details["field"] == field
    assert str(refused.value).startswith(f"{field}: ")


@pytest.mark.parametrize("schedule_id", ["", "a/b", "a@b", "a~1", "a#1", "x" * 201, 7,
                                         "caf\u00e9"])
def test_a_schedule_id_outside_its_characters_is_refused(schedule_id: Any) -> None:
    with pytest.raises(ValidationError) as refused:
        ScheduleSpec.build(schedule_id, "job", None, cron="0 3 * * *", every=None,
                           timezone="UTC", overlap="skip", catchup=timedelta(0))
    assert refused.value.details["field"] == "schedule_id"


def test_the_log_form_comes_back_the_same_and_names_what_differs() -> None:
    daily = spec(cron="0  3 * * *", timezone="Europe/Riga", overlap="allow",
                 catchup=timedelta(minutes=5))
    assert daily.cron == "0 3 * * *"  # normalised: the same schedule whatever the spacing
    assert ScheduleSpec.from_log(daily.to_log()) == daily
    other = spec(cron="0 4 * * *", timezone="Europe/Riga", overlap="skip",
                 catchup=timedelta(minutes=5))
    assert daily.differences(other) == ["cron", "overlap"]
    with pytest.raises(ValidationError):
        ScheduleSpec.from_log({"flow": "job", "catchupMs": "soon"})


def test_a_tick_id_is_iso_utc_and_reads_back_as_scheduled_at() -> None:
    tick = ms(datetime(2025, 6, 1, 3, tzinfo=UTC))
    assert tick_id("nightly", tick) == "nightly@2025-06-01T03:00:00Z"
    assert iso_utc(tick + 250) == "2025-06-01T03:00:00.250Z"
    child = ExecutionState(execution_id="nightly@2025-06-01T03:00:00.250Z")
    child.parent = {"executionId": "__fleet_schedule__:nightly/1~3", "name": "child#4"}
    assert scheduled_at(child) == datetime(2025, 6, 1, 3, 0, 0, 250_000, tzinfo=UTC)
    # The same id without a schedule as its recorded parent says nothing.
    child.parent = {"executionId": "someone-else", "name": "child#0"}
    assert scheduled_at(child) is None
    assert scheduled_at(ExecutionState(execution_id="plain")) is None


def test_no_caller_may_take_a_tick_id() -> None:
    assert is_derived("nightly@2025-06-01T03:00:00Z")
    assert is_derived("nightly@2025-06-01T03:00:00.250Z")
    with pytest.raises(ReservedNameError):
        check_explicit_id("nightly@2025-06-01T03:00:00Z")
    # Other uses of '@' stay free.
    assert check_explicit_id("alice@example.com") == "alice@example.com"
    assert not is_derived("order@2025-06-01")
