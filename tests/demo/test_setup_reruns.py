"""``.ci/setup`` can be run again and again in one clone, and the demo then starts (issue 14).

The README's commands each run ``.ci/setup`` first, so a user who runs ``.ci/demo``, then
``.ci/test``, then ``.ci/demo`` again has set up the same clone three times. The third run
used to fail: the second one installed the labextension's ``install.json`` through the link
that ``jupyter-builder develop`` leaves, into the source tree, and the third build then added
it to the wheel twice.

This runs the real ``.ci/setup`` three times in a fresh clone of this repository (what is
committed: the clone is what a user gets), then starts the clone's demo. Cost is kept down by
the caches a machine that ran ``.ci/setup`` once already has: pip's wheel cache and yarn's
package cache (both per user, outside the clone); the clone's own ``.venv`` and
``node_modules`` start empty, as a user's would. CI reaches this after its own ``.ci/setup``,
which warms both caches.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ..fixtures.agent import free_tcp_port
from ..fixtures.requirements import needs_root
from .conftest import DemoFactory
from .demo_process import DemoProcess

pytestmark = [*needs_root, pytest.mark.slow, pytest.mark.timeout(1800)]

REPOSITORY = Path(__file__).resolve().parents[2]
SETUP_TIMEOUT = 900.0
"""Seconds for one run; a first run in a fresh clone builds the labextension (yarn, tsc)."""


def setup_environment() -> dict[str, str]:
    """This environment, minus what would make the clone's setup use this checkout's venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(
        part for part in env.get("PATH", "").split(os.pathsep) if "/.venv/" not in part + "/"
    )
    return env


def run_setup(clone: Path, run: int, log: Path) -> None:
    with log.open("ab") as output:
        output.write(f"\n=== .ci/setup, run {run} ===\n".encode())
        output.flush()
        done = subprocess.run(
            ["bash", ".ci/setup"],
            cwd=clone,
            env=setup_environment(),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            timeout=SETUP_TIMEOUT,
            check=False,
        )
    assert done.returncode == 0, f"run {run} failed:\n{log.read_text(errors='replace')[-6000:]}"


def test_setup_runs_three_times_in_a_fresh_clone_and_the_demo_starts(
    tmp_path: Path, demo_factory: DemoFactory
) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    clone = tmp_path / "clone"
    subprocess.run(
        ["git", "clone", "--quiet", "--no-hardlinks", str(REPOSITORY), str(clone)],
        check=True,
        timeout=120,
    )
    log = tmp_path / "setup.log"
    for run in (1, 2, 3):
        run_setup(clone, run, log)
    assert not (clone / "jupyter_gpu_hotplug" / "labextension" / "install.json").exists()
    # Progress: every step numbered with the time so far, and the total, on every run.
    text = log.read_text()
    assert len(re.findall(r"^setup \[4/4\] linking .* \(\d+ s so far\)$", text, re.M)) == 3
    assert len(re.findall(r"^setup: done in \d+ s$", text, re.M)) == 3

    demo = DemoProcess.start(
        demo_factory.new_state_dir(),
        notebook_dir=demo_factory.notebook_dir,
        port=free_tcp_port(),
        simulate=1,
        output_path=tmp_path / "demo.out",
        jupyter=clone / ".venv" / "bin" / "jupyter",
        cwd=clone,
    )
    demo_factory.demos.append(demo)
    assert demo.server.request("GET", "api/status").status == 200
    assert demo.interrupt() == 0, demo.logs()
