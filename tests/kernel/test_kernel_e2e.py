"""``%gpu`` end to end: a real ipykernel in a sandbox, a real local agent, simulated GPUs.

The kernel is started the way local mode starts every kernel — by jupyter_client through the
sandbox provisioner (a kernelspec naming it) — so it has its own mount namespace with a private
``/dev`` and device cgroups that deny every GPU. Its ``pynvml`` loads the fake NVML with the
agent's simulated node and the container view (``FAKE_NVML_DEVICE_FILTER=/dev``): a GPU is
visible only while its ``/dev/nvidia<minor>`` exists in the kernel's ``/dev``. The agent is
reached over its unix socket, so it identifies the kernel by its process credentials, exactly
as in production local mode.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager, start_new_async_kernel

from jupyter_gpu_hotplug.nvml.sim import CONFIG_ENV, DEVICE_FILTER_ENV, SimulatedProcess
from jupyter_gpu_hotplug.sandboxes.provisioner import (
    sandboxed_kernelspec,
    write_sandboxed_kernelspec,
)
from tests.fixtures.agent import LocalAgent
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import NAME_PREFIX, SandboxSession, host_pid

from .cuda_stand_in import build_stand_in

pytestmark = [*needs_root, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNEL_NAME = "gpu-hotplug-e2e"
DEADLINE_S = 60.0
"""Upper bound for a kernel to start or answer on a loaded shared machine; never asserted."""

HELPERS = """
import asyncio as _asyncio, json as _json, os as _os

def _visible_gpus():
    import pynvml
    pynvml.nvmlInit()
    try:
        return [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()

def _gpu_nodes():
    return sorted(n for n in _os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit())

def _monitor():
    import ipywidgets
    return next(w for w in ipywidgets.widgets.widget._instances.values()
                if type(w).__name__ == "GpuMonitorWidget")

async def _until(condition, what, deadline=60.0):
    loop = _asyncio.get_running_loop()
    end = loop.time() + deadline
    while not condition():
        if loop.time() > end:
            raise TimeoutError(f"timed out waiting until {what}")
        await _asyncio.sleep(0.02)
"""


@dataclass
class Result:
    """What one execution produced."""

    status: str
    stdout: str = ""
    stderr: str = ""
    error: list[str] = field(default_factory=list)
    """The traceback lines of an error (for our errors: the message alone)."""
    ename: str | None = None
    displays: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Kernel:
    manager: AsyncKernelManager
    client: AsyncKernelClient

    async def execute(self, code: str) -> Result:
        result = Result(status="")

        def on_output(message: dict[str, Any]) -> None:
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                name = content["name"]
                setattr(result, name, getattr(result, name) + content["text"])
            elif kind in ("display_data", "update_display_data", "execute_result"):
                result.displays.append(content["data"])
            elif kind == "error":
                result.ename = content["ename"]
                result.error = list(content["traceback"])

        reply = await self.client.execute_interactive(
            code, timeout=DEADLINE_S, output_hook=on_output
        )
        result.status = reply["content"]["status"]
        if result.status == "error":
            # UsageError sends no error message, only stderr text; the reply names it.
            result.ename = reply["content"]["ename"]
        return result

    async def run(self, code: str) -> str:
        """Execute ``code`` that must succeed; its stdout."""
        result = await self.execute(code)
        if result.status != "ok":
            pytest.fail(f"kernel error {result.ename}:\n" + "\n".join(result.error))
        return result.stdout

    async def shown(self, code: str) -> tuple[str, str]:
        """Execute ``code`` that must succeed; the plain text and the HTML it displayed."""
        result = await self.execute(code)
        if result.status != "ok":
            pytest.fail(f"kernel error {result.ename}:\n" + "\n".join(result.error))
        plain = "".join(data.get("text/plain", "") for data in result.displays)
        return plain, "".join(data.get("text/html", "") for data in result.displays)

    async def eval(self, expression: str) -> Any:
        return json.loads(await self.run(f"print(_json.dumps({expression}))"))


@pytest.fixture
async def kernel(
    local_agent: LocalAgent,
    fake_nvml_library: Path,
    sandbox_session: SandboxSession,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Kernel]:
    """A sandboxed ipykernel that sees the agent's simulated GPUs through its own ``/dev``."""
    data_dir = tmp_path / "jupyter-data"
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    spec = sandboxed_kernelspec(
        display_name="GPU hot-plug end-to-end test",
        env={
            "LD_LIBRARY_PATH": str(fake_nvml_library),
            CONFIG_ENV: str(local_agent.simulation_config),
            DEVICE_FILTER_ENV: "/dev",
            "GPU_HOTPLUG_AGENT_URL": local_agent.unix_url,
            "PYTHONPATH": pythonpath,
        },
        # Below this run's cgroup parent, so the sandbox session's leftover check covers it.
        config={"name_prefix": NAME_PREFIX, "cgroup_parent": sandbox_session.cgroup_parent},
    )
    write_sandboxed_kernelspec(data_dir / "kernels", KERNEL_NAME, spec=spec)
    monkeypatch.setenv("JUPYTER_PATH", str(data_dir))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.delenv("GPU_HOTPLUG_TOKEN_PATH", raising=False)
    manager, client = await start_new_async_kernel(
        kernel_name=KERNEL_NAME, startup_timeout=DEADLINE_S
    )
    kernel = Kernel(manager, client)
    try:
        await kernel.run(f"%load_ext jupyter_gpu_hotplug\n{HELPERS}")
        yield kernel
    finally:
        client.stop_channels()
        await manager.shutdown_kernel(now=True)


def _index(out: str) -> int:
    """The node's number of the GPU an ``%gpu attach 1`` reported."""
    found = re.search(r"^  GPU (\d+)  ", out, re.MULTILINE)
    assert found is not None, out
    return int(found.group(1))


def _attached(out: str) -> tuple[str, int]:
    """The UUID and minor an ``%gpu attach 1`` reported (the node's number leads, the UUID
    comes last)."""
    found = re.search(r"  GPU \d+  .*  /dev/nvidia(\d+)  .*  (GPU-[0-9a-f-]{36})", out)
    assert found is not None, out
    return found.group(2), int(found.group(1))


async def test_attach_makes_the_gpu_visible_to_the_kernel_and_detach_removes_it(
    kernel: Kernel, local_agent: LocalAgent
) -> None:
    before = await kernel.eval("[_visible_gpus(), _gpu_nodes()]")

    attached = await kernel.run("%gpu attach 1")
    uuid, minor = _attached(attached)
    during = await kernel.eval("[_visible_gpus(), _gpu_nodes()]")
    status, status_html = await kernel.shown("%gpu status")
    listing, listing_html = await kernel.shown("%gpu list")
    released = await kernel.run("%gpu detach all")
    after = await kernel.eval("[_visible_gpus(), _gpu_nodes()]")

    assert before == [[], []]
    assert attached.startswith("Attached 1 GPU to this kernel:\n")
    assert "GPU ready: CUDA has not started in this kernel" in attached
    assert "already initialised" not in attached
    assert uuid in {gpu.uuid for gpu in local_agent.gpus()}
    assert during == [[uuid], [f"nvidia{minor}"]]
    # In a kernel the tables are HTML (full UUIDs one click away) with a text form.
    assert status.startswith("This notebook: 1 GPU attached (SIMULATED)\n")
    assert uuid[:12] in status and uuid not in status
    assert "This kernel sees (NVML): 1 GPU (SIMULATED)." in status
    assert "CUDA: not started in this kernel" in status
    assert max(len(line) for line in status.split("\n")) <= 80
    assert f'<code style="user-select: all">{uuid}</code>' in status_html
    assert any(
        uuid[:12] in line and "attached  this kernel" in line for line in listing.split("\n")
    )
    assert '<table class="gpuhp-table">' in listing_html
    assert released == f"Detached GPU {_index(attached)} (1 GPU).\n"
    assert after == [[], []]


async def test_cuda_warning_when_libcuda_is_mapped(kernel: Kernel, tmp_path: Path) -> None:
    stand_in = build_stand_in(tmp_path / "stand-in-cuda")
    await kernel.run(f"import ctypes\n_libcuda = ctypes.CDLL({str(stand_in)!r})")

    attached = await kernel.run("%gpu attach 1")
    status, _ = await kernel.shown("%gpu status")
    await kernel.run("%gpu detach all")

    assert "CUDA is already initialised in this kernel" in attached
    assert str(stand_in) in attached
    assert "THIS kernel will not see the new GPU" in attached
    assert "!python train.py" in attached
    assert "GPU ready" not in attached
    assert "CUDA: already initialised in this kernel" in status


async def test_monitor_widget_shows_the_attached_gpu_without_being_recreated(
    kernel: Kernel,
) -> None:
    shown = await kernel.execute("%gpu monitor --interval 0.1")
    await kernel.run("_w = _monitor(); _first = _w.rows_box")
    empty = await kernel.eval("len(_w.rows)")

    uuid, _ = _attached(await kernel.run("%gpu attach 1"))
    await kernel.run("await _until(lambda: len(_w.rows) == 1, 'the GPU has a row')")
    rows = await kernel.eval("[list(_w.rows), _monitor() is _w, _w.rows_box is _first]")
    await kernel.run("%gpu detach all")
    await kernel.run("await _until(lambda: not _w.rows, 'the row is gone')")
    await kernel.run("_w.close(); await _w.wait_closed()")
    leftovers = await kernel.eval(
        "[t.get_name() for t in _asyncio.all_tasks() if t.get_name().startswith('gpu-hotplug')]"
    )

    assert shown.status == "ok"
    assert any("application/vnd.jupyter.widget-view+json" in data for data in shown.displays)
    assert empty == 0
    assert rows == [[uuid], True, True]
    assert leftovers == []


async def test_errors_are_messages_not_tracebacks(kernel: Kernel) -> None:
    await kernel.run("%gpu attach 2")  # every GPU of the node
    exhausted = await kernel.execute("%gpu attach 1")
    too_many = await kernel.execute("%gpu attach 3")
    far_too_many = await kernel.execute("%gpu attach 99")
    bad = await kernel.execute("%gpu attach 0")
    unknown = await kernel.execute("%gpu detach GPU-00000000-0000-0000-0000-000000000000")
    await kernel.run("%gpu detach all")

    for failed in (exhausted, too_many, far_too_many, unknown):
        assert (failed.status, failed.ename) == ("error", "GpuCommandError")
        assert not any("Traceback" in line or "File " in line for line in failed.error)
    assert exhausted.error[0].startswith("1 GPU(s) requested but 0 free on this node")
    # None free: the message says how to wait (waiting cannot help when the node has too few).
    assert exhausted.error[1] == (
        "To wait for one in the queue (first come, first served): %gpu attach 1 --wait 120"
    )
    assert exhausted.error[2] == "'%gpu list' shows the node's GPUs and who holds them."
    # More than the node has: one message, whatever the agent objected to (issue 14).
    assert too_many.error[0] == "Cannot attach 3 GPUs: this node has 2 GPUs in all (0 free now)."
    assert far_too_many.error[0] == (
        "Cannot attach 99 GPUs: this node has 2 GPUs in all (0 free now)."
    )
    assert far_too_many.error[1:] == exhausted.error[2:]
    assert not any("openapi" in line for line in far_too_many.error)
    assert "not found" in unknown.error[0]
    assert (bad.status, bad.ename) == ("error", "UsageError")
    assert "N must be a positive whole number" in bad.stderr


async def test_busy_gpu_is_refused_then_force_stops_the_process(
    kernel: Kernel, local_agent: LocalAgent
) -> None:
    attached = await kernel.run("%gpu attach 1")
    uuid, _ = _attached(attached)
    index = _index(attached)
    inner = int(
        await kernel.run(
            "import subprocess\n_child = subprocess.Popen(['sleep', '600'])\nprint(_child.pid)"
        )
    )
    # NVML names processes as the host numbers them, not as the kernel's pid namespace does.
    sandbox = kernel.manager.provisioner.sandbox  # type: ignore[union-attr]
    child = host_pid(sandbox, inner)
    local_agent.update_gpu(uuid, processes=(SimulatedProcess(child, 2**30),))

    refused = await kernel.execute("%gpu detach")
    forced = await kernel.run("%gpu detach --force")
    exited = await kernel.eval("_child.wait(60)")

    assert refused.ename == "GpuCommandError"
    assert re.search(r"%gpu detach \d+ --force$", refused.error[-1]), refused.error
    assert re.match(rf"GPU {index} is in use by process\(es\) ", refused.error[0]), refused.error
    assert forced.splitlines() == [
        f"--force: processes of this kernel's container that use GPU {index} will be stopped "
        "(SIGTERM, then SIGKILL) before the release.",
        f"Detached GPU {index} (1 GPU).",
    ]
    assert exited != 0
    assert await kernel.eval("_gpu_nodes()") == []
