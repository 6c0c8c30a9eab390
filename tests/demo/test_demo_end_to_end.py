"""Acceptance of the one-command demo (issue 6), end to end, as a user runs it.

``jupyter gpu-hotplug demo --simulate 2 --no-browser --port P`` runs as a subprocess. The test
then behaves like two browser tabs: it starts two kernels through the Jupyter REST API and
drives them over the server's kernel websocket (``jupyter_api``), uses the server extension's
REST API like the toolbar does, and asks the agent (as root, over its socket) who owns what.
Finally it presses Ctrl-C and inspects the host from outside (``leftovers``).

Proof of "sees / cannot open" uses the kernel's own eyes: its ``/dev``, its ``pynvml`` (the
fake NVML filtered by ``/dev``, as NVML in a container) and opening the GPU's device numbers.
There is no driver, so opening an allowed ``c 195:N`` gives ENXIO while the sandbox's device
cgroup answers EPERM for a GPU it does not allow (DESIGN §5).

Restart behaviour, as documented in the starter notebook and the README: a restarted kernel
runs in a new sandbox with a new pid; the agent's reconciler sees the old pid gone and releases
its GPUs (the demo runs it every 2 s), and the new kernel starts without a GPU.
"""

from __future__ import annotations

import textwrap
import time
from typing import Any

import pytest

from jupyter_gpu_hotplug._structs import SANDBOX_PID_ENV, PidRef
from jupyter_gpu_hotplug.client import Gpu

from ..fixtures.host_state import bpf_program_loaded, changed_mounts, mount_table
from ..fixtures.requirements import needs_root
from . import leftovers
from .conftest import DemoFactory
from .demo_process import DemoProcess
from .jupyter_api import KernelSession

pytestmark = [*needs_root, pytest.mark.slow, pytest.mark.timeout(900)]

RELEASE_TIMEOUT = 60.0
"""Seconds for the agent to release a restarted kernel's GPU (reconciles every 2 s)."""

# Defines _gpu_probe() in a kernel: what this kernel can see and open, as one JSON line.
PROBE = textwrap.dedent(
    """
    import errno as _errno, glob as _glob, json as _json, os as _os, re as _re, stat as _stat

    def _can_open(minor):
        path, made = f"/dev/nvidia{minor}", None
        if not _os.path.exists(path):
            # No node: make one with the GPU's numbers; the device cgroup decides (mknod or open).
            path = made = f"/dev/.probe-nvidia{minor}"
            try:
                _os.mknod(path, _stat.S_IFCHR | 0o600, _os.makedev(195, minor))
            except OSError as error:
                return _errno.errorcode[error.errno]
        try:
            _os.close(_os.open(path, _os.O_RDWR))
        except OSError as error:
            return _errno.errorcode[error.errno]
        finally:
            if made:
                _os.unlink(made)
        return "opened"

    def _gpu_probe(minors):
        import pynvml
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                     for i in range(count)]
        finally:
            pynvml.nvmlShutdown()
        nodes = sorted(p for p in _glob.glob("/dev/nvidia*")
                       if _re.fullmatch(r"/dev/nvidia[0-9]+", p))
        # The pid the agent names this kernel by: its sandbox's, not its own namespace's.
        pid = int(_os.environ["SANDBOX_PID_ENV"])
        print(_json.dumps({"pid": pid, "nodes": nodes, "nvml": uuids,
                           "open": {str(m): _can_open(m) for m in minors}}))
    """
).replace("SANDBOX_PID_ENV", SANDBOX_PID_ENV)


def probe(session: KernelSession) -> dict[str, Any]:
    result: dict[str, Any] = session.run("_gpu_probe([0, 1])").json()
    return result


def owned_by(demo: DemoProcess, pid: int) -> list[Gpu]:
    """The GPUs the demo's agent says are attached to process ``pid``."""
    return [
        gpu
        for gpu in demo.agent().gpus()
        if gpu.state == "attached" and isinstance(gpu.target, PidRef) and gpu.target.pid == pid
    ]


def wait_until_free(demo: DemoProcess, gpu: Gpu) -> None:
    deadline = time.monotonic() + RELEASE_TIMEOUT
    while (state := next(g for g in demo.agent().gpus() if g.uuid == gpu.uuid).state) != "free":
        assert time.monotonic() < deadline, f"{gpu.device} still {state}:\n{demo.logs()}"
        time.sleep(0.2)


def test_demo_hot_plugs_gpus_into_running_kernels_and_leaves_nothing_behind(
    demo_factory: DemoFactory,
) -> None:
    mounts_before = mount_table()
    sandbox_cgroups_before = leftovers.all_sandbox_cgroups()
    demo = demo_factory(simulate=2)
    server = demo.server
    assert "SIMULATED GPUs" in demo.output()
    lab = server.request("GET", "lab")
    assert lab.status == 200 and "<title>JupyterLab</title>" in lab.text, "JupyterLab is served"

    k1, k2 = server.start_kernel(), server.start_kernel()
    with server.connect(k1) as s1, server.connect(k2) as s2:
        # Kernel 1 asks for a GPU itself, with the magic.
        s1.run("%load_ext jupyter_gpu_hotplug")
        attach = s1.run("%gpu attach 1")
        s1.run(PROBE)
        s2.run(PROBE)
        seen1, seen2 = probe(s1), probe(s2)
        [gpu1] = owned_by(demo, seen1["pid"])
        assert gpu1.device in attach.output, attach.output
        other = 1 - gpu1.minor
        assert seen1["nodes"] == [gpu1.device]
        assert seen1["nvml"] == [gpu1.uuid]
        assert seen1["open"] == {str(gpu1.minor): "ENXIO", str(other): "EPERM"}
        assert seen2["nodes"] == [] and seen2["nvml"] == []
        assert seen2["open"] == {"0": "EPERM", "1": "EPERM"}

        # The toolbar's way: the server extension attaches the other GPU to kernel 2.
        answer = server.request("POST", "gpu-hotplug/api/attach", {"count": 1, "kernel_id": k2})
        assert answer.status == 201, answer
        [gpu2] = owned_by(demo, seen2["pid"])
        assert [a["uuid"] for a in answer.body["attachments"]] == [gpu2.uuid]
        assert gpu2.minor == other
        seen2 = probe(s2)
        assert seen2["nodes"] == [gpu2.device] and seen2["nvml"] == [gpu2.uuid]
        assert seen2["open"] == {str(gpu2.minor): "ENXIO", str(gpu1.minor): "EPERM"}
        assert probe(s1)["open"][str(gpu2.minor)] == "EPERM"

        # No GPU is left: a third request fails clearly, and nothing changes.
        third = server.request("POST", "gpu-hotplug/api/attach", {"count": 1, "kernel_id": k1})
        assert third.status == 409, third
        assert third.body["error"] == "insufficient_gpus"
        assert third.body["free"] == 0 and third.body["requested"] == 1
        assert "0 free" in third.body["message"], third.body
        assert len(owned_by(demo, seen1["pid"])) == 1

    # Restarting kernel 1 releases its GPU; the new kernel 1 has none.
    server.restart_kernel(k1)
    with server.connect(k1) as s1:
        s1.run(PROBE)
        restarted = probe(s1)
        assert restarted["pid"] != seen1["pid"]
        wait_until_free(demo, gpu1)
        assert restarted["nodes"] == [] and restarted["nvml"] == []
        assert owned_by(demo, restarted["pid"]) == []
    assert [g.uuid for g in owned_by(demo, seen2["pid"])] == [gpu2.uuid], "kernel 2 keeps its GPU"

    # Ctrl-C with kernel 2 still holding a GPU: everything goes, every GPU is free.
    processes = demo.remember_processes()
    assert len(processes) >= 5, "demo, agent, JupyterLab and two kernels"
    sandboxes = leftovers.demo_sandboxes(demo.seen)
    assert len(sandboxes) >= 2, sandboxes
    programs = leftovers.device_programs(sandboxes)
    assert demo.interrupt() == 0, demo.logs()
    assert "every GPU was released" in demo.output(), demo.output()

    assert leftovers.still_running(list(demo.seen)) == []
    assert leftovers.processes_mentioning(str(demo.layout.root)) == []
    assert leftovers.demo_sandboxes(demo.seen) == []
    assert leftovers.all_sandbox_cgroups() == sandbox_cgroups_before
    assert [p for p in programs if bpf_program_loaded(p)] == []
    assert changed_mounts(mounts_before, demo.layout.root) == []
    ledger = leftovers.read_ledger(demo.layout.agent_state)
    assert ledger.attachments == []
    assert sorted(minor for _, minor in ledger.gpus) == [0, 1]
    assert not demo.layout.agent_socket.exists()
