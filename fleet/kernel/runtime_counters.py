"""The runtime's counters as read-only attributes (``runtime.completed``...).

``RuntimeStats`` holds them (``runtime.stats``); ``Runtime`` takes this mixin so
each reads as an attribute of its own, as it did before ``RuntimeStats``.
"""

from __future__ import annotations

from fleet.kernel.options import RuntimeStats


class StatsAttributes:
    """Each ``RuntimeStats`` counter as a read-only attribute of the runtime."""

    stats: RuntimeStats

    @property
    def drives(self) -> int:
        return self.stats.drives

    @property
    def completed(self) -> int:
        return self.stats.completed

    @property
    def failed(self) -> int:
        return self.stats.failed

    @property
    def parked(self) -> int:
        return self.stats.parked

    @property
    def aborted(self) -> int:
        return self.stats.aborted

    @property
    def recovered(self) -> int:
        return self.stats.recovered

    @property
    def denied(self) -> int:
        return self.stats.denied

    @property
    def timers_fired(self) -> int:
        return self.stats.timers_fired

    @property
    def divergence_warnings(self) -> int:
        return self.stats.divergence_warnings

    @property
    def divergence_parked(self) -> int:
        return self.stats.divergence_parked

    @property
    def handed_back(self) -> int:
        return self.stats.handed_back

    @property
    def refused(self) -> int:
        return self.stats.refused

    @property
    def cancelled(self) -> int:
        return self.stats.cancelled


__all__ = ["StatsAttributes"]
