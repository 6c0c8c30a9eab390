"""The driver's user space for a target: checked before an attach, given with the first GPU,
taken back with the last — the core's seam over ``linux/driver_edits.py``.

Why a seam of its own: a GPU node and a cgroup rule make a GPU openable, not usable; CUDA also
needs ``libcuda.so.1``. Where it comes from depends on the node, and the agent must know which
case it is in before it answers 201:

- ``cdi`` — the node's CDI spec (NVIDIA's toolkit in CDI mode, the GPU Operator's default since
  v25.10) says what a GPU container gets; the agent applies the same edits to the running
  container (:mod:`...linux.driver_edits`). A container that already loads the library (its
  runtime gave it one) gets the edits all the same, as a runtime would; only what is missing is
  added, and only that is taken back.
- ``check`` — nothing is applied; the container must already load the library (NVIDIA's legacy
  runtime mode, where ``NVIDIA_VISIBLE_DEVICES=none`` gives a GPU-less container the driver).
- ``off`` — neither: simulated nodes, whose kernels load the simulation's own library.

In ``cdi`` and ``check`` modes an attach the container could not use is refused with 422 and a
reason naming the fix, before anything is reserved — never a silent 201.

Which spec and device: the node's, for the device node of the GPU the allocator reserved; never
anything a caller sent. The record of what was added lives in the agent's state directory, one
file per container (``driver_edits`` says why), so a restarted agent's sweep takes back what a
``kill -9`` left: every record whose container holds no reservation is undone.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final, Protocol

from ...linux import driver_edits, procfs
from ...linux.cdi_spec import CdiRegistry, CdiSpecError, ContainerEdits
from ...linux.devnodes import DeviceNode
from .errors import TargetNotReady
from .seams import ContainerKey, HostContainer

__all__ = [
    "CdiDriverFiles",
    "DriverFiles",
    "DriverFilesFailed",
    "DriverFilesMode",
    "NoDriverFiles",
]

log = logging.getLogger(__name__)

RECORD_DIR: Final = "driver-files"


class DriverFilesMode(enum.StrEnum):
    """How the agent makes sure a target can load the driver (the module's docstring)."""

    CDI = "cdi"
    CHECK = "check"
    OFF = "off"


class DriverFilesFailed(Exception):
    """The driver's files could not be given; what :meth:`DriverFiles.provide` began is
    undone, the devices granted before it are the caller's to take back."""


class DriverFiles(Protocol):
    """The seam the service and the reconciler use (blocking: run on the host's pool)."""

    def check(self, target: HostContainer) -> None:
        """Raise :class:`TargetNotReady` (422) when ``target`` could not use a GPU: it cannot
        load the driver and the node cannot give it one (asked before any GPU is reserved)."""

    def provide(self, target: HostContainer, nodes: Sequence[DeviceNode]) -> None:
        """Give ``target`` the driver's files for ``nodes`` (idempotent); raises
        :class:`DriverFilesFailed`."""

    def withdraw(self, target: HostContainer) -> None:
        """Take back what :meth:`provide` gave ``target`` (its last GPU is gone)."""

    def sweep(self, holding: Collection[ContainerKey]) -> list[str]:
        """Take back what was given to containers not in ``holding``; what was undone."""


class NoDriverFiles:
    """``off``: nothing checked, nothing given."""

    def check(self, target: HostContainer) -> None:
        return None

    def provide(self, target: HostContainer, nodes: Sequence[DeviceNode]) -> None:
        return None

    def withdraw(self, target: HostContainer) -> None:
        return None

    def sweep(self, holding: Collection[ContainerKey]) -> list[str]:
        return []


@dataclass
class CdiDriverFiles:
    """``cdi`` and ``check`` over the node's CDI specs (:class:`CdiRegistry`)."""

    mode: DriverFilesMode
    registry: CdiRegistry
    state_dir: Path
    host_proc: Path = procfs.PROC
    host_root: Path = Path("/")
    """The host's root as the agent sees it: the spec's host paths are below it (``/`` on a
    server; the chart mounts the host's at ``/host``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    """One host change at a time: a sweep never undoes what a concurrent attach records."""
    _active: set[ContainerKey] = field(default_factory=set, init=False, repr=False)
    """Containers given files by this process and not yet withdrawn: never swept (their
    reservation may be younger than the sweep's list of holders)."""

    def check(self, target: HostContainer) -> None:
        if driver_edits.container_has_library(target.pid, proc=self.host_proc):
            return
        if self.mode is DriverFilesMode.CHECK:
            raise TargetNotReady(
                f"{target} cannot load {driver_edits.LIBCUDA}: a GPU attached to it would be "
                "unusable (CUDA would find no driver)",
                hint="start the notebook under NVIDIA's runtime with NVIDIA_VISIBLE_DEVICES=none "
                "(the toolkit's legacy mode), or run the agent with --driver-files=cdi on a node "
                "whose toolkit writes a CDI spec (nvidia-ctk cdi generate)",
                retryable=False,
            )
        self._refresh()
        if not any(
            driver_edits.provides_library(spec.common.merged(edits))
            for spec in self.registry.specs
            for edits in spec.devices.values()
        ):
            raise TargetNotReady(
                f"{target} cannot load {driver_edits.LIBCUDA} and no CDI spec of kind "
                f"{self.registry.kind} in {', '.join(map(str, self.registry.spec_dirs))} mounts "
                "one: a GPU attached to it would be unusable",
                hint="generate the node's spec with the driver installed (nvidia-ctk cdi "
                "generate --output=/var/run/cdi/nvidia.yaml), or start the notebook under "
                "NVIDIA's runtime",
                retryable=False,
            )

    def provide(self, target: HostContainer, nodes: Sequence[DeviceNode]) -> None:
        if self.mode is not DriverFilesMode.CDI:
            return
        try:
            edits = self._edits(target, nodes)
            with self._lock:
                self._active.add(target.key)
                applied = driver_edits.apply(
                    target.pid,
                    edits,
                    record=self._record(target.key),
                    start_time=target.start_time,
                    source_root=self.host_root,
                    proc=self.host_proc,
                )
        except (TargetNotReady, driver_edits.DriverEditsError) as e:
            raise DriverFilesFailed(f"the driver's files for {target}: {e}") from e
        if applied.mounts or applied.links:
            log.info(
                "driver files given to %s: %d mounts, %d links, ldcache %s; not given to running "
                "processes: %s; hooks not run: %s",
                target,
                len(applied.mounts),
                len(applied.links),
                "rebuilt" if applied.ldcache else "unchanged",
                " ".join(applied.env_not_applied) or "nothing",
                ", ".join(applied.hooks_skipped) or "none",
            )

    def withdraw(self, target: HostContainer) -> None:
        with self._lock:
            failures = driver_edits.remove(self._record(target.key), proc=self.host_proc)
            if not failures:
                self._active.discard(target.key)
        if failures:
            log.error(
                "the driver's files could not all be taken from %s: %s; the sweep retries",
                target,
                "; ".join(failures),
            )

    def sweep(self, holding: Collection[ContainerKey]) -> list[str]:
        undone = []
        directory = self.state_dir / RECORD_DIR
        with self._lock:
            keep = {self._record(key).name for key in {*holding, *self._active}}
            for record in sorted(directory.glob("*.json")) if directory.is_dir() else []:
                if record.name in keep:
                    continue
                failures = driver_edits.remove(record, proc=self.host_proc)
                if failures:
                    log.error("driver files of %s not all taken back: %s", record, failures)
                else:
                    undone.append(record.stem)
        return undone

    def _refresh(self) -> None:
        try:
            self.registry.refresh()
        except CdiSpecError as e:
            raise TargetNotReady(
                f"the node's CDI spec is unreadable: {e}",
                hint="fix or regenerate it (nvidia-ctk cdi generate); nothing was attached",
                retryable=False,
            ) from e

    def _edits(self, target: HostContainer, nodes: Sequence[DeviceNode]) -> ContainerEdits:
        self._refresh()
        edits = ContainerEdits()
        for node in nodes:
            found = self.registry.edits(PurePosixPath("/dev") / node.name)
            if found is not None:
                edits = edits.merged(found)
        return edits

    def _record(self, key: ContainerKey) -> Path:
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return self.state_dir / RECORD_DIR / f"{digest}.json"
