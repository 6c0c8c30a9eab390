"""What refused requests must leave unchanged: the agent's books and a target's device access."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from jupyter_gpu_hotplug.linux import cgroup_v1, cgroup_v2
from jupyter_gpu_hotplug.linux.devrules import DeviceRule
from jupyter_gpu_hotplug.linux.sandbox.runtime import Sandbox


@dataclass(frozen=True)
class HostView:
    """A victim sandbox's device access, as the kernel enforces it and as its /dev shows it."""

    v1_allowed: tuple[str, ...]
    v2_granted: tuple[str, ...]
    dev_nodes: tuple[str, ...]
    root_v1_allowed: tuple[str, ...]

    @classmethod
    def of(cls, sandbox: Sandbox, *, v1_root: Path | None) -> HostView:
        groups = sandbox.cgroups
        return cls(
            v1_allowed=_rules(cgroup_v1.read_allow_list(groups.v1)) if groups.v1 else (),
            v2_granted=_rules(cgroup_v2.granted_devices(groups.v2)) if groups.v2 else (),
            dev_nodes=tuple(sorted(os.listdir(f"/proc/{sandbox.pid}/root/dev"))),
            root_v1_allowed=_rules(cgroup_v1.read_allow_list(v1_root)) if v1_root else (),
        )


def _rules(rules: Iterable[DeviceRule]) -> tuple[str, ...]:
    return tuple(sorted(str(rule) for rule in rules))
