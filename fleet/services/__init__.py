"""The fleet's long-running services and what watches them.

* ``base``: the ``Service`` protocol (start/stop, ``requires``, ``stats``),
  ``PeriodicService``, ``start_order`` and ``run_services`` (until SIGTERM).
* ``health``: the ``Heartbeat`` every fleet process runs on its event loop, and
  the checks ``fleet health`` runs (liveness, readiness).
* ``status``: what ``fleet status`` reads (executions by state, workers' counters).

The timer service (``fleet.timers``), the recovery sweeper (``fleet.recovery``)
and the stream services (``fleet.streams``) are ``Service`` s; which of them a
process runs is decided in ``fleet.assembly.roles``.
"""

from fleet.services.base import PeriodicService, Service, run_services, start_order

__all__ = ["PeriodicService", "Service", "run_services", "start_order"]
