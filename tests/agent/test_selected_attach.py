"""An attach that asks for GPUs by attribute (``model``, ``min_memory``; issue 37, the user's
side) in local mode, over the simulated NVML's names and memory.

What must hold: only GPUs the selector matches serve it, even while others are free; a node
with no matching GPU at all refuses it at once (409, not retryable, never queued) saying what
was asked and what the node has; matching GPUs that are busy make it wait like any attach,
in an order of its own (a waiter for an H100 holds up no one asking for any GPU); where the
cluster picks the device (Kubernetes' device plugin) it is refused before the allocator is
asked, by the same authority that refuses named GPUs (``Allocator.selectable``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from jupyter_gpu_hotplug._structs import GpuSelector, PidRef
from jupyter_gpu_hotplug.agent.core.errors import InsufficientGpus, InvalidRequest
from jupyter_gpu_hotplug.agent.core.inventory import NvmlInventory
from jupyter_gpu_hotplug.agent.core.seams import AttachRequest
from jupyter_gpu_hotplug.nvml.sim import SIMULATED_SUFFIX, default_gpus
from tests.fixtures.nvml import FakeNvml
from tests.fixtures.waiting import eventually

from .service_harness import ADMIN, Harness, device_plugin_allocator

A100 = "NVIDIA A100-SXM4-40GB" + SIMULATED_SUFFIX
A100_MEMORY = 40960 * 2**20
H100 = "NVIDIA H100 80GB HBM3" + SIMULATED_SUFFIX


@pytest.fixture
def node(harness: Harness, fake_nvml: FakeNvml) -> Iterator[Harness]:
    """``harness`` over the simulated NVML: GPUs 0 and 1 are A100s with 40 GiB, 2 and 3
    H100s with 79.6 GiB (as nvidia-smi reports an H100 80GB)."""
    gpus = default_gpus(4)
    fake_nvml.write(
        [dataclasses.replace(gpu, name=A100, memory_total=A100_MEMORY) for gpu in gpus[:2]]
        + list(gpus[2:])
    )
    inventory = NvmlInventory()
    harness.core.inventory = inventory
    try:
        yield harness
    finally:
        inventory.close()


def selecting(pid: int, count: int = 1, *, queued: bool = False, **selector: Any) -> AttachRequest:
    return AttachRequest(
        count=count,
        target=PidRef(pid),
        wait_seconds=60.0,
        request_id=None,
        selector=GpuSelector(**selector),
        queued=queued,
    )


def attached(harness: Harness) -> list[tuple[str, int]]:
    return sorted((str(e.target), e.gpu.index) for e in harness.ledger.attachments())


async def test_only_matching_gpus_serve_it(node: Harness) -> None:
    node.host.spawn(100, "kernel-a")
    node.host.spawn(200, "kernel-b")

    result = await node.service.attach(ADMIN, selecting(100, 2, model="h100"))
    # The free A100s come first in the node's order, and serve it not.
    assert sorted(a["index"] for a in result["attachments"]) == [2, 3]
    assert {a["name"] for a in result["attachments"]} == {H100}

    await node.service.attach(ADMIN, selecting(200, min_memory=40 * 2**30))
    assert attached(node) == [("process 100", 2), ("process 100", 3), ("process 200", 0)]


async def test_memory_above_every_gpu_is_refused_for_good_saying_what_the_node_has(
    node: Harness,
) -> None:
    node.host.spawn(100, "kernel-a")

    with pytest.raises(InsufficientGpus) as caught:
        await node.service.attach(
            ADMIN, selecting(100, model="A100", min_memory=80 * 2**30, queued=True)
        )

    assert caught.value.message.startswith(
        "no GPU of this node matches model 'A100' and at least 80 GiB of memory (the node "
        f"has: {A100} (40 GiB) x2, {H100} (79.65 GiB) x2)"
    )
    assert not caught.value.retryable
    assert len(node.core.queue) == 0
    assert attached(node) == []


async def test_busy_matching_gpus_make_it_wait_in_an_order_of_its_own(node: Harness) -> None:
    node.host.spawn(100, "kernel-a")
    node.host.spawn(200, "kernel-b")
    node.host.spawn(300, "kernel-c")
    await node.service.attach(ADMIN, selecting(100, 2, model="H100"))

    # Without wait_seconds: answered at once, retryable.
    with pytest.raises(InsufficientGpus) as caught:
        await node.service.attach(ADMIN, selecting(200, model="H100"))
    assert caught.value.retryable

    waiting = asyncio.ensure_future(
        node.service.attach(ADMIN, selecting(200, model="H100", queued=True))
    )
    await eventually(lambda: len(node.core.queue) == 1, "the request waits in the queue")
    # A request for any GPU is served by a free A100 past the H100 waiter.
    any_gpu = AttachRequest(
        count=1, target=PidRef(300), wait_seconds=60.0, request_id=None, queued=True
    )
    served = await node.service.attach(ADMIN, any_gpu)
    assert [a["name"] for a in served["attachments"]] == [A100]
    assert not waiting.done()

    (h100,) = [e.gpu.uuid for e in node.ledger.attachments() if e.gpu.index == 2]
    await node.service.detach(ADMIN, h100, force=False)
    result = await waiting

    assert [a["name"] for a in result["attachments"]] == [H100]
    assert len(node.core.queue) == 0


async def test_the_device_plugin_refuses_it_before_it_is_asked(harness: Harness) -> None:
    """Kubernetes with the device plugin: the holder asks for *a* GPU and the plugin picks
    which, so no selector could be honoured. This allocator has no API server, kubelet or
    pods: any use of them would fail, so the refusal comes before the allocator is asked."""
    holders = device_plugin_allocator()
    harness.core.allocator = holders
    harness.host.spawn(100, "kernel-a")

    for selector, field in (({"model": "H100"}, "model"), ({"min_memory": 1}, "min_memory")):
        with pytest.raises(InvalidRequest) as caught:
            await harness.service.attach(ADMIN, selecting(100, **selector))
        assert caught.value.field == field
        assert caught.value.message.startswith(
            "selecting GPUs by model or memory needs DRA (--allocation dra); the device "
            "plugin picks the device itself"
        )
