"""A ``fleet`` command whose process runs with its wall clock skewed (issue 25 item 9).

    python -m skewed_clock <ms> <fleet arguments...>

``time.time`` and ``time.time_ns`` (what ``fleet.kernel.events.wall_clock_ms`` and
Celery read) return the real time plus ``ms`` (negative: behind); the monotonic
clocks are untouched, as on a host whose NTP is off. ``fleet_procs_kit.Proc`` runs a
process this way when given ``skew_ms``.
"""

from __future__ import annotations

import sys
import time


def skew(ms: int) -> None:
    """From now on this process's wall clock reads ``ms`` ahead of the real one."""
    real_ns, real = time.time_ns, time.time
    time.time_ns = lambda: real_ns() + ms * 1_000_000
    time.time = lambda: real() + ms / 1000


if __name__ == "__main__":
    skew(int(sys.argv[1]))
    sys.argv = ["fleet", *sys.argv[2:]]
    from fleet.cli import main

    main()
