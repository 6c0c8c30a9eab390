"""Holders named as a user knows them in the REST answers: notebook, kernel, pod or process."""

from __future__ import annotations

from typing import Any

import pytest

from jupyter_gpu_hotplug._structs import PidRef, PodTarget
from jupyter_gpu_hotplug.client import Gpu
from jupyter_gpu_hotplug.nvml.state import GpuMonitor, Snapshot
from jupyter_gpu_hotplug.server.models import KernelHolder, WaitingAttach, gpus_json, held_by_json

KERNELS = {
    101: KernelHolder(kernel_id="k-1", path="work/train.ipynb"),
    102: KernelHolder(kernel_id="k-2", path=None),
}


def gpu(index: int, target: dict[str, Any] | None, kind: str | None = None, slot: int = 0) -> Gpu:
    """GPU ``index`` as the agent lists it; ``kind`` left out: as an agent older than the
    member lists it. A MIG slice (``slot``: which of its GPU's) has a ``MIG-`` UUID."""
    prefix = "MIG" if kind == "mig_slice" else "GPU"
    return Gpu.from_wire(
        {
            "uuid": f"{prefix}-0000000{index}-000{slot}-0000-0000-000000000000",
            "index": index,
            "minor": index,
            "name": "NVIDIA H100 (simulated)",
            "memory_total": 2**30,
            "state": "free" if target is None else "attached",
            "target": target,
            "simulated": True,
            **({} if kind is None else {"kind": kind, "plain_attach": kind == "gpu"}),
        }
    )


def _snapshot() -> Snapshot:
    """This process's NVML view (none here: every GPU then has ``metrics: None``)."""
    with GpuMonitor() as monitor:
        return monitor.snapshot()


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (PidRef(101), {"kind": "notebook", "name": "work/train.ipynb", "kernel_id": "k-1"}),
        (PidRef(102), {"kind": "kernel", "name": "kernel k-2", "kernel_id": "k-2"}),
        (PidRef(103), {"kind": "process", "name": "process 103", "kernel_id": None}),
        (
            PodTarget("team-a", "jupyter-ann", "notebook"),
            {"kind": "pod", "name": "team-a/jupyter-ann", "kernel_id": None},
        ),
    ],
    ids=["notebook", "kernel-without-session", "unknown-process", "pod"],
)
def test_a_holder_is_named_as_the_user_knows_it(target: Any, expected: dict[str, Any]) -> None:
    assert held_by_json(target, KERNELS) == expected


def test_the_node_view_lists_every_gpu_with_its_holder_next_to_the_technical_id() -> None:
    view = gpus_json(
        mode="local",
        kernel_id=None,
        attachments=(),
        node=[gpu(0, {"pid": 101}), gpu(1, None), gpu(2, {"pid": 103})],
        snapshot=_snapshot(),
        max_count=8,
        kernels=KERNELS,
    )
    assert [(g["index"], g["target"], g["held_by"]) for g in view["node"]] == [
        (0, {"pid": 101}, {"kind": "notebook", "name": "work/train.ipynb", "kernel_id": "k-1"}),
        (1, None, None),
        (2, {"pid": 103}, {"kind": "process", "name": "process 103", "kernel_id": None}),
    ]
    assert (view["free"], view["total"]) == (1, 3)


def mig_node(*holders: dict[str, Any] | None) -> list[Gpu]:
    """The real node of the hub tier: whole GPUs 0-3 (held by ``holders``), GPU 4 in MIG mode
    and its two free 1g.10gb slices."""
    return [
        *(gpu(index, holder, "gpu") for index, holder in enumerate(holders)),
        gpu(4, None, "mig_parent"),
        gpu(4, None, "mig_slice", slot=1),
        gpu(4, None, "mig_slice", slot=2),
    ]


@pytest.mark.parametrize(
    ("holders", "free"),
    [
        ((None, None, None, None), 4),
        (({"pid": 101}, None, None, None), 3),
        (({"pid": 103},) * 4, 0),
    ],
    ids=["all-free", "one-held", "all-whole-held"],
)
def test_free_counts_only_the_whole_gpus_a_plain_attach_may_get(
    holders: tuple[dict[str, Any] | None, ...], free: int
) -> None:
    # A GPU in MIG mode is never attached whole and a slice only to an attach asking for its
    # profile: "Attach 1 GPU" with only those free fails, so they are not "free" for it.
    view = gpus_json(
        mode="local",
        kernel_id=None,
        attachments=(),
        node=mig_node(*holders),
        snapshot=_snapshot(),
        max_count=8,
        kernels=KERNELS,
    )
    assert (view["free"], view["total"]) == (free, 4)
    assert [(g["index"], g["kind"], g["plain_attach"]) for g in view["node"]] == [
        *((index, "gpu", True) for index in range(4)),
        (4, "mig_parent", False),
        (4, "mig_slice", False),
        (4, "mig_slice", False),
    ]


def test_an_older_agents_gpus_count_as_whole() -> None:
    view = gpus_json(
        mode="local",
        kernel_id=None,
        attachments=(),
        node=[gpu(0, None), gpu(1, {"pid": 101})],
        snapshot=_snapshot(),
        max_count=8,
    )
    assert (view["free"], view["total"]) == (1, 2)
    assert [(g["kind"], g["plain_attach"]) for g in view["node"]] == [("gpu", True)] * 2


def test_the_queue_names_the_waiting_notebooks_first_served_first() -> None:
    view = gpus_json(
        mode="local",
        kernel_id="k-1",
        attachments=(),
        node=[gpu(0, {"pid": 103})],
        snapshot=_snapshot(),
        max_count=8,
        kernels=KERNELS,
        queue=[
            WaitingAttach("r-2", "k-2", 1, deadline=200.0, position=2, of=2),
            WaitingAttach("r-1", "k-1", 2, deadline=300.0, position=1, of=2),
            WaitingAttach("r-3", "k-3", 1, deadline=100.0),  # the agent has not said yet
        ],
    )
    assert [(q["request_id"], q["position"], q["held_by"]) for q in view["queue"]] == [
        ("r-1", 1, {"kind": "notebook", "name": "work/train.ipynb", "kernel_id": "k-1"}),
        ("r-2", 2, {"kind": "kernel", "name": "kernel k-2", "kernel_id": "k-2"}),
        ("r-3", None, None),
    ]
    assert view["queue"][0]["deadline"] == 300.0
    # No NVML in this process: every node GPU is listed, with no metrics.
    assert [g["metrics"] for g in view["node"]] == [None]
