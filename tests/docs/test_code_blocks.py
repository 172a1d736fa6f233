"""Every fenced code block in README.md and docs/**/*.md runs as written (issue 15 item 1).

Each block is extracted with its file and line and treated by its language:

- ``python``: run with this interpreter as a file in a fresh temporary
  directory, the way a user runs a script: the installed ``fleet`` (its
  examples included) importable, no ``PYTHONPATH``, no ``FLEET_*`` variable
  (the embedded defaults: SQLite in the directory, an embedded Valkey);
- ``bash`` / ``sh``: run with ``bash -euo pipefail`` the same way, this
  environment's ``fleet`` first on ``PATH``;
- ``json`` / ``yaml``: parsed (a sample a reader copies must at least parse);
- untagged and ``sql``: text shown for reading (a layout, a test vector, a
  query the store runs), named in ``NOT_CODE``;
- any other language fails ``test_every_block_is_run_or_listed`` until it is
  classified here.

Each run has a time limit (``LIMIT_S``; a block that outlives it fails, its
process group stopped). A block that cannot run here (an install, a cluster,
a registry, the test command itself, a consumer that runs until stopped) is
listed in ``NOT_RUN`` with the reason; an entry whose block no longer exists
(or matches more than one) fails ``test_not_run_lists_no_block_that_is_gone``.
A block that fails fails its test with the block's ``file:line`` and its output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 120.0  # per block; `fleet demo` takes ~20 s on a loaded 2-core machine


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block: where it is, its language and its text (dedented by the
    fence's own indentation)."""

    path: str
    line: int  # the block's first line of code, 1-based
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True, slots=True)
class NotRun:
    """A block that is not run here: the file, a piece of text only it contains, and why."""

    path: str
    contains: str
    reason: str


NOT_RUN: tuple[NotRun, ...] = (
    NotRun("README.md", "pip install -c constraints.txt -e '.[fleet]'",
           "installs into the environment the tests run in; .ci/run makes the same install"),
    NotRun("README.md", "python -m pytest",
           "the test command itself (it would run this test again)"),
    NotRun("docs/operations.md", "docker push registry.example.com",
           "builds an image and pushes it to a registry (tests/deploy render the manifests)"),
    NotRun("docs/operations.md", "kind load docker-image fleet:dev",
           "needs Docker, kind and a Kubernetes cluster"),
    NotRun("docs/operations.md", "kubectl apply -k deploy/k8s/overlays/prod",
           "applies the production overlay to a cluster"),
    NotRun("docs/operations.md", "fleet replay export EXECUTION_ID",
           "placeholders for the reader's execution ids, log files and flow modules; "
           "tests/cli/test_replay_cli.py runs fleet replay export and check"),
    NotRun("docs/operations.md", "kubectl -n fleet port-forward svc/fleet-flower",
           "a deployed Flower behind a port-forward"),
    NotRun("docs/operations.md", "consumer = EventStreamConsumer(",
           "a consumer that runs until stopped, on a deployed fleet's Redis "
           "(tests/integration/test_event_consumers.py runs EventStreamConsumer)"),
    NotRun("docs/operations.md", ".ci/run-latest --lock",
           "CI itself: installs the newest versions and runs the whole suite"),
)

#: Languages that are text to read, not code to run, and why.
NOT_CODE: dict[str, str] = {
    "": "untagged: a layout, a message and its HMAC, a dependency order",
    "sql": "a query the Postgres store runs, shown for reading",
}


def _run_process(args: list[str], block: Block, workdir: Path,
                 limit_s: float) -> tuple[int | None, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FLEET_") and k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.Popen(args, cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        # SIGTERM first: `fleet demo` and EmbeddedFleet stop their children on it.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return None, out.decode(errors="replace")


def _python(block: Block, workdir: Path, limit_s: float) -> tuple[int | None, str]:
    script = workdir / "block.py"
    script.write_text(block.text)
    return _run_process([sys.executable, str(script)], block, workdir, limit_s)


def _bash(block: Block, workdir: Path, limit_s: float) -> tuple[int | None, str]:
    script = workdir / "block.sh"
    script.write_text(block.text)
    return _run_process(["bash", "-euo", "pipefail", str(script)], block, workdir, limit_s)


def _parse(load: Callable[[str], object]) -> Callable[[Block, Path, float],
                                                      tuple[int | None, str]]:
    def check(block: Block, workdir: Path, limit_s: float) -> tuple[int | None, str]:
        try:
            load(block.text)
        except Exception as exc:  # noqa: BLE001 - reported as the block's failure
            return 1, f"{type(exc).__name__}: {exc}"
        return 0, ""
    return check


RUNNERS: dict[str, Callable[[Block, Path, float], tuple[int | None, str]]] = {
    "python": _python, "bash": _bash, "sh": _bash,
    "json": _parse(json.loads), "yaml": _parse(lambda t: list(yaml.safe_load_all(t))),
}

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")


def extract(path: str, text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, in order. An unclosed fence is an
    error (the rest of the file would silently become code)."""
    lines = text.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        indent, fence, lang = len(opened.group(1)), opened.group(2), opened.group(3).lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                break
            line = lines[j]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            j += 1
        else:
            raise ValueError(f"{path}:{i + 1}: a {fence} fence is never closed")
        blocks.append(Block(path, i + 2, lang, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [block for path in documents(root)
            for block in extract(str(path.relative_to(root)), path.read_text())]


def listed(block: Block, entries: Iterable[NotRun] = NOT_RUN) -> NotRun | None:
    return next((e for e in entries if e.path == block.path and e.contains in block.text),
                None)


def classify(blocks: list[Block], entries: Iterable[NotRun] = NOT_RUN) -> list[str]:
    """What is wrong with how ``blocks`` are treated: a language nothing handles, a
    NOT_RUN entry that matches no block (stale) or several (ambiguous)."""
    entries = tuple(entries)
    problems = [f"{b.where}: ```{b.lang} is neither run, parsed, nor listed in NOT_CODE; "
                "classify it in tests/docs/test_code_blocks.py"
                for b in blocks if b.lang not in RUNNERS and b.lang not in NOT_CODE
                and listed(b, entries) is None]
    for entry in entries:
        matches = [b.where for b in blocks if b.path == entry.path and entry.contains in b.text]
        if not matches:
            problems.append(f"NOT_RUN entry {entry.path}: {entry.contains!r} matches no block "
                            "(stale: the block changed or is gone; run it or update the entry)")
        elif len(matches) > 1:
            problems.append(f"NOT_RUN entry {entry.path}: {entry.contains!r} matches "
                            f"{matches}; make it name one block")
    return problems


#: What a block must print besides succeeding: (path, the block's text contains, lines
#: its output must hold). What a newcomer is promised on first contact.
EXPECTED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # The demo explains each estimator it reports and shows a divergence parked and
    # retried (issue 15 item 7).
    ("README.md", "fleet demo", (
        "How to read it", "IPS", "SNIPS", "unbiased", "normalised",
        "effective sample size", "diverged")),
)


def expected(block: Block) -> tuple[str, ...]:
    return tuple(line for path, contains, lines in EXPECTED
                 if block.path == path and block.text.strip() == contains for line in lines)


def failure(block: Block, workdir: Path, limit_s: float = LIMIT_S) -> str | None:
    """Run ``block`` in ``workdir``; None when it succeeded, else what to show."""
    rc, output = RUNNERS[block.lang](block, workdir, limit_s)
    missing = [line for line in expected(block) if line not in output]
    if rc == 0 and not missing:
        return None
    if rc == 0:
        return (f"{block.where}: the ```{block.lang} block ran but did not print "
                f"{missing}; its output:\n{output[-4000:]}")
    how = f"ran over its {limit_s:g} s limit" if rc is None else f"exited {rc}"
    return (f"{block.where}: the ```{block.lang} block {how} (run as written in a fresh "
            f"directory, without FLEET_*); its output:\n{output[-4000:]}")


def check(block: Block, workdir: Path) -> None:
    """Fail (AssertionError) with the block's file:line when it does not run."""
    problem = failure(block, workdir)
    assert problem is None, problem


def runnable(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.lang in RUNNERS and listed(b) is None]


BLOCKS = all_blocks()


# ---------------------------------------------------------------------- the docs


def test_every_block_is_run_or_listed() -> None:
    assert classify(BLOCKS) == []


def test_not_run_lists_no_block_that_is_gone() -> None:
    # classify() reports stale entries too; this names the guard on its own.
    assert [p for p in classify(BLOCKS) if p.startswith("NOT_RUN")] == []
    assert all(entry.reason for entry in NOT_RUN)


def test_the_readme_examples_are_run() -> None:
    # The README's Python examples are all run, and its `fleet demo` too.
    run = runnable(BLOCKS)
    readme = [b for b in BLOCKS if b.path == "README.md" and b.lang == "python"]
    assert readme
    assert all(b in run for b in readme)
    assert any(b.path == "README.md" and b.text.strip() == "fleet demo" for b in run)
    # Every expectation names a block that is run.
    for path, contains, _lines in EXPECTED:
        assert [b for b in run if b.path == path and b.text.strip() == contains], contains


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 60)
@pytest.mark.parametrize("block", runnable(BLOCKS), ids=lambda b: f"{b.where}-{b.lang}")
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    check(block, tmp_path)


# ---------------------------------------------------------------------- the test itself

SYNTHETIC = """# A guide

Some text.

```python
print("fine")
```

  ```python
  raise SystemExit("broken example")
  ```

```bash
echo one && false
```

```json
{"a": 1,}
```

~~~python
import time
time.sleep(30)
~~~

```toml
x = 1
```
"""


def test_a_failing_block_fails_with_its_file_and_line(tmp_path: Path) -> None:
    blocks = extract("guide.md", SYNTHETIC)
    assert [(b.line, b.lang) for b in blocks] == [
        (6, "python"), (10, "python"), (14, "bash"), (18, "json"), (22, "python"),
        (27, "toml")]
    assert blocks[1].text == 'raise SystemExit("broken example")\n'  # the fence's indent off
    assert failure(blocks[0], tmp_path) is None
    check(blocks[0], tmp_path)
    shown = {b.line: failure(b, tmp_path, limit_s=1.0 if b.line == 22 else LIMIT_S)
             for b in blocks[1:5]}
    assert {line: (text or "").split(": ", 1)[0] for line, text in shown.items()} == {
        10: "guide.md:10", 14: "guide.md:14", 18: "guide.md:18", 22: "guide.md:22"}
    assert "broken example" in str(shown[10])  # the block's own output
    assert "exited 1" in str(shown[14])
    assert "one" in str(shown[14])
    assert "JSONDecodeError" in str(shown[18])
    assert "ran over its 1 s limit" in str(shown[22])
    # The check the docs' test makes fails on the broken block, naming it.
    with pytest.raises(AssertionError, match=r"guide\.md:10: the ```python block exited 1"):
        check(blocks[1], tmp_path)


def test_an_unknown_language_and_a_stale_entry_are_refused() -> None:
    blocks = extract("guide.md", SYNTHETIC)
    entries = (NotRun("guide.md", "time.sleep(30)", "slow"),
               NotRun("guide.md", "no such text", "gone"),
               NotRun("guide.md", "e", "too broad"))
    problems = classify(blocks, entries)
    assert any(p.startswith("guide.md:27: ```toml") for p in problems), problems
    assert any("'no such text' matches no block (stale" in p for p in problems), problems
    assert any("'e' matches" in p and "make it name one block" in p
               for p in problems), problems
    assert len(problems) == 3
    # Listed, a block is not run; unlisted, it is.
    assert listed(blocks[4], entries[:2]) is entries[0]
    assert listed(blocks[0], entries[:2]) is None


def test_an_unclosed_fence_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"guide\.md:3: a ``` fence is never closed"):
        extract("guide.md", "text\n\n```python\nprint(1)\n")
