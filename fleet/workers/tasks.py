"""The fleet's Celery tasks: ``fleet.drive``, ``fleet.drives`` and ``fleet.dispatch``.

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

``fleet.drives(execution_ids, flow_id=None, tenant=None)`` is the same for
several executions of one route, published together (decision 0030): the
worker drives them at once on its loop (at most ``worker_drives`` runs at once
per process) and returns how each stopped, in words (``"<id>: completed"``,
``"<id>: parked on approval (gate)"``...); the message is acknowledged when
all stopped. Only the drives a store outage stopped are retried. A message
whose ids are not a list of 1 to ``MAX_BATCH`` strings is refused
(``["refused"]``, logged, not retried).

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
from fleet.dispatcher.routing import DISPATCH_TASK, DRIVE_TASK, DRIVES_TASK
from fleet.host.celery_api import get_exponential_backoff_interval
from fleet.host.tracing import TRACE_HEADER
from fleet.kernel.errors import StoreUnavailableError
from fleet.workers import reservation
from fleet.workers.process import HANDED_BACK, REFUSED, DriveResult, open_process

log = logging.getLogger("fleet.workers")


def register_tasks(app: Any) -> None:
    """Register ``fleet.drive``, ``fleet.drives`` and ``fleet.dispatch`` on ``app``."""

    def drive(execution_id: str, flow_id: str | None = None,
              tenant: str | None = None) -> str:
        outcome = open_process(app.fleet_settings).drive(
            execution_id, traces=message_traces(app.current_task.request))
        if outcome == HANDED_BACK:
            requeue_handed_back(app, execution_id, flow_id, tenant)
        # What Flower shows as the task's result: how the run ended, in words.
        return outcome.detail

    def drives(task: Any, execution_ids: Any, flow_id: str | None = None,
               tenant: str | None = None) -> list[str]:
        ids = check_batch(execution_ids)
        if ids is None:
            log.error("fleet.drives refused: execution_ids must be a list of 1 to %d ids "
                      "(strings); got %s", MAX_BATCH, _describe(execution_ids))
            return [REFUSED]
        request_id = task.request.id
        outcomes = open_process(app.fleet_settings).drive_many(
            ids, traces=message_traces(task.request),
            on_done=lambda: reservation.finished(request_id))
        failed = [i for i, o in zip(ids, outcomes, strict=True)
                  if isinstance(o, StoreUnavailableError)]
        for execution_id, outcome in zip(ids, outcomes, strict=True):
            if outcome == HANDED_BACK:
                requeue_handed_back(app, execution_id, flow_id, tenant)
        if failed:
            # Only the drives the store outage stopped are retried, as drive() is.
            exc = next(o for o in outcomes if isinstance(o, StoreUnavailableError))
            if task.request.retries >= task.max_retries:
                raise exc
            countdown = get_exponential_backoff_interval(
                factor=1, retries=task.request.retries, maximum=30, full_jitter=True)
            raise task.retry(args=[failed], kwargs={"flow_id": flow_id, "tenant": tenant},
                             exc=exc, countdown=countdown)
        # What Flower shows as the task's result: each execution and how its run ended.
        return [f"{execution_id}: {describe_result(outcome)}"
                for execution_id, outcome in zip(ids, outcomes, strict=True)]

    def dispatch(*args: Any, **kwargs: Any) -> dict[str, Any]:
        process = open_process(app.fleet_settings)
        dispatcher = Dispatcher(runtime=process.runtime, app=app)
        # The process's verifier: its key file watched (unreadable: nothing accepted).
        return handle_dispatch(dispatcher, process.loop.run_coroutine, args, kwargs,
                               process.verifier)

    # A store outage is retried a few times (short countdowns, far below the
    # Redis visibility timeout); after that the recovery sweeper re-drives it.
    # shared=False: the tasks belong to this app only, not to every Celery app the
    # process makes (a producer app, or the user's own, must not run drives).
    app.task(name=DRIVE_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
             autoretry_for=(StoreUnavailableError,), retry_backoff=True, retry_backoff_max=30,
             max_retries=5, shared=False)(drive)
    app.task(name=DRIVES_TASK, bind=True, acks_late=True, reject_on_worker_lost=True,
             ignore_result=True, max_retries=5, shared=False)(drives)
    app.task(name=DISPATCH_TASK, acks_late=True, reject_on_worker_lost=True,
             shared=False)(dispatch)


#: The most ids a ``fleet.drives`` message may carry (``FLEET_DRIVE_BATCH``'s bound).
MAX_BATCH = 256
_MAX_ID = 1024


def check_batch(execution_ids: Any) -> list[str] | None:
    """The ids of a ``fleet.drives`` message, or None when they are not a list of 1 to
    ``MAX_BATCH`` non-empty strings (a forged or mangled message: refused, not retried).
    The bound is not this worker's ``drive_batch``: a dispatcher configured with a
    larger one is still served."""
    if not isinstance(execution_ids, list) or not 1 <= len(execution_ids) <= MAX_BATCH:
        return None
    if not all(isinstance(i, str) and 0 < len(i) <= _MAX_ID for i in execution_ids):
        return None
    return list(dict.fromkeys(execution_ids))  # one drive per execution


def message_traces(request: Any) -> dict[str, str]:
    """The traceparent of each execution a drive message carries (``fleet_trace``,
    ``fleet.host.tracing``); {} when it carries none or something else."""
    found = getattr(request, TRACE_HEADER, None) if request is not None else None
    if not isinstance(found, dict):
        return {}
    return {k: v for k, v in found.items()
            if isinstance(k, str) and isinstance(v, str) and len(v) <= 128}


def describe_result(outcome: object) -> str:
    """A drive's answer in words (``DriveResult.detail``), whatever the answer's type."""
    return outcome.detail if isinstance(outcome, DriveResult) else str(outcome)


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return type(value).__name__


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


__all__ = ["MAX_BATCH", "check_batch", "register_tasks", "requeue_handed_back"]
