"""The agent as a real subprocess (``python -m jupyter_gpu_hotplug.agent.app``), for the
agent's end-to-end tests: started, waited for, talked to, killed, and started again over the
same state (which ``tests.fixtures.agent``'s one-shot agents do not do).

The TCP port is chosen by the agent (``127.0.0.1:0``) and read back from its log, so parallel
runs never race for a port. The log (stderr) goes to a file that is shown when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_gpu_hotplug.agent.settings import TcpAddress, UnixAddress
from tests.fixtures.agent import agent_argv, terminate

from .api_harness import ApiClient

READY_TIMEOUT = 60.0
REPLY_TIMEOUT = 60.0
"""Seconds a request made by ``client_argv`` may take to be answered."""
UNIX_CLIENT = Path(__file__).with_name("_unix_client.py")
"""Runs one request over the agent's unix socket (no token) and writes the answer to a file."""
_SERVING = re.compile(r"serving the agent API on (\S+):(\d+)\s*$", re.MULTILINE)
_READY = "agent ready"


class AgentDied(AssertionError):
    """The agent exited (or never became ready); its log is in the message."""


@dataclass
class AgentProcess:
    """One agent subprocess over ``state_dir``; ``start`` it again after a kill."""

    state_dir: Path
    simulate: int = 4
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    argv: Sequence[str] | None = None
    """The whole command line (another backend's), instead of a local-mode agent's."""
    process: subprocess.Popen[bytes] | None = None
    tcp: ApiClient | None = None
    starts: int = 0

    @property
    def socket_path(self) -> Path:
        return self.state_dir.parent / f"{self.state_dir.name}.sock"

    @property
    def log_path(self) -> Path:
        return self.state_dir.parent / f"{self.state_dir.name}.log"

    @property
    def token(self) -> str:
        return (self.state_dir / "token").read_text().strip()

    @property
    def agent_token(self) -> str | None:
        """The local agent token; None where the agent keeps none (Kubernetes mode)."""
        path = self.state_dir / "token"
        return path.read_text().strip() if path.exists() else None

    @property
    def unix(self) -> ApiClient:
        return ApiClient(UnixAddress(self.socket_path))

    @property
    def pid(self) -> int:
        if self.process is None:
            raise AgentDied("the agent is not running")
        return self.process.pid

    def start(self, *, env: Mapping[str, str] | None = None) -> AgentProcess:
        """Start the agent and wait until it serves; ``env`` adds to ``self.env``."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("the agent is already running")
        self.starts += 1
        argv = (
            list(self.argv)
            if self.argv is not None
            else agent_argv(
                simulate=self.simulate,
                state_dir=self.state_dir,
                listen=["127.0.0.1:0", f"unix:{self.socket_path}"],
                args=self.extra_args,
            )
        )
        environ = {**os.environ, **self.env, **(env or {})}
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start {self.starts}: {' '.join(argv)}\n".encode())
            log.flush()
            offset = log.tell()
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=environ
            )
        self._wait_ready(offset)
        self.tcp = ApiClient(self._tcp_address(offset), self.agent_token)
        return self

    def _wait_ready(self, offset: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while _READY not in self._log_since(offset):
            if self.process is not None and self.process.poll() is not None:
                raise AgentDied(f"the agent exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AgentDied(f"the agent was not ready in {READY_TIMEOUT} s:\n{self.log()}")
            time.sleep(0.05)

    def _log_since(self, offset: int) -> str:
        with self.log_path.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def _tcp_address(self, offset: int) -> TcpAddress:
        matches = _SERVING.findall(self._log_since(offset))
        host, port = next((h, p) for h, p in reversed(matches) if not h.startswith("unix"))
        return TcpAddress(host, int(port))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill9(self) -> None:
        """``kill -9``: no cleanup of any kind, as in a crash."""
        process = self.process
        if process is None:
            return
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        self.process = None

    def stop(self) -> int:
        """SIGTERM and wait: the graceful stop."""
        process = self.process
        if process is None:
            return 0
        if not terminate(process):
            raise AgentDied(f"the agent ignored SIGTERM:\n{self.log()}")
        self.process = None
        return process.returncode


def client_argv(socket_path: Path, method: str, path: str, body: object, out: Path) -> list[str]:
    """The command line of one request over ``socket_path`` whose answer lands in ``out``."""
    payload = "-" if body is None else json.dumps(body)
    return [sys.executable, "-I", "-S", str(UNIX_CLIENT), str(socket_path), method, path,
            payload, str(out)]  # fmt: skip


def wait_for_answer(out: Path, agent: AgentProcess) -> dict[str, Any]:
    """The answer ``client_argv`` wrote to ``out`` (polled; the agent's log on a timeout)."""
    deadline = time.monotonic() + REPLY_TIMEOUT
    while not out.exists():
        assert time.monotonic() < deadline, f"no answer at {out}:\n{agent.log()}"
        time.sleep(0.02)
    result: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return result
