"""Handing runs back: what a worker that is shutting down does with its runs.

``begin`` lets every run go at its next durable point: from then on a run
stops where it would start new work (a step, a decision, a timer, a
message...): what it committed is written, its lease is released, and whoever
drives the execution next continues from there (the run's outcome is
``handed_back``; the execution stays ``running`` for a caller to re-enqueue, or
for the recovery sweeper to find). A drive started later stops at its first new
work.

``cut`` is the deadline after that: a run still inside a long step is cancelled
where it is. That step is left in doubt, as a crash would leave it (an
idempotent step runs again under the next holder, an ``idempotent=False`` one
parks on the in-doubt gate), but the lease is released at once instead of
expiring. A run whose write was interrupted keeps its lease until it expires
(the write may have landed: decision 0004).
"""

from __future__ import annotations

from collections.abc import Mapping

from fleet.kernel.run import Run


class HandBack:
    """Whether a runtime is letting its runs go, and the two ways it does."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = False

    def begin(self, runs: Mapping[str, Run]) -> int:
        """Let every run go at its next durable point; how many are in flight now."""
        self.active = True
        return len(runs)

    def cut(self, runs: Mapping[str, Run]) -> int:
        """Stop the runs still in flight where they are; how many were cancelled."""
        self.active = True
        cut = 0
        for run in list(runs.values()):
            if run.task is not None and not run.task.done():
                run.stop = "cut"
                run.task.cancel()
                cut += 1
        return cut
