"""Run ``python -m jupyterlab.browser_check`` against Debian's Chromium instead of a download.

Why this exists: JupyterLab's browser check drives a browser through *Node* Playwright. It
installs ``playwright`` into ``<app_dir>/browser_test``, always runs ``npx playwright install
chromium`` (a download from Playwright's CDN, which we never allow) and then calls
``chromium.launch()`` with no ``executablePath``; nothing in it can be configured to name
``/usr/bin/chromium``. Two documented Playwright behaviours make it work anyway:

* ``playwright install`` skips every browser whose directory under ``PLAYWRIGHT_BROWSERS_PATH``
  already holds an ``INSTALLATION_COMPLETE`` marker, so we create those directories (their
  names come from ``playwright install --dry-run``) and nothing is downloaded;
* ``launch()`` runs whatever file sits at ``chromium.executablePath()``, so we put a two-line
  shell script there that execs Debian's Chromium with ``--headless`` and our usual flags.

``JLAB_BROWSER_HEADLESS=false`` makes the check launch that "headed" Chromium path (a headless
launch would look for Playwright's separate headless-shell binary, whose path Playwright does
not expose); the script adds ``--headless`` itself, so no display is needed.

Usage (from the repository root, with the package installed)::

    .venv/bin/python -m tests.browser.run_browser_check [extra browser_check args]

Exits with the browser check's status. The fallback without any browser is
``python -m jupyterlab.browser_check --no-browser-test``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from jupyterlab.commands import get_app_dir

from tests.fixtures.browser import CHROMIUM, CHROMIUM_ARGS

PLAYWRIGHT_SPEC = "playwright@^1.9.2"
"""The same requirement ``jupyterlab.browser_check`` installs, so it finds it already there."""

BROWSERS_DIR_NAME = "debian-chromium-registry"
INSTALL_LOCATION = "Install location:"


class BrowserCheckSetupError(RuntimeError):
    """A prerequisite (Chromium, Node.js) is missing or a setup command failed."""


def _run(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str]) -> str:
    try:
        done = subprocess.run(
            list(argv), cwd=cwd, env=dict(env), check=True, capture_output=True, text=True
        )
    except subprocess.CalledProcessError as e:
        raise BrowserCheckSetupError(
            f"{shlex.join(argv)} failed with {e.returncode}:\n{e.stdout}\n{e.stderr}"
        ) from e
    return done.stdout


def _ensure_node_playwright(target: Path, env: Mapping[str, str]) -> None:
    """Install Node Playwright where the browser check looks for it, without any browser."""
    if (target / "node_modules" / "playwright").is_dir():
        return
    target.mkdir(parents=True, exist_ok=True)
    _run(["npm", "init", "-y"], cwd=target, env=env)
    _run(["npm", "install", PLAYWRIGHT_SPEC], cwd=target, env=env)


def _install_locations(target: Path, env: Mapping[str, str]) -> list[Path]:
    """The registry directories ``npx playwright install chromium`` would download into."""
    dry_run = _run(["npx", "playwright", "install", "--dry-run", "chromium"], cwd=target, env=env)
    locations = [
        Path(line.split(INSTALL_LOCATION, 1)[1].strip())
        for line in dry_run.splitlines()
        if INSTALL_LOCATION in line
    ]
    if not locations:
        raise BrowserCheckSetupError(f"no {INSTALL_LOCATION!r} in:\n{dry_run}")
    return locations


def _chromium_launcher_script() -> str:
    flags = shlex.join(["--headless", *CHROMIUM_ARGS])
    return f'#!/bin/sh\nexec {shlex.quote(str(CHROMIUM))} {flags} "$@"\n'


def seed_registry(target: Path, env: Mapping[str, str]) -> None:
    """Make Playwright's registry under ``PLAYWRIGHT_BROWSERS_PATH`` point at Debian's Chromium."""
    for location in _install_locations(target, env):
        location.mkdir(parents=True, exist_ok=True)
        (location / "INSTALLATION_COMPLETE").touch()
    executable = Path(
        _run(
            ["node", "-e", "process.stdout.write(require('playwright').chromium.executablePath())"],
            cwd=target,
            env=env,
        )
    )
    executable.parent.mkdir(parents=True, exist_ok=True)
    executable.write_text(_chromium_launcher_script())
    executable.chmod(0o755)


def browser_check_env(target: Path) -> dict[str, str]:
    """The environment for setup and for the check: a private registry, no downloads."""
    return {
        **os.environ,
        "PLAYWRIGHT_BROWSERS_PATH": str(target / BROWSERS_DIR_NAME),
        "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1",
        "JLAB_BROWSER_HEADLESS": "false",
    }


def main(argv: Sequence[str]) -> int:
    missing = [tool for tool in ("node", "npm", "npx") if shutil.which(tool) is None]
    if missing:
        raise BrowserCheckSetupError(f"Node.js tools not on PATH: {', '.join(missing)}")
    if not CHROMIUM.exists():
        raise BrowserCheckSetupError(f"{CHROMIUM} is missing: apt-get install -y chromium")

    target = Path(get_app_dir()) / "browser_test"
    env = browser_check_env(target)
    _ensure_node_playwright(target, env)
    seed_registry(target, env)

    check = [sys.executable, "-m", "jupyterlab.browser_check", *argv]
    if os.geteuid() == 0 and "--allow-root" not in argv:
        check.append("--allow-root")
    return subprocess.run(check, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
