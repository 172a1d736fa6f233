"""docs/security.md names, beside each promise, the test that proves it: every test it
names exists (a renamed or deleted test fails here, not silently in the document).

A name is a backticked ``test_...`` (with or without ``path::`` or a ``[param]``);
a backticked ``tests/...py`` path must be a file.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security.md"


def _defined() -> set[str]:
    """Every test function and method: the suite's, and the store conformance kit's (its
    classes run on every store, ``fleet/kernel/store/conformance*.py``)."""
    names: set[str] = set()
    kit = (ROOT / "fleet" / "kernel" / "store").glob("conformance*.py")
    for path in [*(ROOT / "tests").rglob("*.py"), *kit]:
        names.update(re.findall(r"^\s*(?:async )?def (test_\w+)\(", path.read_text(), re.M))
    return names


def test_every_test_the_security_model_names_exists() -> None:
    text = DOC.read_text()
    cited = re.findall(r"`([^`\s]*test_\w+)(?:\[[^\]]*\])?`", text)
    assert len(cited) >= 20, "security.md cites its tests in backticks"
    defined = _defined()
    missing = sorted({c.rsplit("::", 1)[-1].rsplit("/", 1)[-1] for c in cited
                      if c.rsplit("::", 1)[-1].rsplit("/", 1)[-1].startswith("test_")}
                     - defined)
    assert missing == [], f"docs/security.md names tests that do not exist: {missing}"
    for path in re.findall(r"`(tests/[\w/]+\.py)(?:::\w+)?`", text):
        assert (ROOT / path).is_file(), path
