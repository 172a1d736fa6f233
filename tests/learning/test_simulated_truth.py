"""Every estimator on simulated logs whose truth is known (issue 30 item 2).

``fleet.learning.simulation.study`` draws 400 independent logs of a 3-arm
bandit (500 decisions each, and 60 for a low effective sample size) and of a
two-decision flow with a terminal reward (600 executions each), seeds 0-399,
and evaluates each with every estimator at a nominal 90% (not 95%: 95 + 5
would be 100, and a too-wide interval must fail as surely as a too-narrow
one). The figures are deterministic; over 400 replications a coverage has a
binomial standard error of 1.5 points, so the +-5 band is some 3 of them.
docs/learning.md shows the same table, checked here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.learning.simulation import BANDIT, FLOW, Row, study, table

ROOT = Path(__file__).resolve().parents[2]
NOMINAL = 0.90

# The study costs some 25 s of CPU (plain Python, 400 seeds x 16 estimates); on a
# machine shared with other work its wall time can pass the suite's 60 s per test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    return study()


def _row(rows: list[Row], world: str, label: str, n: int | None = None) -> Row:
    [found] = [r for r in rows if r.world == world and r.label == label
               and (n is None or r.n == n)]
    return found


@pytest.mark.parametrize(("world", "label"), [
    ("3-arm bandit", "IPS"), ("3-arm bandit", "SNIPS"),
    ("3-arm bandit", "SNIPS, bootstrap 200"), ("3-arm bandit", "DR, right model"),
    ("3-arm bandit", "SNDR, right model"), ("3-arm bandit", "DR, fitted model (cross-fitted)"),
    ("3-arm bandit", "SNDR, fitted model (cross-fitted)"),
    ("3-arm bandit", "DR, model off by +0.3"), ("3-arm bandit", "SNDR, model reversed"),
    ("2-decision flow", "PDIS"), ("2-decision flow", "SNPDIS"),
    ("2-decision flow", "SNPDIS, bootstrap 200"),
])
def test_intervals_cover_the_truth_at_their_nominal_rate(rows: list[Row], world: str,
                                                        label: str) -> None:
    row = _row(rows, world, label, 600 if world == "2-decision flow" else 500)
    assert row.replications == 400
    assert NOMINAL - 0.05 <= row.coverage <= NOMINAL + 0.05, row
    assert row.ess >= 100  # the default min_ess: where the intervals are to be trusted


def test_the_truths_are_what_the_worlds_say() -> None:
    # Each segment's best arm with 0.8, the others 0.1 each.
    startup, smb, enterprise = (0.8 * 0.35 + 0.1 * (0.15 + 0.25), 0.8 * 0.60 + 0.1 * 0.75,
                                0.8 * 0.85 + 0.1 * 1.20)
    assert BANDIT.truth() == pytest.approx(0.5 * startup + 0.3 * smb + 0.2 * enterprise)
    # new: demo (0.7), then 10% (0.6); returning: trial (0.7), then 20% (0.6).
    new = (0.7 * (0.6 * 0.55 + 0.2 * (0.35 + 0.50))
           + 0.3 * (0.6 * 0.35 + 0.2 * (0.20 + 0.30)))
    returning = (0.7 * (0.6 * 0.70 + 0.2 * (0.50 + 0.55))
                 + 0.3 * (0.6 * 0.45 + 0.2 * (0.40 + 0.45)))
    assert FLOW.truth() == pytest.approx(0.6 * new + 0.4 * returning)


def test_dr_with_the_right_model_beats_snips(rows: list[Row]) -> None:
    snips = _row(rows, "3-arm bandit", "SNIPS", 500)
    for label in ("DR, right model", "DR, fitted model (cross-fitted)"):
        dr = _row(rows, "3-arm bandit", label, 500)
        assert dr.rmse < 0.8 * snips.rmse, (dr, snips)
        assert dr.width < snips.width


def test_a_wrong_model_hurts_plain_dr_and_self_normalising_helps(rows: list[Row]) -> None:
    snips = _row(rows, "3-arm bandit", "SNIPS", 500)
    right = _row(rows, "3-arm bandit", "SNDR, right model", 500)
    dr_off = _row(rows, "3-arm bandit", "DR, model off by +0.3", 500)
    sndr_off = _row(rows, "3-arm bandit", "SNDR, model off by +0.3", 500)
    # A miscalibrated model: plain DR far worse than SNIPS; SNDR cancels the offset.
    assert dr_off.rmse > 1.4 * snips.rmse
    assert sndr_off.rmse == pytest.approx(right.rmse, rel=1e-6)
    # Preferences reversed: neither DR beats SNIPS (trust SNIPS over a doubtful model).
    for label in ("DR, model reversed", "SNDR, model reversed"):
        assert _row(rows, "3-arm bandit", label, 500).rmse > snips.rmse


def test_pdis_self_normalised_is_steadier_on_the_flow(rows: list[Row]) -> None:
    pdis = _row(rows, "2-decision flow", "PDIS")
    snpdis = _row(rows, "2-decision flow", "SNPDIS")
    assert snpdis.rmse < pdis.rmse
    assert abs(pdis.bias) < 0.01  # unbiased: what remains is the simulation's noise


def test_a_low_effective_sample_size_gives_intervals_too_narrow(rows: list[Row]) -> None:
    # Why the gate asks for an ESS of 100: at 18 the nominal 90% holds less often.
    small = _row(rows, "3-arm bandit", "SNIPS", 60)
    large = _row(rows, "3-arm bandit", "SNIPS", 500)
    assert small.ess < 30
    assert small.coverage < large.coverage


def test_the_docs_show_these_figures(rows: list[Row]) -> None:
    guide = (ROOT / "docs" / "learning.md").read_text()
    assert table(rows) in guide, (
        "docs/learning.md's simulation table is not what fleet.learning.simulation.study() "
        "measures now; paste this:\n" + table(rows))
