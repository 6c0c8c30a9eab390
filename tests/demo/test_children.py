"""The demo's children: their own session, a log file, stopped in turn, and never orphaned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jupyter_gpu_hotplug.demo.children import ChildProcess, log_tail

from .leftovers import Proc

DEADLINE = 60.0
_SLEEPER = "import time; print('{greeting}', flush=True); time.sleep(600)"
_STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ignoring SIGTERM', flush=True); time.sleep(600)"
)


def wait_for_line(path: Path, line: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while line not in log_tail(path).splitlines():
        assert time.monotonic() < deadline, f"{line!r} never came: {log_tail(path)!r}"
        time.sleep(0.02)


async def test_a_child_has_its_own_session_and_its_output_in_its_log(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = await ChildProcess.start(
        "sleeper", [sys.executable, "-c", _SLEEPER.format(greeting="hello")], log_path=log
    )
    try:
        wait_for_line(log, "hello")
        assert os.getsid(child.pid) == child.pid, "Ctrl-C in the terminal does not reach it"
        assert child.returncode is None and child.describe_exit() == "is still running"
    finally:
        code = await child.stop(timeout=DEADLINE)
    assert code == -signal.SIGTERM
    assert child.describe_exit() == "was killed by SIGTERM"
    assert child.log_tail() == "hello"


async def test_a_child_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    child = await ChildProcess.start("stubborn", [sys.executable, "-c", _STUBBORN], log_path=log)
    wait_for_line(log, "ignoring SIGTERM")
    assert await child.stop(timeout=0.2) == -signal.SIGKILL
    assert child.describe_exit() == "was killed by SIGKILL"


async def test_an_exit_code_is_described(tmp_path: Path) -> None:
    child = await ChildProcess.start(
        "quitter", [sys.executable, "-c", "raise SystemExit(3)"], log_path=tmp_path / "log"
    )
    assert await child.wait() == 3
    assert child.describe_exit() == "exited with code 3"
    child.send_signal(signal.SIGTERM)  # After the exit: a no-op, not an error.


def test_children_do_not_outlive_a_killed_demo(tmp_path: Path) -> None:
    parent_script = f"""
import asyncio, sys
from pathlib import Path
from jupyter_gpu_hotplug.demo.children import ChildProcess

async def main():
    child = await ChildProcess.start(
        "sleeper", [sys.executable, "-c", {_SLEEPER.format(greeting="up")!r}],
        log_path=Path({str(tmp_path / "child.log")!r}),
    )
    print(child.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""
    parent = subprocess.Popen([sys.executable, "-c", parent_script], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child = Proc.of(int(parent.stdout.readline()))
        assert child is not None
        wait_for_line(tmp_path / "child.log", "up")
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    # PR_SET_PDEATHSIG: the kernel sends the child SIGTERM when its parent dies.
    deadline = time.monotonic() + DEADLINE
    while child.running() and time.monotonic() < deadline:
        time.sleep(0.02)
    survived = child.running()
    child.kill()
    assert not survived, "the child outlived its killed parent"
