"""Tier 5: a real NVIDIA GPU hot-plugged into a running sandbox through the local-mode agent.

Each test is one step of the GPU machine's run (``bash tests/gpu/run-on-device.sh``), in order,
and one section of its ``real-gpu.md``. The agent runs on the driver's NVML (no simulation);
the sandbox is the product's own container stand-in (fresh device cgroups, private ``/dev``
with the host's NVIDIA control nodes, like a container started with
``NVIDIA_VISIBLE_DEVICES=none``); what a process *inside* it sees is the only proof that
counts: ``nvidia-smi -L``, PyTorch in a new process, an ``open`` of the device node.

The rehearsal (``run-on-device.sh --simulate``) runs the same steps on simulated GPUs: the
fake NVML and the SIMULATED ``nvidia-smi``; with no driver, an allowed node opens with ENXIO
instead of OK, and the CUDA halves are recorded as not run (no PyTorch, no CUDA).
"""

from __future__ import annotations

import json
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pynvml
import pytest

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.client import Attachment, Busy, Gpu
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxProbe

from .harness import WORKLOAD, GpuAgent, GpuRun, GpuSandboxes
from .machine import GpuMachine, gvisor, run_text
from .report import Step

pytestmark = [*needs_root, pytest.mark.gpu, pytest.mark.slow]

NVIDIA_MAJOR: Final = 195
USABLE: Final = ("OK", "ENXIO")
"""What opening an allowed GPU node gives: OK with the driver, ENXIO without one."""
CONTAINER_TOOLS: Final = ("docker", "podman", "containerd", "ctr", "runc", "crun")
"""Recorded when present: no image can be fetched on the GPU machine to run in them."""
ROUNDS: Final = 20
SAMPLING_SECONDS: Final = 30.0
STREAM_INTERVAL: Final = 1.0
"""The server extension's default ``GPUHotplug.metrics_interval``: one stream reading a second."""


def target(probe: SandboxProbe) -> PidRef:
    return PidRef(probe.pid)


def smi_list(sandboxes: GpuSandboxes, probe: SandboxProbe, record: Step) -> dict[str, Any]:
    """``nvidia-smi -L`` inside; the answer with the GPU lines it printed."""
    smi = sandboxes.machine.nvidia_smi()
    answer = sandboxes.run(probe, "command", smi, "-L")
    record.run(f"(inside) {smi} -L", f"[exit {answer['rc']}]\n{answer['stdout']}{answer['stderr']}")
    answer["gpus"] = [line for line in answer["stdout"].splitlines() if line.startswith("GPU ")]
    return answer


def cuda_inside(
    sandboxes: GpuSandboxes, probe: SandboxProbe, record: Step, task: str = "cuda"
) -> dict[str, Any] | None:
    """A new process inside runs a CUDA task; ``None`` (and a note) where there is no PyTorch."""
    answer = sandboxes.run(probe, task)
    record.run(f"(inside, new process) python {WORKLOAD.name} {task}", repr(answer))
    assert "error" not in answer, answer
    if answer.get("torch") is None:
        record.note(f"`{task}`: PyTorch is not installed here (simulated GPUs): not run")
        return None
    return answer


def usable_minors(probe: SandboxProbe, minors: list[int]) -> dict[int, str]:
    """What opening each GPU node gives inside, making (then removing) a node where none is
    — the cgroup is the judge, as a container that ran ``mknod`` itself would find."""
    seen = {}
    for minor in minors:
        path = f"/dev/nvidia{minor}"
        made = probe.stat(path).result == "ENOENT"
        if made:
            assert probe.mknod(path, NVIDIA_MAJOR, minor) == "OK"
        seen[minor] = probe.open(path)
        if made:
            assert probe.unlink(path) == "OK"
    return seen


def free_all(agent: GpuAgent) -> None:
    """Leave every GPU free for the next step (forcing: a step that failed may hold one)."""
    for gpu in agent.client.gpus():
        if gpu.state == "attached":
            agent.client.detach(gpu.uuid, force=True)


@pytest.fixture(autouse=True)
def _free_gpus_after(run: GpuRun) -> Iterator[None]:
    yield
    free_all(run.agent)


def gpus(agent: GpuAgent) -> list[Gpu]:
    return sorted(agent.client.gpus(), key=lambda g: g.index)


def whole_gpus(agent: GpuAgent) -> list[Gpu]:
    return [g for g in gpus(agent) if g.state != "allocated"]


def attach(agent: GpuAgent, probe: SandboxProbe, count: int = 1) -> tuple[Attachment, ...]:
    return agent.client.attach(count, target=target(probe))


# --- 1 ------------------------------------------------------------------------------------------


def test_1_the_machine(run: GpuRun) -> None:
    """1. The machine: driver, CUDA, GPUs, MIG mode, kernel and cgroups, as the agent sees it."""
    record = run.record
    host = run.machine.environ(host_view=True)
    smi = run.machine.nvidia_smi()
    run.report.header[:] = [
        f"- kind: {'SIMULATED rehearsal' if run.machine.simulated else 'real NVIDIA GPUs'}",
        f"- kernel: {platform.release()} ({platform.machine()}); python {sys.version.split()[0]}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
    ]
    record.run(f"{smi}", run_text([smi], env=host))
    if not run.machine.simulated:
        query = "index,name,uuid,pci.bus_id,driver_version,memory.total,mig.mode.current"
        record.run(
            f"nvidia-smi --query-gpu={query} --format=csv",
            run_text([smi, f"--query-gpu={query}", "--format=csv"], env=host),
        )
    record.run(f"{smi} -L", run_text([smi, "-L"], env=host))
    record.run("uname -a", run_text(["uname", "-a"]))
    record.run("cat /proc/version", Path("/proc/version").read_text())
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    record.run(
        "cgroup mounts (/proc/self/mountinfo)", "\n".join(m for m in mounts if "cgroup" in m)
    )
    record.run("ls -l /dev/nvidia*", run_text(["sh", "-c", "ls -l /dev/nvidia* 2>&1"]))
    runtimes = {name: shutil.which(name) for name in CONTAINER_TOOLS}
    record.note(
        "container tools on this machine: "
        + (", ".join(f"{n} ({p})" for n, p in runtimes.items() if p) or "none")
        + " — the steps use the product's own sandboxes, which need none"
    )
    suspicion = gvisor()
    record.note(f"gVisor: {suspicion or 'no (a real Linux kernel)'}")
    listed = gpus(run.agent)
    record.run(
        "GET /v1/gpus (the agent)",
        "\n".join(
            f"{g.index}: {g.name} {g.uuid} minor {g.minor} {g.memory_total // 2**20} MiB "
            f"{g.state} simulated={g.simulated}"
            for g in listed
        ),
    )
    if not run.machine.simulated:
        host_cuda = _host_cuda(run.machine, record)
        record.note(f"PyTorch on the host: {host_cuda}")
        nvidia_uuids = _nvml_uuids()
        assert sorted(g.uuid for g in listed) == sorted(nvidia_uuids)
    assert listed, "the agent lists no GPU"
    assert {g.simulated for g in listed} == {run.machine.simulated}


def _host_cuda(machine: GpuMachine, record: Step) -> str:
    """PyTorch in a plain process on the host (also makes the driver create its UVM nodes)."""
    result = machine.work_dir / "host-cuda.json"
    subprocess.run([sys.executable, str(WORKLOAD), "cuda", str(result)], timeout=300, check=False)
    answer = result.read_text() if result.exists() else "{}"
    record.run(f"(host) python {WORKLOAD.name} cuda", answer)
    parsed = json.loads(answer)
    return (
        f"torch {parsed.get('torch')}, CUDA {parsed.get('cuda_version')}, {parsed.get('devices')}"
    )


def _nvml_uuids() -> list[str]:
    pynvml.nvmlInit()
    try:
        return [
            pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            for i in range(pynvml.nvmlDeviceGetCount())
        ]
    finally:
        pynvml.nvmlShutdown()


# --- 2 ------------------------------------------------------------------------------------------


def test_2_a_sandbox_without_a_gpu_sees_none(run: GpuRun) -> None:
    """2. A sandbox started without a GPU: no GPU node, EPERM, nvidia-smi and PyTorch see none."""
    record = run.record
    probe = run.sandboxes.start()
    minors = [g.minor for g in gpus(run.agent)]
    record.run("(inside) ls /dev", " ".join(probe.listdir("/dev")))
    assert {f"nvidia{m}" for m in minors}.isdisjoint(probe.listdir("/dev"))
    seen = usable_minors(probe, minors)
    record.run("(inside) open /dev/nvidia<minor> (a node made inside)", repr(seen))
    assert set(seen.values()) == {"EPERM"}, seen
    listed = smi_list(run.sandboxes, probe, record)
    assert listed["rc"] != 0 or listed["gpus"] == [], listed
    answer = cuda_inside(run.sandboxes, probe, record)
    if answer is not None:
        assert answer["is_available"] is False, answer


# --- 3 ------------------------------------------------------------------------------------------


def test_3_attach_one_gpu_and_compute_on_it(run: GpuRun) -> None:
    """3. Attach 1 GPU: nvidia-smi -L lists exactly it, a new process computes on it."""
    record = run.record
    probe = run.sandboxes.start()
    (attachment,) = attach(run.agent, probe)
    record.run("POST /v1/attachments {count: 1, target: {pid}}", repr(attachment.raw))
    listed = smi_list(run.sandboxes, probe, record)
    assert listed["rc"] == 0 and len(listed["gpus"]) == 1, listed
    assert attachment.uuid in listed["gpus"][0], listed
    others = [g.minor for g in gpus(run.agent) if g.uuid != attachment.uuid]
    seen = usable_minors(probe, [attachment.minor, *others])
    record.run("(inside) open each GPU node", repr(seen))
    assert seen[attachment.minor] in USABLE
    assert all(seen[m] == "EPERM" for m in others), seen
    answer = cuda_inside(run.sandboxes, probe, record)
    if answer is not None:
        assert answer["is_available"] is True, answer
        assert [d["uuid"] for d in answer["devices"]] == [attachment.uuid], answer
        product = cuda_inside(run.sandboxes, probe, record, "matmul")
        assert product is not None and product["max_abs_error"] < 1e-6, product
        record.note(
            f"matmul {product['shape']} {product['dtype']} on {product['device']}: "
            f"max |error| {product['max_abs_error']:.3g} against the CPU"
        )
    run.agent.client.detach(attachment.uuid)
    assert usable_minors(probe, [attachment.minor]) == {attachment.minor: "EPERM"}


# --- 4 ------------------------------------------------------------------------------------------


def test_4_a_process_started_before_the_attach(run: GpuRun) -> None:
    """4. Processes started before the attach: what PyTorch says, and whether our hint is right."""
    record = run.record
    probe = run.sandboxes.start()
    go = run.sandboxes.machine.work_dir / "go-4"
    imported = run.sandboxes.launch(probe, "before-attach", str(go), "import")
    called = run.sandboxes.launch(probe, "before-attach", str(go), "call")
    for task in (imported, called):
        record.run("(inside, before the attach)", repr(task.answer(suffix=".before")))
    attach(run.agent, probe)
    go.touch()
    for name, task in (("imported torch only", imported), ("called is_available()", called)):
        answer = task.answer()
        record.run(f"(inside, after the attach) {name}", repr(answer))
        assert "error" not in answer, answer
        if answer["torch"] is None:
            record.note(f"{name}: no PyTorch here (simulated GPUs): the CUDA half not run")
            assert answer["hint_initialised"] is False, answer
            continue
        record.note(
            f"{name}: torch.cuda.is_available() after the attach = "
            f"{answer['is_available_after']}; our hint says CUDA initialised = "
            f"{answer['hint_initialised']}"
        )
        # The bug that matters: silence while the process cannot use the new GPU.
        assert answer["hint_initialised"] or answer["is_available_after"], answer
        if answer["hint_initialised"] and answer["is_available_after"]:
            record.note(f"{name}: the hint warned, yet PyTorch sees the GPU (a needless warning)")


# --- 5 ------------------------------------------------------------------------------------------


def test_5_a_busy_gpu_is_refused_then_forced(run: GpuRun) -> None:
    """5. Detach while a process holds the GPU: 409 busy; force ends it; another sandbox gets it."""
    record = run.record
    first = run.sandboxes.start()
    (attachment,) = attach(run.agent, first)
    holder = run.sandboxes.launch(first, "hold", "600")
    ready = holder.answer()
    record.run("(inside) hold the GPU (a CUDA context with 256 MiB)", repr(ready))
    assert "error" not in ready, ready
    nvml_pids = _nvml_process_pids(run.machine, attachment.uuid)
    record.run("NVML: running processes on the GPU (the host's view)", repr(nvml_pids))
    with pytest.raises(Busy) as refused:
        run.agent.client.detach(attachment.uuid)
    busy = {p.pid: p.command for p in refused.value.processes}
    record.run("DELETE /v1/attachments/<uuid>", f"409 {refused.value.code}: {refused.value}")
    assert holder.pid in busy, (holder.pid, busy)
    if not run.machine.simulated:
        assert holder.pid in nvml_pids, (holder.pid, nvml_pids)
        record.note("the busy answer names the process NVML lists on that GPU")
    run.agent.client.detach(attachment.uuid, force=True)
    assert not _alive(holder.pid), "force left the holding process running"
    state = {g.uuid: g.state for g in gpus(run.agent)}[attachment.uuid]
    assert state == "free", state
    if not run.machine.simulated:
        record.run(
            "NVML after the forced detach",
            repr(_nvml_process_pids(run.machine, attachment.uuid)),
        )
    second = run.sandboxes.start()
    (again,) = attach(run.agent, second)
    record.run("another sandbox: POST /v1/attachments", repr(again.raw))
    listed = smi_list(run.sandboxes, second, record)
    assert listed["gpus"] and any(again.uuid in line for line in listed["gpus"]), listed
    if len(whole_gpus(run.agent)) == 1:
        assert again.uuid == attachment.uuid
    product = cuda_inside(run.sandboxes, second, record, "matmul")
    if product is not None:
        assert product["max_abs_error"] < 1e-6, product


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _nvml_process_pids(machine: GpuMachine, uuid: str) -> list[int]:
    """The pids NVML lists on GPU ``uuid`` (compute and graphics), as the host sees them."""
    if machine.simulated:
        return []
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        found = [
            *pynvml.nvmlDeviceGetComputeRunningProcesses(handle),
            *pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle),
        ]
        return sorted({int(p.pid) for p in found})
    finally:
        pynvml.nvmlShutdown()


# --- 6 ------------------------------------------------------------------------------------------


def test_6_two_gpus_and_their_ordinals(run: GpuRun) -> None:
    """6. Attach 2 GPUs: both listed, CUDA numbers them 0 and 1 in the node's order."""
    record = run.record
    available = whole_gpus(run.agent)
    if len(available) < 2:
        pytest.skip(f"this machine has {len(available)} GPU: attach 2 needs two")
    probe = run.sandboxes.start()
    attached = attach(run.agent, probe, 2)
    record.run("POST /v1/attachments {count: 2}", repr([a.raw for a in attached]))
    listed = smi_list(run.sandboxes, probe, record)
    assert len(listed["gpus"]) == 2 and all(
        any(a.uuid in line for line in listed["gpus"]) for a in attached
    ), listed
    by_index = [a.uuid for a in sorted(attached, key=lambda a: a.index)]
    assert [line.split("(UUID: ")[1].rstrip(")") for line in listed["gpus"]] == by_index
    answer = cuda_inside(run.sandboxes, probe, record)
    if answer is not None:
        record.note(f"CUDA's devices inside: {[d['uuid'] for d in answer['devices']]}")
        assert sorted(d["uuid"] for d in answer["devices"]) == sorted(by_index), answer


def test_6b_mig_slices(run: GpuRun) -> None:
    """6b. MIG: the machine's MIG mode, recorded (never changed)."""
    record = run.record
    if run.machine.simulated:
        pytest.skip("the rehearsal's GPUs are not in MIG mode (tests/agent covers simulated MIG)")
    pynvml.nvmlInit()
    try:
        modes = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
            except pynvml.NVMLError as e:
                current = f"n/a ({e})"
            modes.append(current)
    finally:
        pynvml.nvmlShutdown()
    record.run("nvmlDeviceGetMigMode per GPU", repr(modes))
    if 1 not in modes:
        pytest.skip(f"no GPU is in MIG mode here ({modes}); the tier never changes it")
    pytest.skip("a GPU is in MIG mode: slices are listed above; their attach is not prepared")


# --- 7 ------------------------------------------------------------------------------------------


def test_7_figures(run: GpuRun) -> None:
    """7. Figures: attach and detach latency, nvidia-smi inside, CUDA start in a new process."""
    record = run.record
    probe = run.sandboxes.start()
    attach_ms, detach_ms = [], []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        (attachment,) = attach(run.agent, probe)
        attach_ms.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        run.agent.client.detach(attachment.uuid)
        detach_ms.append((time.perf_counter() - started) * 1000)
    record.figure("attach (POST answered, GPU usable inside)", "ms", attach_ms)
    record.figure("detach (DELETE answered, access revoked)", "ms", detach_ms)
    attach(run.agent, probe)
    smi_seconds = []
    for _ in range(3):
        answer = smi_list(run.sandboxes, probe, record)
        assert answer["rc"] == 0, answer
        smi_seconds.append(answer["seconds"] * 1000)
    record.figure("nvidia-smi -L inside, after the attach", "ms", smi_seconds)
    starts = [cuda_inside(run.sandboxes, probe, record) for _ in range(3)]
    measured = [s for s in starts if s is not None]
    if measured:
        record.figure(
            "import torch (new process)", "ms", [s["import_seconds"] * 1000 for s in measured]
        )
        record.figure(
            "torch.cuda.is_available() (cuInit)",
            "ms",
            [s["is_available_seconds"] * 1000 for s in measured],
        )
        record.figure(
            "first tensor on cuda:0 (context)",
            "ms",
            [s["first_tensor_seconds"] * 1000 for s in measured],
        )
    assert len(attach_ms) == ROUNDS and statistics.median(attach_ms) > 0


# --- 8 ------------------------------------------------------------------------------------------


def test_8_sampling_cost(run: GpuRun) -> None:
    """8. NVML sampling on the GPU for 30 s: the agent's CPU and the live stream's."""
    record = run.record
    probe = run.sandboxes.start()
    attach(run.agent, probe)
    stop = threading.Event()
    asked = [0]

    def stream_asks() -> None:
        # What the server extension's stream asks the agent per reading (two calls).
        while not stop.wait(STREAM_INTERVAL):
            run.agent.client.gpus()
            run.agent.client.attachments(target(probe))
            asked[0] += 1

    before = run.agent.cpu_seconds()
    asker = threading.Thread(target=stream_asks)
    asker.start()
    try:
        sampled = run.sandboxes.run(probe, "sample", str(SAMPLING_SECONDS), str(STREAM_INTERVAL))
    finally:
        stop.set()
        asker.join()
    agent_cpu = run.agent.cpu_seconds() - before
    record.run(f"(inside) GpuMonitor.snapshot() every {STREAM_INTERVAL:g} s", repr(sampled))
    assert "error" not in sampled, sampled
    record.figure(
        "the agent's CPU while a stream reads every second",
        "% of one core",
        [100 * agent_cpu / SAMPLING_SECONDS],
    )
    record.figure(
        "the stream's NVML sampling (GpuMonitor)",
        "% of one core",
        [100 * sampled["cpu_seconds"] / sampled["seconds"]],
    )
    record.note(f"{sampled['reads']} readings of {sampled['gpus']} GPU(s); {asked[0]} agent asks")
    assert sampled["reads"] > 0 and asked[0] > 0
