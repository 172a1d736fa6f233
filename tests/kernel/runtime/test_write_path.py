"""The one write path on memory and SQLite (issue 11 item 1, issue 13 item 1, ADR 0116
round 3 A, ADR 0147); the same cases on Postgres: ``tests/integration/
test_write_path_postgres.py``. The cases are in ``tests/kits/write_path_cases.py``."""

from __future__ import annotations

import re
from pathlib import Path

from write_path_cases import *  # noqa: F403 - the cases, run here on memory and SQLite

import fleet


def test_no_kernel_code_appends_outside_the_write_path() -> None:
    """``grep``, as a test: only fleet/kernel/writes.py calls a store's appends
    (the stores and their decorators implement them)."""
    root = Path(fleet.__file__).parent
    pattern = re.compile(r"store\.append\b|\.append_batch\(|\.append_if_unchanged\(")
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("kernel/store/") or rel == "kernel/writes.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == []


def test_no_kernel_code_releases_a_fence_outside_the_lease() -> None:
    root = Path(fleet.__file__).parent
    offenders = [f"{p.relative_to(root)}" for p in sorted(root.rglob("*.py"))
                 if "release_fence(" in p.read_text()
                 and not p.relative_to(root).as_posix().startswith("kernel/store/")
                 and p.relative_to(root).as_posix() != "kernel/lease.py"]
    assert offenders == []


