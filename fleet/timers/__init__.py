"""The timer service: due timers -> ``TIMER_FIRED`` -> a drive (``fleet.timers.service``)."""

from fleet.timers.service import Enqueue, TimerService

__all__ = ["Enqueue", "TimerService"]
