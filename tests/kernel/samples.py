"""What the kernel-side tests feed the magic and the widget: attachments and CUDA states.

The ``%gpu`` magic and the monitor widget show the same agent answers and the same CUDA
advice, so their tests share these values instead of each spelling them out.
"""

from __future__ import annotations

import os
from typing import Final

from jupyter_gpu_hotplug.client import Attachment, Gpu
from jupyter_gpu_hotplug.kernel.cuda import CudaState

IDLE: Final = CudaState(initialised=False, evidence=())
STARTED: Final = CudaState(initialised=True, evidence=("torch has initialised CUDA",))


def attachment(uuid: str, minor: int) -> Attachment:
    """A simulated GPU hot-attached to this process, as the agent reports it."""
    return Attachment.from_wire(
        {
            "uuid": uuid,
            "index": minor,
            "minor": minor,
            "name": "NVIDIA H100 80GB HBM3 (simulated)",
            "device": f"/dev/nvidia{minor}",
            "target": {"pid": os.getpid()},
            "holder": None,
            "attached_at": "2026-01-01T12:00:00Z",
        }
    )


def node_gpu(
    uuid: str, index: int, *, state: str, pid: int | None = None, kind: str = "gpu"
) -> Gpu:
    """A simulated GPU of the node as the agent lists it (held by ``pid`` when given; ``kind``
    ``mig_parent`` or ``mig_slice``: what an attach of a count alone does not get)."""
    return Gpu.from_wire(
        {
            "uuid": uuid,
            "index": index,
            "minor": index,
            "name": "NVIDIA H100 80GB HBM3 (simulated)",
            "memory_total": 80 * 2**30,
            "state": state,
            "target": None if pid is None else {"pid": pid},
            "simulated": True,
            "kind": kind,
            "plain_attach": kind == "gpu",
        }
    )
