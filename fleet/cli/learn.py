"""``fleet learn``: trajectories from the logs, and offline evaluation of a policy."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.table import Table

from fleet.cli.common import (
    console,
    load_callable,
    open_snapshots,
    open_store_at,
    run_async,
    snapshots_option,
    store_url,
)
from fleet.kernel.errors import FleetError
from fleet.learning import collect_trajectories, evaluate_policy, promotion_gate


def collect(url: str, snapshots: str | None, flow_id: str | None) -> Any:
    """Every finished execution's trajectories (checkpoints read when a snapshot store is set)."""
    async def go() -> Any:
        store = open_store_at(url)
        snaps = open_snapshots(snapshots or url)
        try:
            return await collect_trajectories(store, snaps, flow_id=flow_id)
        finally:
            if snaps is not None:
                await snaps.close()
            await store.close()

    return run_async(go)


def warn_compacted(ids: list[str]) -> None:
    if ids:
        shown = ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else "")
        click.echo(f"warning: {len(ids)} execution(s) look compacted and were not read "
                   f"(configure --snapshots): {shown}", err=True)


@click.group()
def learn() -> None:
    """Learn from logged decisions and their rewards."""


@learn.command("report")
@click.option("--db", default=None, help="store URL")
@snapshots_option
@click.option("--flow", "flow_id", default=None)
@click.option("--json", "as_json", is_flag=True)
def learn_report(db: str | None, snapshots: str | None, flow_id: str | None,
                 as_json: bool) -> None:
    """Decisions, propensities and joined rewards per policy."""
    url = store_url(db)

    found = collect(url, snapshots, flow_id)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for path in found.trajectories:
        for d in path.decisions:
            key = (str(d.policy_name), str(d.policy_version))
            row = rows.setdefault(key, {"policy": key[0], "version": key[1], "decisions": 0,
                                        "rewarded": 0, "reward_sum": 0.0, "propensity_sum": 0.0})
            row["decisions"] += 1
            row["propensity_sum"] += d.propensity or 0.0
            scores = [r.score for r in d.rewards if r.score is not None]
            if scores:
                row["rewarded"] += 1
                row["reward_sum"] += sum(scores) / len(scores)
    report = [{"policy": r["policy"], "version": r["version"], "decisions": r["decisions"],
               "rewarded": r["rewarded"],
               "mean_propensity": r["propensity_sum"] / r["decisions"],
               "mean_reward": (r["reward_sum"] / r["rewarded"]) if r["rewarded"] else None}
              for r in rows.values()]
    warn_compacted(found.compacted_unread)
    if as_json:
        click.echo(json.dumps({"executions": found.executions, "policies": report,
                               "compactedUnread": found.compacted_unread}))
        return
    table = Table(title=f"{found.executions} finished executions in {url}")
    for col in ("policy", "version", "decisions", "rewarded", "mean propensity",
                "mean reward"):
        table.add_column(col)
    for r in report:
        table.add_row(r["policy"], r["version"], str(r["decisions"]), str(r["rewarded"]),
                      f"{r['mean_propensity']:.3f}",
                      "" if r["mean_reward"] is None else f"{r['mean_reward']:.3f}")
    console.print(table)


@learn.command("eval")
@click.option("--policy", "policy_spec", required=True,
              help="module:function (context, choice, alternatives) -> probability")
@click.option("--db", default=None, help="store URL")
@snapshots_option
@click.option("--flow", "flow_id", default=None)
@click.option("--min-lift", default=0.0, show_default=True)
@click.option("--min-ess", default=30.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def learn_eval(policy_spec: str, db: str | None, snapshots: str | None, flow_id: str | None,
               min_lift: float, min_ess: float, as_json: bool) -> None:
    """Evaluate a target policy offline (IPS/SNIPS) against the logged decisions."""
    url = store_url(db)
    target = load_callable(policy_spec)

    found = collect(url, snapshots, flow_id)
    warn_compacted(found.compacted_unread)
    try:
        result = evaluate_policy(found.trajectories, target)
    except FleetError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
    gate = promotion_gate(result, min_lift=min_lift, min_ess=min_ess)
    fields = {"samples": result.samples, "ips": result.ips, "snips": result.snips,
              "ess": result.effective_sample_size, "logged": result.logged_value,
              "estimated": result.estimated_value, "lift": result.lift,
              "ci": list(result.confidence_interval), "passed": gate.passed,
              "reasons": list(gate.reasons)}
    if as_json:
        click.echo(json.dumps(fields))
    else:
        table = Table(title=f"{policy_spec} against {found.executions} executions")
        table.add_column("measure")
        table.add_column("value", justify="right")
        for name in ("samples", "ips", "snips", "ess", "logged", "estimated", "lift"):
            value = fields[name]
            table.add_row(name, f"{value:.4f}" if isinstance(value, float) else str(value))
        low, high = result.confidence_interval
        table.add_row("ci", f"[{low:.4f}, {high:.4f}]")
        table.add_row("gate", "PASS" if gate.passed else "FAIL: " + "; ".join(gate.reasons))
        console.print(table)
    if not gate.passed:
        sys.exit(1)


__all__ = ["collect", "learn", "warn_compacted"]
