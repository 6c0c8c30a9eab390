"""How the demo ends: on SIGTERM like on Ctrl-C, and when one of its children dies.

The promise under test: whatever ends the demo, everything else is stopped and the user is
told. A child dying unexpectedly makes the demo stop the other one, remove the kernels'
sandboxes, exit with status 1 and say which child died — keeping its directory, whose logs
explain why.
"""

from __future__ import annotations

import signal

import pytest

from ..fixtures.requirements import needs_root
from . import leftovers
from .conftest import DemoFactory
from .demo_process import DemoProcess

pytestmark = [*needs_root, pytest.mark.slow, pytest.mark.timeout(600)]

AGENT_MARKER = "jupyter_gpu_hotplug.agent.app"
LAB_MARKER = "jupyterlab"


def kernel_with_gpu(demo: DemoProcess) -> str:
    """A kernel in a sandbox, holding one GPU (attached through the server extension)."""
    server = demo.server
    kernel_id = server.start_kernel()
    with server.connect(kernel_id) as session:
        session.run("1 + 1")
    answer = server.request("POST", "gpu-hotplug/api/attach", {"count": 1, "kernel_id": kernel_id})
    assert answer.status == 201, answer
    return kernel_id


def assert_nothing_running(demo: DemoProcess) -> None:
    assert leftovers.still_running(list(demo.seen)) == []
    assert leftovers.demo_sandboxes(demo.seen) == []


def test_sigterm_stops_everything_and_removes_the_temporary_directory(
    demo_factory: DemoFactory,
) -> None:
    demo = demo_factory(temporary=True)
    assert demo.layout.agent_socket.exists()
    kernel_with_gpu(demo)
    demo.remember_processes()

    assert demo.interrupt(signum=signal.SIGTERM) == 0, demo.logs()

    assert "SIGTERM: stopping" in demo.output()
    assert f"demo's files removed (notebooks kept in {demo.layout.notebooks})" in demo.output()
    assert not demo.layout.root.exists()
    assert_nothing_running(demo)


def test_agent_dying_stops_jupyterlab_and_its_kernels(demo_factory: DemoFactory) -> None:
    demo = demo_factory()
    kernel_with_gpu(demo)
    demo.remember_processes()

    demo.child(AGENT_MARKER).kill()

    assert demo.wait() == 1, demo.logs()
    output = demo.output()
    assert "the node agent was killed by SIGKILL unexpectedly" in output, output
    assert "stopping JupyterLab and its kernels" in output
    assert f"the demo's files are kept in {demo.layout.root}" in output
    assert demo.layout.agent_log.exists()
    assert_nothing_running(demo)


def test_jupyterlab_dying_releases_every_gpu_and_stops_the_agent(
    demo_factory: DemoFactory,
) -> None:
    demo = demo_factory()
    kernel_with_gpu(demo)
    demo.remember_processes()
    assert len(leftovers.demo_sandboxes(demo.seen)) >= 1

    demo.child(LAB_MARKER).kill()

    assert demo.wait() == 1, demo.logs()
    output = demo.output()
    assert "the JupyterLab was killed by SIGKILL unexpectedly" in output, output
    assert "releasing GPUs and stopping the node agent" in output
    assert_nothing_running(demo)
    assert leftovers.read_ledger(demo.layout.agent_state).attachments == []
