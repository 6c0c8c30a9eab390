"""The real-GPU tier's handles: the agent process and the sandboxes' workloads.

Kept apart from ``conftest.py`` (which only makes fixtures of them) so that the steps can name
these types.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from jupyter_gpu_hotplug.client import AgentClient
from tests.fixtures.probe_client import PROBE_SCRIPT
from tests.fixtures.sandbox import SandboxFactory, SandboxProbe, SandboxSession

from .machine import GpuMachine
from .report import Report, Step

__all__ = ["TASK_TIMEOUT", "WORKLOAD", "GpuAgent", "GpuRun", "GpuSandboxes", "Task"]

WORKLOAD: Final = Path(__file__).with_name("workload.py")
TASK_TIMEOUT: Final = 180.0
"""Seconds one workload may take (a first CUDA start with a cold cache takes tens)."""
_POLL: Final = 0.02


@dataclass
class GpuAgent:
    """A local-mode agent process on the machine's NVML, and a client holding its token."""

    process: subprocess.Popen[bytes]
    state_dir: Path
    log_path: Path
    client: AgentClient

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        """User + system CPU time the agent has used so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Task:
    """A workload started inside a sandbox: its pid (ours) and where its answer will be."""

    pid: int
    result: Path

    def answer(self, timeout: float = TASK_TIMEOUT, *, suffix: str = "") -> dict[str, Any]:
        """The workload's answer (``suffix`` ``.before``: its first one), waiting for it."""
        path = self.result.with_name(self.result.name + suffix)
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"no answer in {path} within {timeout} s")
            time.sleep(_POLL)
        answer: dict[str, Any] = json.loads(path.read_text())
        return answer


class GpuSandboxes:
    """Starts probe sandboxes in the machine's environment and runs workloads in them."""

    def __init__(self, machine: GpuMachine, session: SandboxSession) -> None:
        self.machine = machine
        self._factory = SandboxFactory(session)
        self._session = session

    def start(self) -> SandboxProbe:
        """A sandbox (container defaults: no GPU, the host's control nodes) with its probe."""
        spec = self._session.spec(
            (sys.executable, "-I", "-S", str(PROBE_SCRIPT)),
            env=self.machine.environ(),
            cwd=str(self.machine.work_dir),
        )
        sandbox = self._factory.raw(spec, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return SandboxProbe(sandbox, self._session)

    def launch(self, probe: SandboxProbe, task: str, *args: str) -> Task:
        """Start ``workload.py task args`` inside ``probe``'s sandbox; do not wait."""
        # A name no earlier task (of this test or another) has used: answers are files.
        result = self.machine.work_dir / f"task-{secrets.token_hex(6)}-{task}.json"
        pid = probe.spawn([sys.executable, str(WORKLOAD), task, str(result), *args])
        return Task(pid, result)

    def run(self, probe: SandboxProbe, task: str, *args: str) -> dict[str, Any]:
        """Run ``workload.py task args`` inside ``probe``'s sandbox and return its answer."""
        return self.launch(probe, task, *args).answer()

    def stop_all(self) -> None:
        self._factory.stop_all()


@dataclass(frozen=True)
class GpuRun:
    """What every step uses: the machine, the agent, sandboxes, the report and its section."""

    machine: GpuMachine
    agent: GpuAgent
    sandboxes: GpuSandboxes
    report: Report
    record: Step
