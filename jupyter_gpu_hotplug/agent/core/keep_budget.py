"""How much host memory kept CUDA state may take: the node's budget and one target's (issue 39).

Why it exists: a suspend (``suspend.py``) moves a kernel's device memory into host memory, in
the kernel's own process, and suspended kernels add up. Past the node's memory the kernel OOM
killer ends one of them — the very loss a suspend is meant to avoid — or the node itself
starves. So a suspend is refused before anything changes when the state it would keep passes
either budget, or when its size cannot be told at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..._structs import Target, format_memory
from .errors import TargetNotReady

__all__ = ["KeepBudget", "node_memory"]


@dataclass(frozen=True)
class KeepBudget:
    """The most host memory kept state may take on this node, and for one target."""

    node_bytes: int
    """All suspended targets of the node together."""
    target_bytes: int | None = None
    """One target; None: only the node's budget applies."""

    def check(self, target: Target, size: int | None, kept: int) -> None:
        """Refuse keeping ``size`` bytes of ``target``'s state while suspended targets keep
        ``kept`` bytes: ``TargetNotReady`` saying which budget it passes (or that its size is
        unknown), with nothing changed yet."""
        if size is None:
            raise TargetNotReady(
                f"cannot tell how much host memory the CUDA state of {target} would take "
                "(neither the driver nor NVML says how much GPU memory its processes use)",
                hint="nothing was changed; detach without keep (the GPU state is then lost)",
                retryable=False,
            )
        if self.target_bytes is not None and size > self.target_bytes:
            raise TargetNotReady(
                f"the CUDA state of {target} takes {format_memory(size)}, more than the "
                f"{format_memory(self.target_bytes)} one kernel may keep in host memory",
                hint="nothing was changed; free GPU memory in the kernel (del its tensors, "
                "then torch.cuda.empty_cache()) or detach without keep",
                retryable=False,
            )
        if kept + size > self.node_bytes:
            raise TargetNotReady(
                f"keeping the CUDA state of {target} ({format_memory(size)}) would pass this "
                f"node's budget for kept state: suspended kernels keep {format_memory(kept)} "
                f"of {format_memory(self.node_bytes)}",
                hint="nothing was changed; try again once a suspended kernel resumes or ends, "
                "or detach without keep",
                retryable=True,
            )


def node_memory(meminfo: Path) -> int:
    """The node's memory in bytes (``MemTotal`` of ``/proc/meminfo``, the host's: the
    agent's ``host_proc``); ``OSError`` or ``ValueError`` when it cannot be read."""
    for line in meminfo.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "MemTotal":
            amount, unit = value.split()
            if unit != "kB":
                raise ValueError(f"{meminfo}: MemTotal in {unit!r}, not kB")
            return int(amount) * 1024
    raise ValueError(f"{meminfo} has no MemTotal")
