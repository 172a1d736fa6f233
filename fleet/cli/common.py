"""What every command module of the CLI shares: the consoles, the options, the error
handling, running a coroutine, opening the store a command names.

The command modules import these names and nothing else from one another.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.console import Console
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from fleet.cli.text import terminal_safe
from fleet.config import FleetSettings
from fleet.host.kernel import open_store, open_store_to_read
from fleet.host.loop import run_loop
from fleet.kernel.errors import ConfigurationError, FleetError
from fleet.kernel.events import EventEnvelope
from fleet.kernel.security import Principal
from fleet.kernel.store.factory import open_snapshot_store
from fleet.kernel.store.spi import EventStore, SnapshotStore

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

def plain(value: object, style: str = "") -> Text:
    """User data (an id, a name, a payload, an error message) as rich text: never read
    as markup, every control character escaped (``terminal_safe``)."""
    return Text(terminal_safe(value), style=style)


class SafeConsole(Console):
    """The CLI's consoles: a string is printed as the text it is. No markup (an id
    ``evil[/bold]x`` or ``[link=...]`` is text, issue 25.7), no emoji codes, and every
    string a table, a title or ``print`` renders passes ``terminal_safe`` first, so no
    escape sequence of a user's data reaches the terminal. Styles are given as
    ``Text(..., style=)`` (``plain``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(markup=False, emoji=False, **kwargs)

    def render_str(self, text: str, **kwargs: Any) -> Text:
        kwargs["markup"] = False
        kwargs["emoji"] = False
        return super().render_str(terminal_safe(text), **kwargs)


console = SafeConsole()
err_console = SafeConsole(stderr=True)


def echo(message: object, *, err: bool = False) -> None:
    """``click.echo`` of a line that may hold user data: ``terminal_safe`` first."""
    click.echo(terminal_safe(message), err=err)


def run_async(coro_fn: Callable[[], Awaitable[T]]) -> T:
    """Run a command's coroutine; a ``FleetError`` is a one-line message and exit code 1."""
    try:
        return run_loop(coro_fn())  # type: ignore[arg-type]
    except FleetError as exc:
        raise click.ClickException(terminal_safe(f"{type(exc).__name__}: {exc}")) from exc


def store_url(db: str | None) -> str:
    """The store a command reads: ``--db``, else ``FLEET_DATABASE_URL`` (or its default)."""
    return db or FleetSettings().database_url


def open_store_at(url: str) -> EventStore:
    """The store at ``url``, with the rest of the settings (pool sizes, the event size
    limit, group commit) from ``FLEET_*``: every command opens it the way a fleet
    process does."""
    return open_store(FleetSettings(database_url=url))


def open_reader_at(url: str) -> EventStore:
    """The store at ``url`` for a command that only reads: never created, never
    migrated (``host.kernel.open_store_to_read``)."""
    return open_store_to_read(FleetSettings(database_url=url))


def open_snapshots(url: str | None) -> SnapshotStore | None:
    """The snapshot store at ``url``; ``None`` (or ``"none"``): no snapshots."""
    if url is None or url == "none":
        return None
    return open_snapshot_store(url)


def load_callable(spec: str) -> Any:
    """``package.module:function``, imported; a ``ConfigurationError`` says what is wrong."""
    module_name, _, attr = spec.partition(":")
    example = "e.g. fleet.examples.agent:better_style"
    if not module_name or not attr:
        raise ConfigurationError(f"{spec!r} must look like 'package.module:function' ({example})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r} ({exc}): a module of the "
                                 "working directory or of PYTHONPATH") from exc
    target = getattr(module, attr, None)
    if target is None:
        raise ConfigurationError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise ConfigurationError(f"{spec!r} is not callable: it is a "
                                 f"{type(target).__name__}, not a function ({example})")
    return target


if TYPE_CHECKING:  # generic from click 8.2 on; pyproject allows 8.1, where it is not
    OptionType = click.ParamType[Any, Any]
else:
    OptionType = click.ParamType


class CallableSpec(OptionType):
    """An option naming ``package.module:function``: imported when parsed, so a wrong one
    is a usage error (exit 2) saying what is wrong, before any work starts."""

    name = "module:function"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if callable(value):
            return value
        try:
            return load_callable(str(value))
        except ConfigurationError as exc:
            self.fail(str(exc), param, ctx)


def database_missing(url: str) -> str | None:
    """Why the store ``url`` cannot be read without creating it (None: it exists, or it
    is not a file). A command that only reads never creates a database."""
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):]
    if not path or Path(path).exists():
        return None
    shown = path if Path(path).is_absolute() or path.startswith(".") else f"./{path}"
    hint = ""
    if Path(".fleet/env").exists():
        hint = " (`fleet up` here wrote .fleet/env: `. .fleet/env` points this shell at it)"
    return (f"no fleet database at {shown}; set FLEET_DATABASE_URL or --db, or run "
            f"`fleet up`{hint}")


def require_database(url: str) -> str:
    """``url``, once it names a database that exists (see ``database_missing``)."""
    missing = database_missing(url)
    if missing is not None:
        raise click.ClickException(missing)
    return url


def read_store_url(db: str | None) -> str:
    """The store a reading command reads (``store_url``); it must exist already."""
    return require_database(store_url(db))


def id_column(table: Table, header: str, ids: list[str]) -> None:
    """A column of ids that is never cut nor folded: an id must copy whole into the
    next command. The other columns give way. Give its cells as ``id_cell``."""
    table.add_column(header, no_wrap=True, overflow="ignore",
                     min_width=max([len(header), *(len(id_cell(i)) for i in ids)]))


def id_cell(value: str) -> Text:
    """An id as a table cell: on one line, every control character escaped."""
    return Text(terminal_safe(value, newlines=False))


def natural_width(renderable: Any, *, minimum: bool = False) -> int:
    """How wide ``renderable`` is when nothing squeezes it (``minimum``: squeezed as far
    as its columns allow)."""
    measured = Measurement.get(console, console.options.update_width(100_000), renderable)
    return measured.minimum if minimum else measured.maximum


def print_fitting(table: Table, rows: list[list[str]]) -> None:
    """``table`` when it fits the terminal; else each row as a record (its first cell
    on a line of its own, then ``header=value`` pairs wrapped between pairs), so
    nothing is cut or cropped at the right edge."""
    if natural_width(table, minimum=True) <= console.width:
        console.print(table)
        return
    headers = [str(column.header) for column in table.columns]
    if table.title:
        console.print(plain(table.title, "italic"))
    for row in rows:
        console.print(plain(f"{headers[0]} {terminal_safe(row[0], newlines=False)}"))
        pairs = " ".join(f"{h.replace(' ', '_')}={terminal_safe(v, newlines=False)}"
                         for h, v in zip(headers[1:], row[1:], strict=True) if v != "")
        if pairs:
            console.print(Padding(plain(pairs), (0, 0, 0, 2)))


def json_arg(value: str | None, option: str) -> Any:
    """An option's JSON value (``None`` stays ``None``)."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"{option} is not JSON: {exc}") from exc


def principal_from(actor: str | None, tenant: str | None) -> Principal | None:
    """The principal ``--actor`` / ``--tenant`` name (none without ``--actor``)."""
    if actor is None:
        if tenant is not None:
            raise click.BadParameter("--tenant needs --actor (a principal is an actor "
                                     "with an optional tenant)")
        return None
    return Principal(actor, tenant)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")


def exit_with(code: int) -> None:
    """Exit with a process's non-zero exit code (return on 0)."""
    if code:
        sys.exit(code)


#: How much of a payload ``fleet log`` shows in its table unless told (--width, --full).
PAYLOAD_WIDTH = 400


def cut(text: str, width: int | None) -> str:
    """``text`` cut at ``width`` characters, saying how much was left out (None: whole)."""
    if width is None or len(text) <= width:
        return text
    return f"{text[:width]}… (+{len(text) - width} characters; --full shows all)"


def log_table(title: str, events: list[EventEnvelope], *,
              width: int | None = PAYLOAD_WIDTH) -> Table:
    """A log as a table: sequence, type, payload (JSON, verbatim and escaped: user data
    is text, never markup; cut at ``width`` characters, saying so; None: whole)."""
    table = Table(title=plain(title))
    table.add_column("seq", justify="right", no_wrap=True)
    table.add_column("type", no_wrap=True,
                     min_width=max([4, *(len(str(e.type)) for e in events)]))
    table.add_column("payload", overflow="fold")
    for event in events:
        table.add_row(str(event.sequence), plain(event.type),
                      plain(cut(json.dumps(event.payload, ensure_ascii=False), width)))
    return table


def input_options(help_text: str) -> list[Callable[[F], F]]:
    """``--input JSON``, the one name every command reads its input by (issue 29.7:
    ``fleet run``, ``start``, ``resume``, ``send``, ``executions resume``); the older
    ``--payload`` of ``resume`` and ``send`` is still read (hidden). Read the value with
    ``input_from(input_json, payload)``."""
    return [click.option("--input", "input_json", default=None, help=help_text),
            click.option("--payload", "payload", default=None, hidden=True,
                         help="deprecated: --input")]


def input_from(input_json: str | None, payload: str | None) -> Any:
    """The JSON ``input_options`` read (None when neither was given)."""
    if input_json is not None and payload is not None:
        raise click.UsageError("give --input once (--payload is its older name)")
    if payload is not None:
        return json_arg(payload, "--payload")
    return json_arg(input_json, "--input")


def execution_id_argument(fn: F) -> F:
    """``EXECUTION_ID`` as the positional argument every command takes it as (issue 29.7);
    the older ``--execution ID`` is still read (hidden, deprecated). The command reads
    the id with ``the_execution_id(execution_id, execution_option)``."""
    fn = click.option("--execution", "execution_option", default=None, hidden=True,
                      help="deprecated: give the execution id as the first argument")(fn)
    return click.argument("execution_id", required=False)(fn)


def the_execution_id(positional: str | None, option: str | None) -> str:
    """The id ``execution_id_argument`` read: positional, or the deprecated option."""
    if positional is not None and option is not None and positional != option:
        raise click.UsageError("the execution id is given twice, differently: give it once, "
                               "as the first argument")
    execution_id = positional if positional is not None else option
    if execution_id is None:
        raise click.UsageError("missing the EXECUTION_ID argument")
    return execution_id


def with_options(options: list[Callable[[F], F]]) -> Callable[[F], F]:
    """Apply several click options at once, in the order given."""
    def apply(fn: F) -> F:
        for option in reversed(options):
            fn = option(fn)
        return fn
    return apply


loglevel_option = click.option("--loglevel", "-l", default="INFO", show_default=True,
                               type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"],
                                                 case_sensitive=False))
principal_options = [
    click.option("--actor", default=None, help="who asks (the principal's actor)"),
    click.option("--tenant", default=None, help="the principal's tenant (with --actor)"),
]
json_option = click.option("--json", "as_json", is_flag=True, help="print JSON")
#: ``--success`` / ``--failure``: the outcome a reward reports, the same on every command
#: (``fleet outcome attach``, ``fleet reward submit``). ``--success true|false`` is the
#: older form of ``fleet outcome attach``, still read (deprecated).
success_options = [
    click.option("--success", "success", type=click.BOOL, is_flag=False, flag_value=True,
                 default=None, metavar="",
                 help="the outcome succeeded (--failure: it did not)"),
    click.option("--failure", "failure", is_flag=True, default=False,
                 help="the outcome failed"),
]


def success_from(success: bool | None, failure: bool) -> bool | None:
    """The success flag ``success_options`` give (None: neither was given)."""
    if failure:
        if success is not None:
            raise click.UsageError("give --success or --failure, not both")
        return False
    return success

db_option = click.option("--db", default=None,
                         help="store URL (default: FLEET_DATABASE_URL or sqlite:///fleet.db)")
snapshots_option = click.option(
    "--snapshots", default=None,
    help="snapshot store URL holding checkpoints (default: the --db URL; 'none' for none)")


__all__ = [
    "PAYLOAD_WIDTH",
    "CallableSpec",
    "SafeConsole",
    "console",
    "cut",
    "database_missing",
    "db_option",
    "echo",
    "err_console",
    "execution_id_argument",
    "exit_with",
    "id_cell",
    "id_column",
    "input_from",
    "input_options",
    "json_arg",
    "json_option",
    "load_callable",
    "log_table",
    "loglevel_option",
    "open_reader_at",
    "open_snapshots",
    "open_store_at",
    "plain",
    "principal_from",
    "principal_options",
    "read_store_url",
    "require_database",
    "run_async",
    "setup_logging",
    "snapshots_option",
    "store_url",
    "success_from",
    "success_options",
    "terminal_safe",
    "the_execution_id",
    "with_options",
]
