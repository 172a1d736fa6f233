"""The fleet's two Celery tasks: ``fleet.drive`` and ``fleet.dispatch``.

``fleet.drive(execution_id, flow_id=None, tenant=None)`` drives an execution
to the end of its run (park, complete, fail, abort) before it returns, so the
message is acknowledged (``acks_late``) only once the run stopped; it returns
how the run stopped, in words, which Flower shows as its result
(``completed``, ``parked on approval (gate)``, ``parked on __fleet_diverged__
(diverged: skipped 1: a): ...``, ``fenced out ...``, ``handed back ...``;
``fleet.workers.process.describe``). ``flow_id`` and ``tenant`` route the
message, and show in Flower beside the execution id (the dispatcher fills the
flow in for every drive it publishes).
A drive the worker handed back because it is shutting down (``handed_back``)
publishes a new drive of the execution, on the same route, before it returns
(``requeue_handed_back``): another worker takes it over at once
(``fleet.workers.shutdown``).

``fleet.dispatch(**request)`` is the dispatcher for producers that are not
Python (``fleet.dispatcher.remote``): each message is verified first (its
signature by a client key, its times, its nonce, the key's tenants:
``fleet.dispatcher.signing``); a refusal is answered, counted
(``dispatch_refused`` in the worker's stats) and logged, never retried.

``fleet.drive`` carries no principal and needs no signature because it never
changes an execution's answer: it only drives what the log already holds (a
parked or finished execution is left as it is, a held one steps aside), so a
forged drive is at worst a wasted delivery.
"""

from __future__ import annotations

import logging
from typing import Any

from fleet.dispatcher.dispatcher import Dispatcher
from fleet.dispatcher.remote import handle_dispatch
from fleet.dispatcher.routing import DISPATCH_TASK, DRIVE_TASK
from fleet.dispatcher.signing import DispatchVerifier
from fleet.kernel.errors import StoreUnavailableError
from fleet.workers.process import HANDED_BACK, open_process
from fleet.workers.stats import register_stats_source

log = logging.getLogger("fleet.workers")


def register_tasks(app: Any) -> None:
    """Register ``fleet.drive`` and ``fleet.dispatch`` on ``app``."""

    def drive(execution_id: str, flow_id: str | None = None,
              tenant: str | None = None) -> str:
        outcome = open_process(app.fleet_settings).drive(execution_id)
        if outcome == HANDED_BACK:
            requeue_handed_back(app, execution_id, flow_id, tenant)
        # What Flower shows as the task's result: how the run ended, in words.
        return outcome.detail

    verifiers: list[DispatchVerifier] = []  # one per process, made at the first message

    def dispatch(*args: Any, **kwargs: Any) -> dict[str, Any]:
        process = open_process(app.fleet_settings)
        if not verifiers:
            verifier = DispatchVerifier.from_settings(app.fleet_settings)
            register_stats_source("dispatch", verifier.stats)
            verifiers.append(verifier)
        dispatcher = Dispatcher(runtime=process.runtime, app=app)
        return handle_dispatch(dispatcher, process.loop.run_coroutine, args, kwargs,
                               verifiers[0])

    # A store outage is retried a few times (short countdowns, far below the
    # Redis visibility timeout); after that the recovery sweeper re-drives it.
    # shared=False: the tasks belong to this app only, not to every Celery app the
    # process makes (a producer app, or the user's own, must not run drives).
    app.task(name=DRIVE_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
             autoretry_for=(StoreUnavailableError,), retry_backoff=True, retry_backoff_max=30,
             max_retries=5, shared=False)(drive)
    app.task(name=DISPATCH_TASK, acks_late=True, reject_on_worker_lost=True,
             shared=False)(dispatch)


def requeue_handed_back(app: Any, execution_id: str, flow_id: str | None,
                        tenant: str | None) -> None:
    """Publish a new drive of an execution this worker let go (it is shutting down), on
    its route, so another worker takes it over at once rather than after the lease."""
    try:
        app.send_task(DRIVE_TASK, args=[execution_id],
                      kwargs={"flow_id": flow_id, "tenant": tenant})
    except Exception as exc:  # noqa: BLE001 - the sweeper finds it (no live lease)
        log.warning("could not re-enqueue handed-back %s (%s: %s): the recovery sweeper "
                    "re-drives it after its grace period", execution_id, type(exc).__name__,
                    exc)


__all__ = ["register_tasks", "requeue_handed_back"]
