"""Fixtures of the real-GPU tier: the machine, a local-mode agent on its NVML, sandboxes whose
processes run the tier's workloads, and each step's part of the report.

This conftest must also load where the rest of the suite's plugins cannot: on the GPU machine
``run-on-device.sh`` runs ``pytest -c tests/gpu/pytest.ini`` (no Jupyter, Playwright or
jsonschema there), which loads only this file and ``tests.fixtures.sandbox``. Everything used
here is the standard library, ``pytest``, the package and its ``nvidia-ml-py``, ``tornado``,
``traitlets`` and ``prometheus_client``.

``JGH_GPU_OUT`` names the folder the report (``real-gpu.md``), its raw record and the agent's
log are written to (``$OUT`` on the GPU machine); the report is rewritten after every test, so a
run stopped by its time limit still leaves what it saw.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Final

import pytest

from jupyter_gpu_hotplug.client import AgentClient, AgentClientError, RetryPolicy
from tests.fixtures.agent import free_tcp_port, terminate
from tests.fixtures.sandbox import SandboxSession

from .harness import GpuAgent, GpuRun, GpuSandboxes
from .machine import GpuMachine, detect, not_here_reason
from .report import Report, Step

OUT_ENV: Final = "JGH_GPU_OUT"
_HERE: Final = Path(__file__).parent
AGENT_START_TIMEOUT: Final = 60.0


# --- the report ---------------------------------------------------------------------------------


def _report_dir() -> Path | None:
    out = os.environ.get(OUT_ENV)
    return Path(out) if out else None


_REPORT = Report(_report_dir() or Path("/nonexistent"))
"""One per process: the hook below and the fixtures fill the same report."""


def _step(item: pytest.Item) -> Step:
    """The report's section of test ``item``, titled by its docstring's first line."""
    function = getattr(item, "function", None)
    title = ((function.__doc__ if function else None) or item.name).strip().splitlines()[0]
    return _REPORT.step(item.name, title.rstrip("."))


@pytest.fixture(scope="session")
def gpu_report() -> Report:
    """The session's report; written only where ``JGH_GPU_OUT`` names a folder."""
    return _REPORT


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Each test's verdict goes into its section (failures with their message); the report is
    written after each test."""
    result = yield
    if not item.path.is_relative_to(_HERE) or _report_dir() is None:
        return result
    step = _step(item)
    if result.when == "call" or (result.when == "setup" and not result.passed):
        if result.skipped:
            reason = result.longrepr[2] if isinstance(result.longrepr, tuple) else ""
            step.verdict = f"skipped: {reason.removeprefix('Skipped: ')}"
        elif result.failed:
            crash = getattr(result.longrepr, "reprcrash", None)
            message = getattr(crash, "message", str(result.longrepr))
            step.verdict = f"FAILED at {result.when}: {message}"
        else:
            step.verdict = "passed"
    if result.when == "teardown":
        if result.failed:
            step.verdict += " (teardown FAILED)"
        _REPORT.write()
    return result


# --- the machine and the agent ------------------------------------------------------------------


@pytest.fixture(scope="session")
def gpu_machine() -> Iterator[GpuMachine]:
    """The machine (real GPUs, or the rehearsal's simulated ones); skipped where neither."""
    reason = not_here_reason()
    if reason is not None:
        pytest.skip(reason)
    work_dir = Path(tempfile.mkdtemp(prefix="jgh-gpu-", dir="/tmp"))
    work_dir.chmod(0o755)
    try:
        yield detect(work_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def gpu_agent(gpu_machine: GpuMachine) -> Iterator[GpuAgent]:
    """The agent, as ``jupyter gpu-hotplug agent`` runs it on a single GPU server."""
    state_dir = gpu_machine.work_dir / "agent-state"
    log_path = gpu_machine.work_dir / "agent.log"
    port = free_tcp_port()
    argv = [
        sys.executable,
        "-m",
        "jupyter_gpu_hotplug.agent.app",
        "--backend=local",
        f"--state-dir={state_dir}",
        f"--listen=127.0.0.1:{port}",
        f"--listen=unix:{gpu_machine.work_dir / 'agent.sock'}",
        "--reconcile-interval=2",
        *gpu_machine.agent_args(),
    ]
    with log_path.open("wb") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    agent = GpuAgent(
        process=process,
        state_dir=state_dir,
        log_path=log_path,
        client=AgentClient(
            f"http://127.0.0.1:{port}",
            token_path=state_dir / "token",
            retry=RetryPolicy(attempts=1),
        ),
    )
    try:
        _wait_ready(agent)
        yield agent
    finally:
        clean = terminate(process)
        out = _report_dir()
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log_path, out / "agent.log")
        assert clean and process.returncode == 0, f"the agent did not stop cleanly:\n{agent.log()}"


def _wait_ready(agent: GpuAgent) -> None:
    deadline = time.monotonic() + AGENT_START_TIMEOUT
    while True:
        if agent.process.poll() is not None:
            pytest.fail(f"the agent exited with {agent.process.returncode}:\n{agent.log()}")
        try:
            agent.client.gpus()
            return
        except AgentClientError:
            if time.monotonic() > deadline:
                pytest.fail(f"the agent did not answer in {AGENT_START_TIMEOUT} s:\n{agent.log()}")
            time.sleep(0.1)


@pytest.fixture
def gpu_sandboxes(
    gpu_machine: GpuMachine, sandbox_session: SandboxSession
) -> Iterator[GpuSandboxes]:
    sandboxes = GpuSandboxes(gpu_machine, sandbox_session)
    try:
        yield sandboxes
    finally:
        sandboxes.stop_all()


@pytest.fixture
def run(
    gpu_machine: GpuMachine,
    gpu_agent: GpuAgent,
    gpu_sandboxes: GpuSandboxes,
    gpu_report: Report,
    request: pytest.FixtureRequest,
) -> GpuRun:
    """Everything a step uses, with this test's section of the report."""
    return GpuRun(gpu_machine, gpu_agent, gpu_sandboxes, gpu_report, _step(request.node))
