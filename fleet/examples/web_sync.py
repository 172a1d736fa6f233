"""A threaded WSGI app submitting executions with the sync API (Flask under waitress).

The common host of a Python web service: a WSGI app served by a pool of
threads (waitress here; gunicorn ``gthread`` and Django's runserver are the
same shape). Every request thread calls the one ``Dispatcher``'s sync twins:
they are safe from any number of threads from the first request (one loop
thread per dispatcher, created once). Run it beside ``fleet worker``::

    export FLEET_DATABASE_URL=postgresql://... FLEET_REDIS_URL=redis://...
    export FLEET_FLOWS=fleet.examples.orders:order
    python -m fleet.examples.web_sync --port 8000 --threads 64

    curl -XPOST localhost:8000/orders -d '{"order_id": "o-1", "amount": 5}'
    curl 'localhost:8000/orders/<execution id>?wait=10'

``POST /orders`` starts one order (the order id is the idempotency key: a
retried request is the same execution); ``POST /orders/batch`` starts a list
in one store round trip and one publish; ``GET /orders/<id>?wait=S`` waits
up to S seconds for the result.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import waitress  # type: ignore[import-untyped]
from flask import Flask, jsonify, request
from flask.typing import ResponseReturnValue

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, Start
from fleet.kernel.errors import FleetError, WaitTimeoutError
from fleet.kernel.security import Principal

FLOW = "web-order"


def principal_of(headers: Any) -> Principal:
    """Who the request acts as (a real app takes it from its own authentication)."""
    return Principal(headers.get("X-User", "web"), tenant=headers.get("X-Tenant", "shop"))


def create_app(dispatcher: Dispatcher) -> Flask:
    """The Flask app, submitting through ``dispatcher`` (shared by every request thread)."""
    app = Flask(__name__)

    @app.errorhandler(FleetError)
    def refused(exc: FleetError) -> ResponseReturnValue:
        status = 503 if exc.retryable else 400
        return jsonify(error=exc.code, message=exc.message), status

    @app.post("/orders")
    def start_order() -> ResponseReturnValue:
        order = request.get_json(force=True)
        execution_id = dispatcher.start_sync(FLOW, order, principal=principal_of(request.headers),
                                             idempotency_key=str(order["order_id"]))
        return jsonify(execution_id=execution_id), 202

    @app.post("/orders/batch")
    def start_orders() -> ResponseReturnValue:
        who = principal_of(request.headers)
        orders = request.get_json(force=True)
        ids = dispatcher.start_many_sync([
            Start(FLOW, order, principal=who, idempotency_key=str(order["order_id"]))
            for order in orders])
        return jsonify(execution_ids=ids), 202

    @app.get("/orders/<execution_id>")
    def order_result(execution_id: str) -> ResponseReturnValue:
        wait = float(request.args.get("wait", "0"))
        try:
            output = dispatcher.result_sync(execution_id, timeout=wait,
                                            principal=principal_of(request.headers))
        except WaitTimeoutError:
            return jsonify(execution_id=execution_id, status="pending"), 202
        return jsonify(execution_id=execution_id, status="completed", output=output)

    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=64)
    args = parser.parse_args(argv)
    with Dispatcher(FleetSettings()) as dispatcher:
        waitress.serve(create_app(dispatcher), host=args.host, port=args.port,
                       threads=args.threads, connection_limit=max(100, 2 * args.threads),
                       ident="fleet-example")


if __name__ == "__main__":
    main()
