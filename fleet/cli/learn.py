"""``fleet learn``: trajectories from the logs, offline evaluation, the report and the export.

The commands read the store and call ``fleet.learning``; the figures are the
library's (docs/learning.md): one definition of a decision's reward
(``direct_reward``, or ``terminal_credit`` with ``--reward terminal``), of the
effective sample size, and one default ``--min-ess`` (``DEFAULT_MIN_ESS``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

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
from fleet.learning import (
    DEFAULT_MIN_ESS,
    ESTIMATORS,
    collect_trajectories,
    direct_reward,
    evaluate_policy,
    promotion_gate,
    terminal_credit,
)
from fleet.learning.collect import Collected, collect_evidence
from fleet.learning.comparison import compare_policies, logged_summary
from fleet.learning.evaluation import decision_kinds
from fleet.learning.export import decision_rows, write_csv, write_parquet
from fleet.learning.html_report import render_html

REWARDS = {"direct": direct_reward, "terminal": terminal_credit}


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


def spec_of(target: Any) -> str:
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', target)}"


def guarded(target: Any) -> Callable[[Any, Any, Any], Any]:
    """The user's target policy; an exception it raises is an ``EvaluationError`` naming it."""
    spec = spec_of(target)

    def call(context: Any, choice: Any, alternatives: Any) -> Any:
        try:
            return target(context, choice, alternatives)
        except Exception as exc:  # the user's function: its fault is reported, not a crash
            raise EvaluationError(
                f"{spec} raised {type(exc).__name__}: {exc} for choice {choice!r} "
                f"(context {context!r}); is it the policy of these decisions? "
                "--decision ID chooses them") from exc

    return call


def refuse_mixed_kinds(found: Collected, decision_id: str | None,
                       policy_name: str | None) -> None:
    kinds = decision_kinds(found.trajectories, policy=policy_name, decision_id=decision_id)
    if decision_id is None and policy_name is None and len(kinds) > 1:
        listed = ", ".join(f"{d} (policy {p}, {n})" for (d, p), n in sorted(kinds.items()))
        raise click.UsageError(
            f"the logs hold {len(kinds)} kinds of decision: {listed}; a target policy applies "
            "to one: give --decision ID or --policy-name NAME")


def shown_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for titles and reports)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def evaluation_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options ``learn eval`` and ``learn report`` share."""
    for option in reversed([
        click.option("--decision", "decision_id", default=None,
                     help="evaluate only the decisions with this id (the ctx.decide name)"),
        click.option("--policy-name", default=None,
                     help="evaluate only the decisions this logging policy made"),
        click.option("--db", default=None, help="store URL"),
        snapshots_option,
        click.option("--flow", "flow_id", default=None),
        click.option("--reward", "reward_name", type=click.Choice(sorted(REWARDS)),
                     default="direct", show_default=True,
                     help="direct: the rewards joined to each decision (summed); terminal: "
                          "the execution's terminal reward (terminal_credit)"),
        click.option("--reward-model", default=None, type=CallableSpec(),
                     help="module:function (context, choice) -> expected reward, for dr/sndr "
                          "(default: cell means fitted on the logs, cross-fitted)"),
        click.option("--bootstrap", default=0, show_default=True,
                     help="percentile interval from N resamples (0: the normal interval)"),
        click.option("--seed", default=None, type=int, help="the bootstrap's seed"),
        click.option("--confidence", default=0.95, show_default=True),
        click.option("--min-lift", default=0.0, show_default=True),
        click.option("--min-ess", default=DEFAULT_MIN_ESS, show_default=True,
                     help="the least effective sample size the gate accepts "
                          "(docs/learning.md: why 100)"),
        click.option("--json", "as_json", is_flag=True),
    ]):
        f = option(f)
    return f


@click.group()
def learn() -> None:
    """Learn from logged decisions and their rewards."""


@learn.command("eval")
@click.option("--policy", "target", required=True, type=CallableSpec(),
              help="module:function (context, choice, alternatives) -> probability")
@click.option("--estimator", type=click.Choice(ESTIMATORS), default="snips",
              show_default=True)
@evaluation_options
def learn_eval(target: Any, estimator: str, decision_id: str | None, policy_name: str | None,
               db: str | None, snapshots: str | None, flow_id: str | None, reward_name: str,
               reward_model: Any, bootstrap: int, seed: int | None, confidence: float,
               min_lift: float, min_ess: float, as_json: bool) -> None:
    """Evaluate a target policy offline against the logged decisions it applies to.

    A target policy answers for one kind of decision: with decisions of several
    ids in the logs, say which with --decision (or --policy-name).
    """
    url = read_store_url(db)
    spec = spec_of(target)
    found = collect(url, snapshots, flow_id)
    warn_compacted(found.compacted_unread)
    if estimator not in ("pdis", "snpdis"):
        refuse_mixed_kinds(found, decision_id, policy_name)
    result = evaluate_policy(found.trajectories, guarded(target), estimator=estimator,
                             reward=REWARDS[reward_name], decision_id=decision_id,
                             policy=policy_name, confidence=confidence,
                             reward_model=reward_model, bootstrap=bootstrap, seed=seed)
    gate = promotion_gate(result, min_lift=min_lift, min_ess=min_ess)
    fields = {"policy": spec, "decision": decision_id, "policyName": policy_name,
              "estimator": estimator, "samples": result.samples, "skipped": result.skipped,
              "ips": result.ips, "snips": result.snips, "ess": result.effective_sample_size,
              "logged": result.logged_value, "estimated": result.estimated_value,
              "lift": result.lift, "stdError": result.std_error,
              "ci": list(result.confidence_interval), "interval": result.interval,
              "rewardModel": result.reward_model, "minEss": min_ess,
              "passed": gate.passed, "reasons": list(gate.reasons)}
    if as_json:
        click.echo(json.dumps(fields))
    else:
        which = " ".join(part for part in (
            f"decision {decision_id}" if decision_id else "",
            f"policy {policy_name}" if policy_name else "") if part)
        click.echo(f"{spec} against {which or 'the decisions'} of {found.executions} "
                   f"executions ({estimator})")
        table = Table()
        table.add_column("measure")
        table.add_column("value", justify="right", overflow="fold")
        for name in ("samples", "skipped", "ips", "snips", "ess", "logged", "estimated",
                     "lift"):
            value = fields[name]
            table.add_row(name, f"{value:.4f}" if isinstance(value, float) else str(value))
        low, high = result.confidence_interval
        table.add_row("ci", f"[{low:.4f}, {high:.4f}] ({result.interval})")
        table.add_row("gate", "PASS" if gate.passed else "FAIL: " + "; ".join(gate.reasons))
        console.print(table)
    if not gate.passed:
        sys.exit(1)


@learn.command("report")
@click.option("--policy", "targets", multiple=True, type=CallableSpec(),
              help="a target policy to compare (module:function); repeat for more")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False),
              help="also write the report as a self-contained HTML page here")
@evaluation_options
def learn_report(targets: tuple[Any, ...], html_path: str | None, decision_id: str | None,
                 policy_name: str | None, db: str | None, snapshots: str | None,
                 flow_id: str | None, reward_name: str, reward_model: Any, bootstrap: int,
                 seed: int | None, confidence: float, min_lift: float, min_ess: float,
                 as_json: bool) -> None:
    """Decisions, propensities and logged value per policy; with --policy, each target
    compared under every estimator (IPS, SNIPS, DR, SNDR; PDIS, SNPDIS for flows with
    several decisions), its weights and effective sample size."""
    url = read_store_url(db)
    reward = REWARDS[reward_name]
    found = collect(url, snapshots, flow_id)
    warn_compacted(found.compacted_unread)
    if targets:
        refuse_mixed_kinds(found, decision_id, policy_name)
    compared = compare_policies(
        found.trajectories, {spec_of(t): guarded(t) for t in targets}, reward=reward,
        policy=policy_name, decision_id=decision_id, confidence=confidence,
        reward_model=reward_model, bootstrap=bootstrap, seed=seed, min_lift=min_lift,
        min_ess=min_ess)
    report = {"title": "fleet policy evaluation", "source": shown_url(url),
              "executions": found.executions,
              "policies": logged_summary(found.trajectories, reward=reward),
              "targets": [c.to_dict() for c in compared],
              "filters": {"decision": decision_id, "policy": policy_name, "flow": flow_id,
                          "reward": reward_name},
              "confidence": confidence, "compactedUnread": found.compacted_unread}
    if html_path is not None:
        Path(html_path).write_text(render_html(report), encoding="utf-8")
        click.echo(f"wrote {html_path}", err=True)
    if as_json:
        click.echo(json.dumps(report))
        return
    _print_logged(report, url)
    for c in compared:
        _print_comparison(c.to_dict())


def _print_logged(report: dict[str, Any], url: str) -> None:
    rows = report["policies"]
    table = Table(title=f"{report['executions']} finished executions in {shown_url(url)} "
                        "(logged value: the mean reward of the decisions with a propensity "
                        "and a reward)")
    # A policy's name is copied into --policy-name: never cut.
    id_column(table, "policy", [r["policy"] for r in rows])
    for col in ("version", "decisions", "rewarded", "propensity", "logged value"):
        table.add_column(col, justify="right", no_wrap=True)
    cells = [[r["policy"], r["version"], str(r["decisions"]), str(r["rewarded"]),
              "" if r["mean_propensity"] is None else f"{r['mean_propensity']:.3f}",
              "" if r["logged_value"] is None else f"{r['logged_value']:.4f}"] for r in rows]
    for cell in cells:
        table.add_row(*cell)
    print_fitting(table, cells)


def _print_comparison(c: dict[str, Any]) -> None:
    table = Table(title=f"{c['policy']}")
    for col in ("estimator", "estimate", "interval", "lift", "samples", "ESS"):
        table.add_column(col, justify="left" if col == "estimator" else "right")
    for name, ev in c["estimates"].items():
        low, high = ev["confidence_interval"]
        table.add_row(name, f"{ev['estimated_value']:.4f}", f"[{low:.4f}, {high:.4f}]",
                      f"{ev['lift']:+.4f}", str(ev["samples"]),
                      f"{ev['effective_sample_size']:.1f}")
    for name, why in c["errors"].items():
        table.add_row(name, "n/a", why, "", "", "")
    console.print(table)
    gate = c["gate"]
    if gate is not None:
        console.print(f"gate ({gate['estimator']}): " + (
            "PASS" if gate["passed"] else "FAIL: " + "; ".join(gate["reasons"])),
            markup=False)


@learn.command("export")
@click.option("--format", "fmt", type=click.Choice(["csv", "parquet"]), default="csv",
              show_default=True)
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False),
              help="the file to write ('-' for standard output, CSV only)")
@click.option("--db", default=None, help="store URL")
@snapshots_option
@click.option("--flow", "flow_id", default=None)
@click.option("--discount", default=1.0, show_default=True,
              help="the terminal credit's discount per decision before the end")
@click.option("--json", "as_json", is_flag=True,
              help="print what was written as JSON (with --output -, on standard error)")
def learn_export(fmt: str, output: str, db: str | None, snapshots: str | None,
                 flow_id: str | None, discount: float, as_json: bool) -> None:
    """Write every finished execution's decisions, one row each (propensity, rewards,
    late-reward delay, terminal reward), as CSV or Parquet."""
    url = read_store_url(db)
    if fmt == "parquet" and output == "-":
        raise click.UsageError("Parquet is written to a file: give --output PATH")

    async def go() -> tuple[list[Any], Collected]:
        store = open_reader_at(url)
        snaps = open_snapshots(snapshots or url)
        found = Collected()
        rows: list[Any] = []
        try:
            async for events in collect_evidence(store, snaps, flow_id=flow_id, found=found):
                rows += decision_rows(events, discount=discount)
        finally:
            if snaps is not None:
                await snaps.close()
            await store.close()
        return rows, found

    rows, found = run_async(go)
    warn_compacted(found.compacted_unread)
    if fmt == "parquet":
        written = write_parquet(rows, output)
    elif output == "-":
        written = write_csv(rows, sys.stdout)
    else:
        written = write_csv(rows, output)
    if as_json:
        click.echo(json.dumps({"written": written, "executions": found.executions,
                               "output": output, "format": fmt,
                               "compactedUnread": found.compacted_unread}),
                   err=output == "-")
        return
    click.echo(f"{written} decisions of {found.executions} executions written to "
               f"{'standard output' if output == '-' else output} ({fmt})", err=True)


__all__ = ["collect", "learn", "warn_compacted"]
