"""The host-memory budget for kept CUDA state (issue 39): its arithmetic and where the node's
memory is read; the service's refusals are ``test_suspend.py``'s."""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import PidTarget
from jupyter_gpu_hotplug.agent.core.errors import TargetNotReady
from jupyter_gpu_hotplug.agent.core.keep_budget import KeepBudget, node_memory

KERNEL = PidTarget(100, start_time=1)


def test_the_budget_is_full_only_past_its_last_byte() -> None:
    budget = KeepBudget(node_bytes=10, target_bytes=4)

    budget.check(KERNEL, 4, kept=6)  # exactly full: kept
    with pytest.raises(TargetNotReady, match="node's budget"):
        budget.check(KERNEL, 4, kept=7)
    with pytest.raises(TargetNotReady, match="one kernel may keep"):
        budget.check(KERNEL, 5, kept=0)


def test_the_nodes_memory_is_memtotal_of_the_hosts_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\n")

    assert node_memory(meminfo) == 16384 * 1024
    assert node_memory(Path("/proc/meminfo")) > 0


@pytest.mark.parametrize(
    ("text", "message"),
    [("MemFree: 1 kB\n", "no MemTotal"), ("MemTotal: 1 MB\n", "not kB")],
)
def test_a_meminfo_without_memtotal_in_kb_is_an_error(
    tmp_path: Path, text: str, message: str
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(text)

    with pytest.raises(ValueError, match=message):
        node_memory(meminfo)
