"""Which host processes belong to a runtime container, judged by their cgroups.

Why it exists: CRI gives the container's pid, but the agent acts on a pid only after
``/proc/<pid>/cgroup`` confirms that the process really sits in that container's cgroup (a pid
can be reused between the runtime's answer and our read; a runtime may not report a pid at
all). Runtimes name a container's cgroup after its id under either cgroup driver:

- cgroupfs: ``/kubepods/burstable/pod<uid>/<id>``;
- systemd: ``/kubepods.slice/…/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope``
  (CRI-O: ``crio-<id>.scope``; docker: ``docker-<id>.scope``), written in the OCI spec as
  ``<slice>:<prefix>:<id>``;
- crun may put the workload one level deeper, in ``<container cgroup>/container``.

The same rules serve the fallback that finds a container's process without the runtime's help:
scanning ``/proc/*/cgroup`` for the id. The cgroup is always *read* from ``/proc``, never built
from these names; ``expected_cgroup`` only turns a runtime's ``cgroupsPath`` into the path that
``/proc`` will show, for the cross-check.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Final

from ...linux import cgroups, procfs
from ...linux.engine import CRUN_INNER_CGROUP

__all__ = ["belongs_to", "expected_cgroup", "find_container_pid", "fold_inner"]

_SLICE: Final = ".slice"
_SCOPE: Final = ".scope"


def _systemd_slice_path(slice_name: str) -> str:
    """systemd nests ``a-b-c.slice`` as ``/a.slice/a-b.slice/a-b-c.slice`` (``-.slice``: root)."""
    if slice_name in ("", "-.slice"):
        return ""
    stem = slice_name.removesuffix(_SLICE)
    parts = stem.split("-")
    return "".join("/" + "-".join(parts[: i + 1]) + _SLICE for i in range(len(parts)))


def expected_cgroup(cgroups_path: str) -> str:
    """The cgroup path that ``/proc/<pid>/cgroup`` shows for a runtime's OCI ``cgroupsPath``."""
    if cgroups_path.startswith("/") or cgroups_path.count(":") != 2:
        return "/" + cgroups_path.strip("/")
    slice_name, prefix, name = cgroups_path.split(":")
    leaf = name if name.endswith(_SLICE) else f"{prefix}-{name}{_SCOPE}" if prefix else name
    return f"{_systemd_slice_path(slice_name)}/{leaf}"


def fold_inner(path: str | None) -> str | None:
    """crun runs the workload in ``<container cgroup>/container``: the container is the parent."""
    if path is None:
        return None
    head, _, leaf = path.rpartition("/")
    return (head or "/") if leaf == CRUN_INNER_CGROUP else path


def belongs_to(cgroup_path: str, container_id: str) -> bool:
    """Whether ``cgroup_path`` is the cgroup of runtime container ``container_id``."""
    components = [part for part in cgroup_path.split("/") if part]
    if components and components[-1] == CRUN_INNER_CGROUP:
        components.pop()
    if not components or not container_id:
        return False
    leaf = components[-1]
    return leaf == container_id or (
        leaf.endswith(f"-{container_id}{_SCOPE}") and len(leaf) > len(container_id) + 7
    )


def find_container_pid(container_id: str, *, proc: Path = procfs.PROC) -> int | None:
    """The oldest process in ``container_id``'s cgroup (by start time), or None.

    A linear scan of ``proc``: the fallback when the runtime names no pid.
    """
    best: tuple[int, int] | None = None
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        pid = int(entry)
        with contextlib.suppress(OSError, ValueError):
            paths = cgroups.parse_proc_cgroup((proc / entry / "cgroup").read_text())
            if not any(
                path is not None and belongs_to(path, container_id)
                for path in (paths.unified, paths.devices_v1)
            ):
                continue
            who = procfs.identity(pid, proc=proc)
            if who is not None and (best is None or (who.start_time, pid) < best):
                best = (who.start_time, pid)
    return None if best is None else best[1]
