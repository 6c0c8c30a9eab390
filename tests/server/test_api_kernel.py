"""The REST API with real Jupyter kernels: one in a sandbox (the sandbox kernel provisioner)
and one plain, against a real local agent. Nothing stands in for the kernel-to-sandbox
mapping here: the extension asks the kernel's provisioner itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from jupyter_client.provisioning.factory import KernelProvisionerFactory
from jupyter_server.serverapp import ServerApp
from traitlets.config import Config

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.nvml.sim import CONFIG_ENV, SimulatedProcess
from jupyter_gpu_hotplug.sandboxes.provisioner import (
    SandboxedKernelProvisioner,
    sandboxed_kernelspec,
)
from tests.fixtures.agent import LocalAgent
from tests.fixtures.nvml import FakeNvml
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import NAME_PREFIX, SandboxSession
from tests.fixtures.waiting import DEADLINE

from .api_support import Fetch, call, manager_of

pytestmark = [*needs_root, pytest.mark.slow]

BOXED = "gpu-boxed"


@pytest.fixture
def provisioner_factory() -> Iterator[None]:
    """A fresh provisioner factory: it reads its configuration only when first created."""
    KernelProvisionerFactory.clear_instance()
    yield
    KernelProvisionerFactory.clear_instance()


@pytest.fixture
def jp_server_config(
    jp_server_config: Config,
    local_agent: LocalAgent,
    jp_kernel_dir: Path,
    sandbox_session: SandboxSession,
    provisioner_factory: None,
) -> Config:
    """Local mode against the agent; kernels of the ``gpu-boxed`` kernelspec are sandboxed
    (below this run's cgroup parent, so the session's leftover check covers them)."""
    settings = jp_server_config.GPUHotplug
    settings.agent_url = local_agent.tcp_url
    settings.token_path = str(local_agent.token_path)
    settings.mode = "local"
    spec = sandboxed_kernelspec(
        config={"name_prefix": NAME_PREFIX, "cgroup_parent": sandbox_session.cgroup_parent}
    )
    (jp_kernel_dir / BOXED).mkdir(parents=True)
    (jp_kernel_dir / BOXED / "kernel.json").write_text(json.dumps(spec))
    return jp_server_config


StartKernel = Callable[[str], Awaitable[str]]


@pytest.fixture
async def start_kernel(jp_serverapp: ServerApp, jp_fetch: Fetch) -> AsyncIterator[StartKernel]:
    """Start kernels through the REST API; every one is shut down at the end."""
    started: list[str] = []

    async def start(name: str) -> str:
        response = await jp_fetch(
            "api",
            "kernels",
            method="POST",
            body=json.dumps({"name": name}),
            request_timeout=DEADLINE,  # a sandboxed start on a loaded machine: over 20 s
        )
        kernel_id: str = json.loads(response.body)["id"]
        started.append(kernel_id)
        return kernel_id

    try:
        yield start
    finally:
        manager = jp_serverapp.kernel_manager
        for kernel_id in started:
            if kernel_id in manager:
                await manager.shutdown_kernel(kernel_id, now=True)  # type: ignore[no-untyped-call]


def _device_in(pid: int, name: str) -> tuple[int, int] | None:
    """``(major, minor)`` of ``/dev/<name>`` as process ``pid`` sees it (its mount namespace)."""
    try:
        info = os.stat(f"/proc/{pid}/root/dev/{name}")
    except FileNotFoundError:
        return None
    assert stat.S_ISCHR(info.st_mode)
    return os.major(info.st_rdev), os.minor(info.st_rdev)


async def test_attach_to_a_sandboxed_kernel_and_refuse_a_plain_one(
    jp_fetch: Fetch, jp_serverapp: ServerApp, start_kernel: StartKernel
) -> None:
    boxed = await start_kernel(BOXED)
    plain = await start_kernel("python3")
    provisioner = jp_serverapp.kernel_manager.get_kernel(boxed).provisioner
    assert isinstance(provisioner, SandboxedKernelProvisioner)
    pid = provisioner.sandbox_pid
    assert pid is not None

    attached = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": boxed})

    assert attached.status == 201
    (attachment,) = attached.json()["attachments"]
    assert attachment["target"] == {"pid": pid}
    assert _device_in(pid, "nvidia0") == (195, 0)
    assert not Path("/dev/nvidia0").exists()  # the server's own /dev is untouched
    listed = await call(jp_fetch, "GET", "gpus", params={"kernel_id": boxed})
    assert [gpu["uuid"] for gpu in listed.json()["attached"]] == [attachment["uuid"]]

    refused = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": plain})

    message = refused.error(422, "target_not_ready")["message"]
    assert f"kernel {plain} does not run in a GPU sandbox" in message

    detached = await call(jp_fetch, "POST", "detach", {"uuid": "all", "kernel_id": boxed})

    assert detached.status == 204
    assert _device_in(pid, "nvidia0") is None


async def test_shutting_down_a_waiting_kernel_takes_its_attach_out_of_the_queue(
    jp_fetch: Fetch, jp_serverapp: ServerApp, start_kernel: StartKernel
) -> None:
    holder, waiter = await start_kernel(BOXED), await start_kernel(BOXED)
    taken = await call(jp_fetch, "POST", "attach", {"count": 2, "kernel_id": holder})
    assert taken.status == 201
    body = {"count": 1, "kernel_id": waiter, "wait_seconds": 60, "request_id": "closing"}
    pending = asyncio.create_task(call(jp_fetch, "POST", "attach", body))
    provisioner = jp_serverapp.kernel_manager.get_kernel(waiter).provisioner
    assert isinstance(provisioner, SandboxedKernelProvisioner)
    assert provisioner.sandbox_pid is not None
    sandbox = PidRef(provisioner.sandbox_pid)
    client = manager_of(jp_serverapp).client
    async with asyncio.timeout(DEADLINE):
        while [request.request_id for request in await client.queued(sandbox)] != ["closing"]:
            await asyncio.sleep(0.05)

    await jp_serverapp.kernel_manager.shutdown_kernel(waiter, now=True)  # type: ignore[no-untyped-call]

    refused = await asyncio.wait_for(pending, DEADLINE)
    assert refused.status == 404, refused.body
    # Nothing waits any more: both GPUs, once free, go to an attach that does not wait.
    await call(jp_fetch, "POST", "detach", {"uuid": "all", "kernel_id": holder})
    again = await call(jp_fetch, "POST", "attach", {"count": 2, "kernel_id": holder})
    assert again.status == 201, again.body
    await call(jp_fetch, "POST", "detach", {"uuid": "all", "kernel_id": holder})


async def test_attribution_finds_real_kernels_and_their_notebooks(
    jp_fetch: Fetch,
    jp_serverapp: ServerApp,
    start_kernel: StartKernel,
    local_agent: LocalAgent,
    fake_nvml: FakeNvml,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 36: a plain kernel (no sandbox: Kubernetes mode's kind) is found by its own
    process, a sandboxed one by its sandbox's; a notebook session names its kernel."""
    monkeypatch.setenv(CONFIG_ENV, str(local_agent.simulation_config))
    session = await jp_fetch(
        "api",
        "sessions",
        method="POST",
        body=json.dumps({"path": "train.ipynb", "type": "notebook", "kernel": {"name": "python3"}}),
        request_timeout=DEADLINE,
    )
    plain: str = json.loads(session.body)["kernel"]["id"]
    boxed = await start_kernel(BOXED)
    manager = jp_serverapp.kernel_manager
    plain_pid = manager.get_kernel(plain).provisioner.pid  # type: ignore[union-attr]
    provisioner = manager.get_kernel(boxed).provisioner
    assert isinstance(provisioner, SandboxedKernelProvisioner)
    sandbox_pid = provisioner.sandbox_pid
    assert sandbox_pid is not None
    uuid = local_agent.gpus()[0].uuid
    local_agent.update_gpu(
        uuid,
        processes=(SimulatedProcess(plain_pid, 2**30, 20), SimulatedProcess(sandbox_pid, 2**31)),
    )
    try:
        reply = await call(jp_fetch, "GET", "attribution")
    finally:
        await manager.shutdown_kernel(plain, now=True)  # type: ignore[no-untyped-call]

    gpu = next(gpu for gpu in reply.json()["gpus"] if gpu["uuid"] == uuid)
    assert [(k["kernel_id"], k["notebook"], k["memory_bytes"]) for k in gpu["kernels"]] == [
        (boxed, None, 2**31),
        (plain, "train.ipynb", 2**30),
    ]
