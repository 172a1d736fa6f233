"""``fleet health``: the probe Kubernetes runs in every fleet pod, every few seconds.

It imports no more than the checks need (no Celery app), so it stays fast.
"""

from __future__ import annotations

import json
import sys

import click

from fleet.cli.common import echo, json_option
from fleet.config import FleetSettings
from fleet.services.health import COMPONENTS, check_health


@click.command()
@click.option("--component", required=True,
              type=click.Choice(list(COMPONENTS)))
@click.option("--liveness", is_flag=True,
              help="only the process's event loop (its heartbeat), not the broker or store")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="seconds for each of the broker and store checks")
@click.option("--max-age", type=click.FloatRange(min=0.1), default=None,
              help="oldest heartbeat that passes (default: FLEET_HEARTBEAT_MAX_AGE_S)")
@json_option
def health(component: str, liveness: bool, timeout: float, max_age: float | None,
           as_json: bool) -> None:
    """Exit 0 when this machine's COMPONENT is healthy, else 1 with the reason.

    Readiness (the default): the event loop's heartbeat, a broker ping and a
    store read. --liveness: the heartbeat only.
    """
    report = check_health(FleetSettings(), component, liveness=liveness, timeout_s=timeout,
                          max_age_s=max_age)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    elif report.ok:
        echo(f"ok: {component}: {report.reason}")
    else:
        echo(f"unhealthy: {component}: {report.reason}", err=True)
    if not report.ok:
        sys.exit(1)


__all__ = ["health"]
