"""``fleet up`` and ``fleet demo``: the embedded fleet from the command line.

They parse arguments and call ``fleet.embedded.EmbeddedFleet`` and
``fleet.examples.demo.run_demo``; what they print is rendered here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from fleet.cli.common import console, err_console, plain, terminal_safe
from fleet.embedded import EmbeddedFleet
from fleet.embedded.children import redact
from fleet.embedded.finished import TRANSIENT, FinishedWatcher
from fleet.examples.demo import DemoOptions, NullReporter, Reporter, run_demo
from fleet.host.loop import run_loop
from fleet.kernel.errors import FleetError


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    return table


class RichReporter:
    """Each stage as a table, each wait as a progress bar (gone when it ends)."""

    def __init__(self, out: Console) -> None:
        self.out = out

    def stage(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.out.print(_table(title, columns, rows))

    @contextlib.contextmanager
    def waiting(self, label: str, total: int) -> Iterator[Any]:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                      MofNCompleteColumn(), TextColumn("{task.fields[note]}"),
                      TimeElapsedColumn(), console=self.out, transient=True) as progress:
            task = progress.add_task(label, total=total, note="")

            def update(done: int, note: str) -> None:
                progress.update(task, completed=min(done, total), note=note)

            yield update


# --------------------------------------------------------------------------- fleet up


@click.command("up")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1, 64),
              help="worker processes")
@click.option("--flower/--no-flower", default=True, show_default=True,
              help="start Flower (with a password of its own unless FLOWER_BASIC_AUTH is set)")
@click.option("--flower-port", default=5555, show_default=True,
              help="Flower's port (another free one if taken)")
@click.option("--data-dir", default=".fleet", show_default=True,
              help="the SQLite store (without FLEET_DATABASE_URL) and the logs; kept")
@click.option("--json", "as_json", is_flag=True,
              help="print where everything runs as one JSON line")
def up(workers: int, flower: bool, flower_port: int, data_dir: str, as_json: bool) -> None:
    """Run a whole fleet on this machine until Ctrl-C or SIGTERM.

    SQLite and an embedded Valkey unless FLEET_DATABASE_URL / FLEET_REDIS_URL
    say otherwise; N workers; the timer service, the recovery sweeper, the
    reward attacher and the relay (every committed event onto the events
    stream); Flower.
    """
    stop = threading.Event()
    signals: list[tuple[signal.Signals, Any]] = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signals.append((sig, signal.signal(sig, lambda *_: stop.set())))
    fleet = EmbeddedFleet(workers=workers, flower=flower, data_dir=data_dir,
                          flower_port=flower_port)
    env_file: Path | None = None
    try:
        with console.status("starting the fleet"):
            began = time.monotonic()
            fleet.start()
        env_file = write_env_file(fleet)
        _print_up(fleet, time.monotonic() - began, as_json, env_file)
        _run_until(stop, fleet, as_json)
        if not as_json:
            console.print("stopping: workers hand their runs back, then everything stops")
    finally:
        fleet.stop()
        if env_file is not None:
            env_file.unlink(missing_ok=True)  # it would point at a fleet that is gone
        for sig, previous in signals:
            signal.signal(sig, previous)
    if not as_json:
        console.print(f"stopped; the data stays in {fleet.data_dir}")


def _run_until(stop: threading.Event, fleet: EmbeddedFleet, as_json: bool) -> None:
    """Until ``stop``: one line per execution that finished, and each worker that died."""
    watcher = FinishedWatcher(str(fleet.settings.redis_url), fleet.settings.events_stream)
    reported: set[int] = set()
    quiet_until = 0.0
    try:
        while not stop.is_set():
            try:
                finished = watcher.poll() if time.monotonic() >= quiet_until else []
            except TRANSIENT as exc:  # Redis went away: say so once in a while, go on
                err_console.print(plain(f"cannot read the events stream: {exc}", "yellow"))
                quiet_until = time.monotonic() + 30
                finished = []
            for done in finished:
                click.echo(json.dumps({"finished": done.execution_id, "status": done.status,
                                       "flow": done.flow_id, "tookS": done.took_s,
                                       "atMs": done.at_ms, "detail": done.detail})
                           if as_json else terminal_safe(done.line()))
            if not finished:
                stop.wait(0.2 if time.monotonic() >= quiet_until else 1.0)
            for worker in fleet.workers:
                if not worker.alive() and not worker.killed and worker.pid not in reported:
                    reported.add(worker.pid)
                    err_console.print(Text.assemble(
                        plain(f"{worker.name} (pid {worker.pid}) exited with "
                              f"{worker.proc.returncode}", "red"),
                        plain(f"; its log: {worker.log_path}")))
    finally:
        watcher.close()


def write_env_file(fleet: EmbeddedFleet) -> Path:
    """``<data dir>/env``: the exports that point fleet commands in another shell at
    ``fleet`` (``. .fleet/env``); readable by its owner only (it holds the URLs)."""
    path = fleet.data_dir / "env"
    lines = [f"# fleet up (pid {os.getpid()}): `. {_shown_path(path)}` points fleet commands "
             "at this fleet; removed when it stops",
             *export_lines(fleet, redacted=False)]
    path.touch(mode=0o600)
    path.write_text("\n".join(lines) + "\n")
    return path


def export_lines(fleet: EmbeddedFleet, *, redacted: bool) -> list[str]:
    """``export NAME=value`` for each of ``fleet.exports()`` (passwords in URLs
    ``redacted`` for the terminal); the reward keys travel as their file's path
    (``FLEET_REWARD_KEYS_FILE``), never as the secrets."""
    lines = [f"export {name}="
             f"{shlex.quote(str(redact(value) if redacted and name.endswith('_URL') else value))}"
             for name, value in fleet.exports().items()]
    return lines


def _shown_path(path: Path) -> str:
    """``path`` relative to the working directory when it is below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _print_up(fleet: Any, took: float, as_json: bool, env_file: Path) -> None:
    urls = fleet.urls()
    exports = {name: redact(value) if name.endswith("_URL") else value
               for name, value in fleet.exports().items()}
    where = {
        "store": urls["store"], "redis": urls["redis"], "broker": urls["broker"],
        "embedded_redis": fleet.embedded_redis, "flower": urls["flower"],
        "flower_auth": fleet.flower_auth,
        "workers": [{"name": w.name, "pid": w.pid, "node": w.node} for w in fleet.workers],
        "services": ["timers", "recovery", "attacher", "relay"],
        "flows": list(fleet.settings.flows), "queue": fleet.settings.queue,
        "data_dir": urls["data_dir"], "logs": urls["logs"], "reward_keys": urls["reward_keys"],
        "env_file": str(env_file), "exports": exports}
    if as_json:
        click.echo(json.dumps(where))
        return
    redis = urls["redis"] + (f" (embedded Valkey, pid {fleet.valkey_pid})"
                             if fleet.embedded_redis else "")
    flower = urls["flower"] or "off"
    if fleet.flower_auth:
        user, _, password = fleet.flower_auth.partition(":")
        flower += f"  (user {user}, password {password})"
    rows: list[list[Any]] = [
        ["store", urls["store"]], ["redis: broker and streams", redis],
        *[[w.name, f"pid {w.pid}  {w.node}"] for w in fleet.workers],
        ["timer service, recovery sweeper,\nreward attacher, relay", "in this process"],
        ["flower", flower], ["flows", ", ".join(fleet.settings.flows)],
        ["queue", fleet.settings.queue], ["logs", urls["logs"]],
        ["reward keys\n(--key-file)", urls["reward_keys"]]]
    console.print(_table(f"fleet up ({took:.1f} s): Ctrl-C to stop", ["part", "where"], rows))
    # Plain lines, never wrapped: they are copied as they are.
    click.echo(f"In another shell, `. {_shown_path(env_file)}` points fleet status, fleet "
               "start, fleet list ... at this fleet; it exports:")
    for line in export_lines(fleet, redacted=True):
        click.echo(f"  {line}")
    click.echo("Each execution that finishes is a line below.")


# --------------------------------------------------------------------------- fleet demo


@click.command("demo")
@click.option("--executions", default=30, show_default=True, type=click.IntRange(3, 500),
              help="tickets to answer")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(2, 16),
              help="worker processes (one is killed; at least one survives)")
@click.option("--seed", default=7, show_default=True,
              help="seeds the tickets, the agent's decisions and the rewards: the same "
                   "seed gives the same figures")
@click.option("--flower/--no-flower", default=False, show_default=True)
@click.option("--data-dir", default=None,
              help="keep the store and the logs here (default: a temporary directory, "
                   "removed at the end)")
@click.option("--json", "as_json", is_flag=True, help="print only a JSON summary")
def demo(executions: int, workers: int, seed: int, flower: bool, data_dir: str | None,
         as_json: bool) -> None:
    """Bring up the embedded fleet, run an agent, kill a worker, deploy a change that
    diverges and fix it, attach rewards, evaluate.

    Uses SQLite and an embedded Valkey unless FLEET_DATABASE_URL / FLEET_REDIS_URL
    are set. Exits 0 when every execution completed, the killed worker's runs
    recovered, the changed deploy's runs were parked as diverged and completed
    once fixed, every valid reward was attached and nothing was left running.
    """
    options = DemoOptions(executions=executions, workers=workers, seed=seed, flower=flower,
                          data_dir=data_dir)
    reporter: Reporter = NullReporter() if as_json else RichReporter(console)

    async def go() -> dict[str, Any]:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        if task is not None:
            # SIGTERM stops the demo as Ctrl-C does: the fleet shuts down in order.
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await run_demo(options, reporter)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        summary = run_loop(go())
    except (FleetError, TimeoutError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
    except (KeyboardInterrupt, asyncio.CancelledError):
        err_console.print("fleet demo: interrupted; the fleet was stopped")
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        _print_verdict(summary)
    if not summary["ok"]:
        sys.exit(1)


def _print_verdict(summary: dict[str, Any]) -> None:
    ex = summary["executions"]
    style = summary["evaluation"]["reply_style"]
    lines = [
        f"{ex['completed']}/{ex['started']} executions completed; "
        f"{summary['recovery']['recovered']} recovered after SIGKILL of "
        f"{summary['crash']['worker']}",
        f"{summary['rewards']['attached']}/{summary['rewards']['submitted_valid']} signed "
        f"rewards attached, {sum(summary['rewards']['dead_lettered'].values())} bad ones "
        "dead-lettered",
        f"reply style: logged {style['logged_value']:.3f}, better policy (SNIPS) "
        f"{style['snips']:.3f}" + (f", (DR) {style['dr']['estimated_value']:.3f}"
                                   if "estimated_value" in style.get("dr", {}) else ""),
        f"{summary['elapsed_s']:.1f} s in all"]
    if summary["ok"]:
        console.print(Text.assemble(("demo finished: ", "bold green"), "; ".join(lines)))
    else:
        console.print(Text.assemble(("demo finished with problems: ", "bold red"),
                                    plain("; ".join(summary["problems"]))))


__all__ = ["RichReporter", "demo", "up"]
