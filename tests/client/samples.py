"""Contract-valid answers the stub agent serves (each is checked against openapi.json)."""

from __future__ import annotations

from typing import Final

from jupyter_gpu_hotplug._structs import (
    Attachment,
    AttachmentList,
    GpuInfo,
    GpuList,
    GpuUuid,
    PidRef,
    PodTarget,
    SuspendedWire,
)

UUID_A: Final = GpuUuid("GPU-0123abcd-4567-89ef-0123-456789abcdef")
UUID_B: Final = GpuUuid("GPU-fedcba98-7654-3210-fedc-ba9876543210")
POD: Final = PodTarget("jhub", "jupyter-ada", "notebook")

GPUS: Final = GpuList(
    gpus=[
        GpuInfo(
            uuid=UUID_A,
            index=0,
            minor=3,
            name="NVIDIA H100 80GB HBM3",
            memory_total=81559 * 2**20,
            state="attached",
            target=POD.to_wire(),
            simulated=False,
            selectable=True,
            kind="gpu",
            plain_attach=True,
        ),
        GpuInfo(
            uuid=UUID_B,
            index=1,
            minor=4,
            name="NVIDIA H100 80GB HBM3 (simulated)",
            memory_total=0,
            state="free",
            target=None,
            simulated=True,
            selectable=True,
            kind="gpu",
            plain_attach=True,
        ),
    ]
)

ATTACHMENTS: Final = AttachmentList(
    attachments=[
        Attachment(
            uuid=UUID_A,
            index=0,
            minor=3,
            name="NVIDIA H100 80GB HBM3",
            device="/dev/nvidia3",
            target=POD.to_wire(),
            holder="jhub/gpu-holder-x7k2p",
            attached_at="2025-01-02T03:04:05Z",
        )
    ]
)

LOCAL_ATTACHMENTS: Final = AttachmentList(
    attachments=[
        Attachment(
            uuid=UUID_B,
            index=1,
            minor=4,
            name="NVIDIA H100 80GB HBM3 (simulated)",
            device="/dev/nvidia4",
            target=PidRef(4242).to_wire(),
            holder=None,
            attached_at="2025-01-02T03:04:05.250+01:00",
        )
    ]
)

SUSPENDED: Final = AttachmentList(
    attachments=[],
    suspended=SuspendedWire(
        state="suspended",
        model="NVIDIA H100 80GB HBM3",
        uuids=[UUID_A],
        pids=[4242],
        host_memory=3 * 2**30,
    ),
)
"""A local-mode kernel whose CUDA state the agent keeps without its GPU (a detach with keep)."""
