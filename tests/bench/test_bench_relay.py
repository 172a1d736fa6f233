"""bench/relay.py's pure parts: its arguments and how a lag row is computed. The
benchmark itself is never run as a test."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from bench import relay as bench


def test_defaults_are_the_issue_s_rates() -> None:
    args = bench.build_parser().parse_args([])
    assert args.rates == [1000, 5000]
    assert (args.seconds, args.repeat) == (10.0, 2)


@pytest.mark.parametrize("text", ["", "0", "1000,-5", "fast", "1e3"])
def test_rates_refuse_what_is_not_positive_integers(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_rates(text)


def test_a_lag_row_counts_every_event_and_takes_its_percentiles() -> None:
    acks = [(f"e-{n}", 100.0 + n / 1000) for n in range(100)]
    arrivals: Any = SimpleNamespace(
        seen={eid: t + (0.050 if n == 99 else 0.002) for n, (eid, t) in enumerate(acks)
              if n != 42},
        duplicates=1)
    arrivals.seen["e-42"] = acks[42][1] + 0.002
    row = bench.lag_row("x", {"acks": acks, "elapsed": 2.0}, arrivals)
    assert (row["events"], row["write_rate"], row["missing"], row["duplicates"]) == (
        100, 50, 0, 1)
    assert row["lag_p50_ms"] == pytest.approx(2.0, abs=0.01)
    assert row["lag_max_ms"] == pytest.approx(50.0, abs=0.01)
