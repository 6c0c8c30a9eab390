"""The demo as a user runs it: ``jupyter gpu-hotplug demo`` from the virtualenv, as a subprocess.

``DemoProcess.start`` runs the real command (the ``jupyter`` beside this interpreter) with
``--no-browser`` and a state dir, and waits until it prints the URL with its token — that line
is the demo's promise that JupyterLab answers. Everything it prints goes to a file, shown when
a test fails. ``kill_everything`` is the safety net for failed tests: whatever the demo left
running (its process tree, kernel sandboxes) is ended, so one failure does not poison the next
test.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from jupyter_gpu_hotplug.client import AgentClient, RetryPolicy
from jupyter_gpu_hotplug.demo.labconfig import SANDBOX_NAME_PREFIX
from jupyter_gpu_hotplug.demo.layout import DemoLayout
from jupyter_gpu_hotplug.linux.sandbox.runtime import cleanup_stale
from jupyter_gpu_hotplug.sandboxes.provisioner import DEFAULT_KERNEL_CGROUP_PARENT

from .jupyter_api import JupyterServer
from .leftovers import Proc, process_tree

JUPYTER: Final = Path(sys.executable).with_name("jupyter")
START_TIMEOUT: Final = 240.0
"""Generous: a cold start builds the fake NVML twice and loads JupyterLab on 2 shared cores."""
STOP_TIMEOUT: Final = 180.0
_URL: Final = re.compile(r"(?P<base>http://\S+?:\d+)/lab/tree/\S+\?token=(?P<token>[0-9a-f]+)")
_FILES: Final = re.compile(r"Demo state and logs[^:]*: (?P<root>/\S+)")
_NOTEBOOKS: Final = re.compile(r"kept when the demo stops, in:\n +(?P<dir>/.+)")
_CLI: Final = re.compile(r"from another terminal \(as root\):\n +(?P<line>.+)")
_STARTED_IN: Final = re.compile(r"started in (?P<seconds>[0-9.]+) s")
_POLL: Final = 0.1


class DemoFailed(AssertionError):
    """The demo exited or did not come up; its output is in the message."""


@dataclass
class DemoProcess:
    """One ``jupyter gpu-hotplug demo`` subprocess and what it printed."""

    process: subprocess.Popen[bytes]
    layout: DemoLayout
    output_path: Path
    base_url: str = ""
    token: str = ""
    startup_seconds: float = 0.0
    seen: set[Proc] = field(default_factory=set)
    """Every process of its tree seen so far (``remember_processes``), by pid."""

    @classmethod
    def start(
        cls,
        state_dir: Path | None,
        *,
        notebook_dir: Path,
        port: int,
        simulate: int = 2,
        extra_args: Sequence[str] = (),
        output_path: Path,
        jupyter: Path = JUPYTER,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> DemoProcess:
        """``jupyter`` (default: this environment's) runs the demo, in ``cwd``, with ``env``
        (default: this process's environment)."""
        argv = [
            str(jupyter),
            "gpu-hotplug",
            "demo",
            f"--simulate={simulate}",
            "--no-browser",
            f"--port={port}",
            f"--notebook-dir={notebook_dir}",
            *([] if state_dir is None else [f"--state-dir={state_dir}"]),
            *extra_args,
        ]
        with output_path.open("wb") as output:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=None if env is None else dict(env),
            )
        layout = DemoLayout(state_dir or Path("/nonexistent"), notebook_dir)
        demo = cls(process, layout, output_path)
        demo._wait_for_url()
        if state_dir is None:  # The demo made a temporary directory and says where.
            files = _FILES.search(demo.output())
            assert files is not None, demo.output()
            demo.layout = DemoLayout(Path(files["root"]), notebook_dir)
        return demo

    def banner(self, pattern: re.Pattern[str], group: str) -> str:
        """What the ready banner says on the line ``pattern`` matches."""
        found = pattern.search(self.output())
        assert found is not None, self.output()
        return found[group]

    @property
    def notebooks_line(self) -> str:
        """Where the banner says notebooks are saved."""
        return self.banner(_NOTEBOOKS, "dir")

    @property
    def cli_line(self) -> str:
        """The shell line the banner gives for ``jupyter gpu-hotplug status``."""
        return self.banner(_CLI, "line")

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def logs(self) -> str:
        """What the demo and its children wrote: for failure messages."""
        parts = [f"--- demo output ---\n{self.output()}"]
        for log in (self.layout.agent_log, self.layout.lab_log):
            if log.exists():
                parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-6000:]}")
        return "\n".join(parts)

    def _wait_for_url(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while (match := _URL.search(self.output())) is None:
            if self.process.poll() is not None:
                raise DemoFailed(f"the demo exited with {self.process.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise DemoFailed(f"no URL from the demo in {START_TIMEOUT} s:\n{self.logs()}")
            time.sleep(_POLL)
        self.base_url, self.token = match["base"], match["token"]
        started = _STARTED_IN.search(self.output())
        self.startup_seconds = float(started["seconds"]) if started else float("nan")
        self.remember_processes()

    @property
    def server(self) -> JupyterServer:
        return JupyterServer(self.base_url, self.token)

    def agent(self) -> AgentClient:
        """The demo's agent, asked as root over its unix socket."""
        return AgentClient(self.layout.agent_url, retry=RetryPolicy(attempts=1))

    def remember_processes(self) -> list[Proc]:
        """Add the demo's current process tree to ``seen``; returns the tree now."""
        tree = process_tree(self.process.pid) if self.process.poll() is None else []
        self.seen.update(tree)
        return tree

    def child(self, marker: str) -> Proc:
        """The demo's process whose command line contains ``marker`` (its agent, its lab)."""
        tree = self.remember_processes()
        [found] = [p for p in tree[1:] if any(marker in part for part in p.cmdline()[:3])]
        return found

    def interrupt(self, timeout: float = STOP_TIMEOUT, *, signum: int = signal.SIGINT) -> int:
        """Ctrl-C (SIGINT to the demo alone; or ``signum``) and wait; its exit code."""
        self.remember_processes()
        self.process.send_signal(signum)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired as e:
            raise DemoFailed(f"the demo did not stop in {timeout} s:\n{self.logs()}") from e

    def wait(self, timeout: float = STOP_TIMEOUT) -> int:
        """Wait for the demo to end by itself; its exit code."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired as e:
            raise DemoFailed(f"the demo did not end in {timeout} s:\n{self.logs()}") from e

    def kill_everything(self) -> None:
        """Safety net after a failed test: end the demo's tree and remove its sandboxes."""
        if self.process.poll() is None:
            self.remember_processes()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.send_signal(signal.SIGINT)
                self.process.wait(STOP_TIMEOUT)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for process in self.seen:
            process.kill()
        # Their owners are dead now, so these are stale: only this demo's sandboxes go.
        cleanup_stale(SANDBOX_NAME_PREFIX, cgroup_parent=DEFAULT_KERNEL_CGROUP_PARENT)
