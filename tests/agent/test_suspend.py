"""A detach with ``keep`` where it cannot keep anything: the refusals that come before the
driver is asked, over the service harness (fake host, real ledger). What the driver does is
``test_e2e_suspend.py``'s, with the real agent and the fake CUDA driver."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import PidRef, PidTarget
from jupyter_gpu_hotplug.agent.core.errors import TargetNotReady
from jupyter_gpu_hotplug.agent.core.keep_budget import KeepBudget
from jupyter_gpu_hotplug.agent.core.seams import AttachRequest, Suspension, SuspensionState
from jupyter_gpu_hotplug.nvml.checkpoint import CudaCheckpoint
from jupyter_gpu_hotplug.nvml.sim import CUDA_LIBRARY_NAME, ensure_fake_cuda

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
