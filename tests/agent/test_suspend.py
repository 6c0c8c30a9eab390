"""A detach with ``keep`` where it cannot keep anything: the refusals that come before the
driver is asked, and the records of suspended kernels that exited, over the service harness
(fake host, real ledger). What the driver does is ``test_e2e_suspend.py``'s, with the real
agent and the fake CUDA driver."""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR, PidRef, PidTarget, Target
from jupyter_gpu_hotplug.agent.core.errors import TargetNotReady
from jupyter_gpu_hotplug.agent.core.keep_budget import KeepBudget
from jupyter_gpu_hotplug.agent.core.seams import (
    AttachRequest,
    ContainerKey,
    GpuRecord,
    Suspension,
    SuspensionState,
)
from jupyter_gpu_hotplug.nvml.checkpoint import CudaCheckpoint
from jupyter_gpu_hotplug.nvml.sim import CUDA_LIBRARY_NAME, ensure_fake_cuda
from tests.fixtures.requirements import needs_root
from tests.fixtures.waiting import eventually

from .service_harness import ADMIN, Harness

OLD_DRIVER = "libc.so.6"
"""A library that loads but has none of the checkpoint calls: a driver before R550."""


ONE_GPU = AttachRequest(count=1, target=PidRef(100), wait_seconds=60, request_id=None)


async def attached(harness: Harness) -> list[int]:
    """A kernel (pid 100) with one GPU that its process holds open; the GPU's minors."""
    kernel = harness.host.spawn(100, "kernel-a")
    answer = await harness.service.attach(ADMIN, ONE_GPU)
    minors = [attachment["minor"] for attachment in answer["attachments"]]
    harness.injector.hold(kernel, minors[0], pid=100)
    return minors


async def test_a_backend_without_a_suspension_book_refuses_keep(harness: Harness) -> None:
    """Kubernetes mode's case: the backend records no suspensions."""
    minors = await attached(harness)
    harness.core.cuda = CudaCheckpoint(OLD_DRIVER)

    with pytest.raises(TargetNotReady, match="local mode only") as refused:
        await harness.service.detach_all(ADMIN, PidRef(100), force=False, keep=True)

    assert refused.value.retryable is False
    assert [entry.gpu.minor for entry in harness.ledger.attachments()] == minors


@pytest.mark.parametrize("driver", [None, OLD_DRIVER], ids=["no-driver", "before-r550"])
async def test_a_driver_without_the_checkpoint_api_refuses_keep(
    harness: Harness, driver: str | None
) -> None:
    minors = await attached(harness)
    harness.core.suspensions = harness.ledger
    harness.core.cuda = None if driver is None else CudaCheckpoint(driver)

    with pytest.raises(TargetNotReady, match="lacks the checkpoint API"):
        await harness.service.detach_all(ADMIN, PidRef(100), force=False, keep=True)

    assert [entry.gpu.minor for entry in harness.ledger.attachments()] == minors
    assert harness.ledger.suspensions() == []


async def test_keep_with_no_process_using_the_gpu_is_a_plain_detach(
    harness: Harness, tmp_path: Path
) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    await harness.service.attach(ADMIN, ONE_GPU)
    harness.core.suspensions = harness.ledger
    harness.core.cuda = CudaCheckpoint(str(ensure_fake_cuda(tmp_path / "cuda") / CUDA_LIBRARY_NAME))

    await harness.service.detach_all(ADMIN, PidRef(100), force=False, keep=True)

    assert harness.ledger.attachments() == []
    assert harness.injector.usable(kernel.target) == set()
    assert harness.ledger.suspensions() == [], "nothing to keep: nothing recorded"
    assert "suspended" not in await harness.service.attachments(ADMIN, PidRef(100))


GiB = 2**30


def keeping(harness: Harness, tmp_path: Path, budget: KeepBudget) -> None:
    """The local backend's book, the fake CUDA driver (which knows no process of the fake
    host: their sizes come from NVML's list, the test's) and ``budget``."""
    harness.core.suspensions = harness.ledger
    harness.core.cuda = CudaCheckpoint(str(ensure_fake_cuda(tmp_path / "cuda") / CUDA_LIBRARY_NAME))
    harness.core.keep_budget = budget


async def keep_refused(harness: Harness, minors: list[int], match: str) -> TargetNotReady:
    """Detach kernel 100's GPUs with keep: refused (``match``) with its GPUs still attached."""
    with pytest.raises(TargetNotReady, match=match) as refused:
        await harness.service.detach_all(ADMIN, PidRef(100), force=False, keep=True)
    assert [entry.gpu.minor for entry in harness.ledger.attachments()] == minors
    return refused.value


@pytest.mark.parametrize(
    ("used", "target_bytes", "message"),
    [
        (None, None, "cannot tell how much host memory"),  # NVML's NOT_AVAILABLE
        (3 * GiB, 2 * GiB, "takes 3 GiB, more than the 2 GiB"),
    ],
    ids=["size-unknown", "past-the-targets-budget"],
)
async def test_keep_without_a_size_or_past_one_targets_budget_is_refused(
    harness: Harness, tmp_path: Path, used: int | None, target_bytes: int | None, message: str
) -> None:
    minors = await attached(harness)
    harness.inventory.memory[minors[0]] = {100: used, 999: 50 * GiB}  # 999: not the kernel's
    keeping(harness, tmp_path, KeepBudget(node_bytes=64 * GiB, target_bytes=target_bytes))

    refused = await keep_refused(harness, minors, message)

    assert refused.retryable is False, "waiting does not change the kernel's size"
    assert harness.ledger.suspensions() == []


async def test_keep_past_the_nodes_budget_counts_the_other_suspended_kernels(
    harness: Harness, tmp_path: Path
) -> None:
    minors = await attached(harness)
    harness.inventory.memory[minors[0]] = {100: 3 * GiB}
    [entry] = harness.ledger.attachments()
    elsewhere = dataclasses.replace(entry, target=PidTarget(200, start_time=1))
    harness.ledger.record_suspension(
        Suspension(
            target=elsewhere.target,
            container=elsewhere.container,
            model="NVIDIA H100 80GB HBM3",
            gpus=(elsewhere.gpu,),
            pids=(200,),
            state=SuspensionState.SUSPENDED,
            host_memory=6 * GiB,
        )
    )
    keeping(harness, tmp_path, KeepBudget(node_bytes=8 * GiB))

    refused = await keep_refused(harness, minors, "suspended kernels keep 6 GiB of 8 GiB")

    assert refused.retryable is True, "it fits once the other kernel resumes"
    assert [s.target for s in harness.ledger.suspensions()] == [elsewhere.target]


def gpu_record(harness: Harness, index: int) -> GpuRecord:
    gpu = harness.inventory.gpus[index]
    return GpuRecord(gpu.uuid, gpu.index, gpu.minor, gpu.name)


def suspended(
    target: Target, container: str, gpu: GpuRecord, *, pids: tuple[int, ...] = (4242,)
) -> Suspension:
    """A suspended record as the book keeps it (``pids``: its checkpointed processes)."""
    return Suspension(
        target=target,
        container=ContainerKey(container),
        model=gpu.name,
        gpus=(gpu,),
        pids=pids,
        state=SuspensionState.SUSPENDED,
        host_memory=GiB,
    )


async def test_the_suspension_of_a_kernel_that_exits_is_forgotten_at_the_next_pass(
    harness: Harness,
) -> None:
    """A suspended kernel shut down while the agent runs: its record goes at the next
    reconciliation pass (not at the agent's next start), and with it its share of the keep
    budget; a kernel that still runs, or that cannot be looked up now, keeps its record."""
    harness.core.suspensions = harness.ledger
    first, second = gpu_record(harness, 0), gpu_record(harness, 1)
    running = harness.host.host_container(harness.host.spawn(100, "kernel-a"))
    exiting = harness.host.host_container(harness.host.spawn(200, "kernel-b"))
    for container, gpu in ((running, first), (exiting, second)):
        harness.ledger.record_suspension(suspended(container.target, container.key, gpu))
    harness.host.remove_container("kernel-b")  # shut down: its processes and cgroups go

    harness.resolver.unanswered = True
    unanswered = await harness.reconciler.run_once()
    assert unanswered.actions == {}
    assert len(unanswered.failures) == 2, unanswered.failures
    assert len(harness.ledger.suspensions()) == 2, "not known to be gone: kept"

    harness.resolver.unanswered = False
    report = await harness.reconciler.run_once()

    assert report.actions == {"forgot_suspension": [second.uuid]}
    assert [s.target for s in harness.ledger.suspensions()] == [running.target]
    assert await harness.service.suspender.find(exiting.target) is None
    assert (await harness.reconciler.run_once()).actions == {}


async def test_a_suspension_under_an_operation_is_left_for_the_next_pass(
    harness: Harness,
) -> None:
    harness.core.suspensions = harness.ledger
    gone = PidTarget(300, start_time=7)
    harness.ledger.record_suspension(suspended(gone, "cgroup:/gone", gpu_record(harness, 0)))

    async with harness.core.locks.operation(gone):
        report = await harness.reconciler.run_once()
    assert (report.actions, report.skipped_busy) == ({}, [gone.key])

    later = await harness.reconciler.run_once()
    assert later.actions == {"forgot_suspension": [harness.inventory.gpus[0].uuid]}
    assert harness.ledger.suspensions() == []


CONTEXT = """
import ctypes, pathlib, sys, threading
cuda = ctypes.CDLL(sys.argv[1])
result = cuda.cuInit(0)
if result == 0:
    result = cuda.fakeCudaHoldContext(0, ctypes.c_ulonglong(2**20))
pathlib.Path(sys.argv[2]).write_text(str(result))
threading.Event().wait()
"""
"""A process with a CUDA context on the fake driver's GPU 0; writes the result to ``argv[2]``."""


@needs_root
async def test_a_checkpointed_process_that_outlives_its_kernel_keeps_the_record(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel is gone but a process of it lives on, checkpointed by the fake driver (a
    script the kernel started): its state is still in host memory, so the record stays (and
    counts in the budget) until that process ends too."""
    library = ensure_fake_cuda(tmp_path / "cuda") / CUDA_LIBRARY_NAME
    devices = tmp_path / "dev"
    devices.mkdir()
    os.mknod(devices / "nvidia0", 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, 0))
    sockets = Path(tempfile.mkdtemp(prefix="ckpt-"))  # a unix socket's path is short
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_DIR", str(sockets))
    ready = tmp_path / "ready"
    process = subprocess.Popen(
        [sys.executable, "-c", CONTEXT, str(library), str(ready)],
        env={**os.environ, "FAKE_CUDA_DEV_DIR": str(devices)},
    )
    try:
        await eventually(lambda: ready.exists() and ready.read_text() != "", "a CUDA context")
        assert ready.read_text() == "0"
        cuda = CudaCheckpoint(str(library))
        cuda.lock(process.pid, 1000)
        cuda.checkpoint(process.pid)
        harness.core.suspensions, harness.core.cuda = harness.ledger, cuda
        gone = PidTarget(300, start_time=7)
        record = suspended(gone, "cgroup:/gone", gpu_record(harness, 0), pids=(process.pid,))
        harness.ledger.record_suspension(record)

        assert (await harness.reconciler.run_once()).actions == {}
        assert harness.ledger.suspensions() == [record]

        process.kill()
        process.wait()
        report = await harness.reconciler.run_once()
        assert report.actions == {"forgot_suspension": [harness.inventory.gpus[0].uuid]}
        assert harness.ledger.suspensions() == []
    finally:
        process.kill()
        process.wait()
        shutil.rmtree(sockets)
