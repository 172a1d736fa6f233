"""``fleet outcome attach``: a late outcome, recorded through the kernel here."""

from __future__ import annotations

import json
from typing import Any

import click

from fleet.cli.common import (
    execution_id_argument,
    open_store_at,
    require_database,
    run_async,
    success_from,
    success_options,
    the_execution_id,
    with_options,
)
from fleet.config import FleetSettings
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import Principal


@click.group()
def outcome() -> None:
    """Attach rewards to decisions of finished executions."""


@outcome.command("attach")
@execution_id_argument
@click.option("--decision", "decision_id", required=True)
@click.option("--key", required=True, help="a namespaced reward key, e.g. csat:1")
@click.option("--score", type=float, default=None)
@with_options(success_options)
@click.option("--actor", default=None, help="who attaches it (the principal's actor)")
@click.option("--tenant", default=None)
@click.option("--db", default=None, help="store URL")
@click.option("--json", "as_json", is_flag=True)
def outcome_attach(execution_id: str | None, execution_option: str | None, decision_id: str,
                   key: str, score: float | None, success: bool | None, failure: bool,
                   actor: str | None, tenant: str | None, db: str | None,
                   as_json: bool) -> None:
    """Record a late outcome on EXECUTION_ID (authorised as `annotate` for --actor/--tenant)."""
    eid = the_execution_id(execution_id, execution_option)
    success = success_from(success, failure)
    settings = FleetSettings()
    url = require_database(db or settings.database_url)
    principal = Principal(actor, tenant) if actor else None

    async def go() -> Any:
        store = open_store_at(url)
        try:
            runtime = Runtime(store, strict=settings.strict)
            return await runtime.record_outcome(eid, decision_id=decision_id,
                                                key=key, score=score, success=success,
                                                principal=principal)
        finally:
            await store.close()

    result = run_async(go)
    if as_json:
        click.echo(json.dumps({"appended": result.appended, "sequence": result.sequence}))
    elif result.appended:
        click.echo(f"attached at sequence {result.sequence}")
    else:
        click.echo("already attached (same value): nothing written")


__all__ = ["outcome"]
