"""The fleet's workers: the Celery app, the drive task, the per-process loop, Flower stats.

Run a worker with ``fleet worker`` or ``celery -A fleet.workers.main worker``
(settings from ``FLEET_*``); ``make_app(settings)`` builds the same app in code.
"""

from fleet.dispatcher.broker import FleetCelery
from fleet.host.loop import EventLoopThread, refuse_inside_loop
from fleet.workers.app import make_app
from fleet.workers.bootstep import FleetStatsStep
from fleet.workers.process import WorkerProcess, local_process
from fleet.workers.run import run_worker
from fleet.workers.stats import register_stats_source, unregister_stats_source

__all__ = ["EventLoopThread", "FleetCelery", "FleetStatsStep", "WorkerProcess",
           "local_process", "make_app", "refuse_inside_loop", "register_stats_source",
           "run_worker", "unregister_stats_source"]
