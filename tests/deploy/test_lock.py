"""What is deployed is what was tested (decision 0014): ``constraints.txt`` pins every
dependency of every extra within ``pyproject.toml``'s bounds, and each way of installing
fleet (CI, the image, the README) installs with it."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Runtime dependencies whose next major must not slip in untested (the dev tools ruff
# and mypy float: the lock holds CI to one version; run-latest shows the next).
BOUNDED_EXTRAS = ("postgres", "fleet", "learn", "bench")


def requirements(extras: tuple[str, ...] | None = None) -> list[Requirement]:
    project = PYPROJECT["project"]
    groups = project["optional-dependencies"]
    names = tuple(groups) if extras is None else extras
    return [Requirement(r) for r in project["dependencies"]] + [
        Requirement(r) for extra in names for r in groups[extra]]


def pins() -> dict[str, str]:
    found: dict[str, str] = {}
    for raw in (ROOT / "constraints.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line)
        assert match, f"constraints.txt: {raw!r} is not name==version"
        name = canonicalize_name(match[1])
        assert name not in found, f"constraints.txt pins {name} twice"
        found[name] = match[2]
    return found


def test_every_dependency_of_every_extra_is_pinned_within_its_bounds() -> None:
    pinned = pins()
    assert set(PYPROJECT["project"]["optional-dependencies"]) == {
        "postgres", "fleet", "otel", "learn", "bench", "dev"}
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} is not in constraints.txt: run .ci/run-latest --lock"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {name}=={pinned[name]}, outside {requirement}")


def test_the_runtime_dependencies_have_an_upper_bound() -> None:
    for requirement in requirements(BOUNDED_EXTRAS):
        assert any(spec.operator in ("<", "<=", "~=", "==") for spec in requirement.specifier), (
            f"{requirement}: no upper bound, the next major would install untested")


def test_ci_the_image_and_the_readme_install_with_the_constraints() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -q -c constraints.txt -e '.[dev,postgres,fleet]'" in ci
    dockerfile = re.sub(r"\\\n", " ", (ROOT / "deploy" / "Dockerfile").read_text())
    assert re.search(r"COPY [^\n]*constraints\.txt", dockerfile)
    assert re.search(r"pip wheel [^\n]*-c constraints\.txt", dockerfile)
    assert re.search(r"install --no-index [^\n]*-c /constraints\.txt", dockerfile)
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    installs = [line for block in blocks for line in block.splitlines() if "pip install" in line]
    assert installs == [
        "pip install -c constraints.txt -e '.[fleet]'",  # then `fleet demo`, a block of its own
        "pip install -c constraints.txt -e '.[dev,postgres,fleet]' && python -m pytest"]
    # The README's test command is the one CI runs.
    assert "\npython -m pytest\n" in ci
    latest = (ROOT / ".ci" / "run-latest").read_text()
    assert "pip install -q --upgrade --upgrade-strategy eager -e '.[dev,postgres,fleet,bench]'" \
        in latest
    assert "-c constraints.txt" not in latest.split("pip freeze")[0]


def test_this_environment_runs_the_locked_versions() -> None:
    """``.ci/run`` installed with the constraints: what runs here is what is pinned."""
    pinned = pins()
    for requirement in requirements(("postgres", "fleet", "dev")):
        name = canonicalize_name(requirement.name)
        try:
            installed = version(name)
        except PackageNotFoundError:
            raise AssertionError(f"{name} is not installed: pip install -c constraints.txt "
                                 "-e '.[dev,postgres,fleet]'") from None
        assert installed == pinned[name], (
            f"{name} {installed} installed, {pinned[name]} pinned: pip install -c "
            "constraints.txt -e '.[dev,postgres,fleet]'")
