"""``fleet learn report --html`` in a real browser: headless Chromium opens the page from a
file, offline, and draws the intervals and the weights (issue 30 item 3).
FLEET_UPDATE_SCREENSHOT=1 also writes the screenshot to docs/learn-report.png."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from chromium_kit import chromium, png_pixels

from fleet.learning.comparison import compare_policies, logged_summary
from fleet.learning.html_report import COLOURS, render_html
from fleet.learning.simulation import BANDIT


def _uniform(context: Any, choice: Any, alternatives: Any) -> float:
    return 1 / 3


@pytest.mark.integration
def test_chromium_renders_the_report_page_offline(tmp_path: Path) -> None:
    paths = BANDIT.logs(400, seed=11)
    targets = {"fleet.learning.simulation:BANDIT.target": BANDIT.target,
               "tests:uniform": _uniform}
    report = {"title": "fleet policy evaluation", "source": "fleet.learning.simulation (seed 11)",
              "executions": 400,
              "policies": logged_summary(paths),
              "targets": [c.to_dict() for c in compare_policies(paths, targets)],
              "filters": {}, "confidence": 0.95, "compactedUnread": []}
    page = tmp_path / "report.html"
    page.write_text(render_html(report))
    (tmp_path / "report.json").write_text(json.dumps(report))
    url = page.as_uri()
    # No network: a page that fetched anything would render without it here.
    dom = chromium("--dump-dom", "--proxy-server=127.0.0.1:9", url)
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-2000:]
    html = dom.stdout.decode()
    assert html.count('data-estimator="snips"') == 2  # one line per policy compared
    assert "tests:uniform" in html
    shot = tmp_path / "report.png"
    done = chromium(f"--screenshot={shot}", "--window-size=1280,1400",
                    "--proxy-server=127.0.0.1:9", url)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    width, height, pixels = png_pixels(shot.read_bytes())
    assert (width, height) == (1280, 1400)

    def count(colour: str) -> int:
        r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
        return sum(1 for p in pixels if abs(p[0] - r) < 8 and abs(p[1] - g) < 8
                   and abs(p[2] - b) < 8)

    # Every estimator's interval is drawn in its colour; the weight bars in SNIPS blue.
    for estimator in ("ips", "snips", "dr", "sndr"):
        assert count(COLOURS[estimator]) > 200, estimator
    assert count(COLOURS["snips"]) > 3000  # the histograms' bars too
    assert len(set(pixels[::97])) > 20  # a page, not a blank or an error screen
    if os.environ.get("FLEET_UPDATE_SCREENSHOT") == "1":  # the picture docs/learning.md shows
        shutil.copyfile(shot, Path(__file__).resolve().parents[2] / "docs" / "learn-report.png")
