"""The fleet's workers: the Celery app, the drive task, the per-process loop, Flower stats.

Run a worker with ``celery -A fleet.workers.main worker`` (settings from
``FLEET_*``); ``make_app(settings)`` builds the same app in code.
"""

from fleet.workers.app import FleetCelery, make_app
from fleet.workers.loop import EventLoopThread, refuse_inside_loop
from fleet.workers.process import WorkerProcess, local_process
from fleet.workers.stats import FleetStatsStep, register_stats_source, unregister_stats_source

__all__ = ["EventLoopThread", "FleetCelery", "FleetStatsStep", "WorkerProcess",
           "local_process", "make_app", "refuse_inside_loop", "register_stats_source",
           "unregister_stats_source"]
