"""An ASGI app submitting executions with the async API (Starlette under uvicorn).

The other common host: one event loop serving every request. The app opens
one ``Dispatcher`` in its lifespan and awaits it from the handlers (its store,
its Runtime and its Redis publisher live on that loop; nothing blocks it).
Run it beside ``fleet worker``::

    export FLEET_DATABASE_URL=postgresql://... FLEET_REDIS_URL=redis://...
    export FLEET_FLOWS=fleet.examples.orders:order
    python -m fleet.examples.web_async --port 8001

Same routes as ``fleet.examples.web_sync``: ``POST /orders``, ``POST
/orders/batch``, ``GET /orders/{id}?wait=S``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, Start
from fleet.kernel.errors import FleetError, WaitTimeoutError
from fleet.kernel.security import Principal

FLOW = "web-order"


def principal_of(request: Request) -> Principal:
    """Who the request acts as (a real app takes it from its own authentication)."""
    return Principal(request.headers.get("X-User", "web"),
                     tenant=request.headers.get("X-Tenant", "shop"))


def create_app(settings: FleetSettings | None = None) -> Starlette:
    """The Starlette app; its lifespan opens (and closes) the one Dispatcher."""
    dispatchers: list[Dispatcher] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with Dispatcher(settings or FleetSettings()) as dispatcher:
            dispatchers.append(dispatcher)
            yield

    async def start_order(request: Request) -> JSONResponse:
        order = await request.json()
        execution_id = await dispatchers[0].start(
            FLOW, order, principal=principal_of(request), idempotency_key=str(order["order_id"]))
        return JSONResponse({"execution_id": execution_id}, status_code=202)

    async def start_orders(request: Request) -> JSONResponse:
        who = principal_of(request)
        ids = await dispatchers[0].start_many([
            Start(FLOW, order, principal=who, idempotency_key=str(order["order_id"]))
            for order in await request.json()])
        return JSONResponse({"execution_ids": ids}, status_code=202)

    async def order_result(request: Request) -> JSONResponse:
        execution_id = request.path_params["execution_id"]
        try:
            output = await dispatchers[0].result(
                execution_id, timeout=float(request.query_params.get("wait", "0")),
                principal=principal_of(request))
        except WaitTimeoutError:
            return JSONResponse({"execution_id": execution_id, "status": "pending"}, 202)
        return JSONResponse({"execution_id": execution_id, "status": "completed",
                             "output": output})

    async def refused(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, FleetError)
        return JSONResponse({"error": exc.code, "message": exc.message},
                            status_code=503 if exc.retryable else 400)

    return Starlette(routes=[Route("/orders", start_order, methods=["POST"]),
                             Route("/orders/batch", start_orders, methods=["POST"]),
                             Route("/orders/{execution_id}", order_result, methods=["GET"])],
                     lifespan=lifespan, exception_handlers={FleetError: refused})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
