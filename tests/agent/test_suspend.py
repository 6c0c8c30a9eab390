"""A detach with ``keep`` where it cannot keep anything: the refusals that come before the
driver is asked, over the service harness (fake host, real ledger). What the driver does is
``test_e2e_suspend.py``'s, with the real agent and the fake CUDA driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.agent.core.errors import TargetNotReady
from jupyter_gpu_hotplug.agent.core.seams import AttachRequest
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
