"""``fleet learn``: trajectories from the logs, and offline evaluation of a policy."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.table import Table

from fleet.cli.common import (
    CallableSpec,
    console,
    id_column,
    open_reader_at,
    open_snapshots,
    print_fitting,
    read_store_url,
    run_async,
    snapshots_option,
)
from fleet.kernel.errors import EvaluationError
from fleet.learning import collect_trajectories, evaluate_policy, promotion_gate
from fleet.learning.evaluation import decision_kinds


def collect(url: str, snapshots: str | None, flow_id: str | None) -> Any:
    """Every finished execution's trajectories (checkpoints read when a snapshot store is set)."""
    async def go() -> Any:
        store = open_reader_at(url)
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
    url = read_store_url(db)

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
    table = Table(title=f"{found.executions} finished executions in {url} (propensity and "
                        "reward: means)")
    # A policy's name is copied into --policy-name: never cut.
    id_column(table, "policy", [r["policy"] for r in report])
    for col in ("version", "decisions", "rewarded", "propensity", "reward"):
        table.add_column(col, justify="right", no_wrap=True)
    cells = [[r["policy"], r["version"], str(r["decisions"]), str(r["rewarded"]),
              f"{r['mean_propensity']:.3f}",
              "" if r["mean_reward"] is None else f"{r['mean_reward']:.3f}"] for r in report]
    for cell in cells:
        table.add_row(*cell)
    print_fitting(table, cells)


@learn.command("eval")
@click.option("--policy", "target", required=True, type=CallableSpec(),
              help="module:function (context, choice, alternatives) -> probability")
@click.option("--decision", "decision_id", default=None,
              help="evaluate only the decisions with this id (the ctx.decide name)")
@click.option("--policy-name", default=None,
              help="evaluate only the decisions this logging policy made")
@click.option("--db", default=None, help="store URL")
@snapshots_option
@click.option("--flow", "flow_id", default=None)
@click.option("--min-lift", default=0.0, show_default=True)
@click.option("--min-ess", default=30.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def learn_eval(target: Any, decision_id: str | None, policy_name: str | None, db: str | None,
               snapshots: str | None, flow_id: str | None, min_lift: float, min_ess: float,
               as_json: bool) -> None:
    """Evaluate a target policy offline (IPS/SNIPS) against the logged decisions it
    applies to.

    A target policy answers for one kind of decision: with decisions of several
    ids in the logs, say which with --decision (or --policy-name).
    """
    url = read_store_url(db)
    spec = f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', target)}"
    found = collect(url, snapshots, flow_id)
    warn_compacted(found.compacted_unread)
    kinds = decision_kinds(found.trajectories, policy=policy_name, decision_id=decision_id)
    if decision_id is None and policy_name is None and len(kinds) > 1:
        listed = ", ".join(f"{d} (policy {p}, {n})" for (d, p), n in sorted(kinds.items()))
        raise click.UsageError(
            f"the logs hold {len(kinds)} kinds of decision: {listed}; a target policy applies "
            "to one: give --decision ID or --policy-name NAME")

    def guarded(context: Any, choice: Any, alternatives: Any) -> Any:
        try:
            return target(context, choice, alternatives)
        except Exception as exc:  # the user's function: its fault is reported, not a crash
            raise EvaluationError(
                f"{spec} raised {type(exc).__name__}: {exc} for choice {choice!r} "
                f"(context {context!r}); is it the policy of these decisions? "
                "--decision ID chooses them") from exc

    result = evaluate_policy(found.trajectories, guarded, decision_id=decision_id,
                             policy=policy_name)
    gate = promotion_gate(result, min_lift=min_lift, min_ess=min_ess)
    fields = {"policy": spec, "decision": decision_id, "policyName": policy_name,
              "samples": result.samples, "skipped": result.skipped, "ips": result.ips,
              "snips": result.snips, "ess": result.effective_sample_size,
              "logged": result.logged_value, "estimated": result.estimated_value,
              "lift": result.lift, "ci": list(result.confidence_interval),
              "passed": gate.passed, "reasons": list(gate.reasons)}
    if as_json:
        click.echo(json.dumps(fields))
    else:
        which = " ".join(part for part in (
            f"decision {decision_id}" if decision_id else "",
            f"policy {policy_name}" if policy_name else "") if part)
        click.echo(f"{spec} against {which or 'the decisions'} of {found.executions} "
                   "executions")
        table = Table()
        table.add_column("measure")
        table.add_column("value", justify="right", overflow="fold")
        for name in ("samples", "skipped", "ips", "snips", "ess", "logged", "estimated",
                     "lift"):
            value = fields[name]
            table.add_row(name, f"{value:.4f}" if isinstance(value, float) else str(value))
        low, high = result.confidence_interval
        table.add_row("ci", f"[{low:.4f}, {high:.4f}]")
        table.add_row("gate", "PASS" if gate.passed else "FAIL: " + "; ".join(gate.reasons))
        console.print(table)
    if not gate.passed:
        sys.exit(1)


__all__ = ["collect", "learn", "warn_compacted"]
