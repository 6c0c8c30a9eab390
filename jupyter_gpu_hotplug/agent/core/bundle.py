"""The core's parts, bundled once: what the service, the reconciler, the idle releaser and a
backend's node passes all act through.

Why it exists: these users share more than the backend's seams — one lock per target (an
operation and a reconciliation pass must never touch a target at once), one wait queue (a
release anywhere wakes it: ``Core.release`` is the one release step), one idle book, one book
of announced losses, one node rule (``GpuNodes``: which device nodes a GPU or MIG slice needs)
and one worker pool. Passed one by one, every constructor repeated the same eight
collaborators and the agent had to thread the service's own copies into the others; a ``Core``
is built once (``Core.build`` makes the shared state) and each user takes the bundle, so two of
them can never be handed different locks or different node rules. The backend's part in the
core's passes (``hooks.py``) is one of the bundle's arguments, so a backend joins the core
when it is built and never writes to it afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from ..._structs import GpuUuid
from ...linux.devnodes import DeviceNode
from ...linux.mig import MigCaps
from ...nvml.checkpoint import CudaCheckpoint
from .checkpoints import Checkpoints
from .devices import GpuNodes
from .driver_files import DriverFiles, NoDriverFiles
from .errors import TargetNotReady
from .hooks import BackendHooks
from .idle import IdleBook, IdlePolicy
from .injector import Injector
from .inventory import Inventory
from .keep_budget import KeepBudget
from .locks import TargetLocks
from .lost import LossBook
from .metrics import AgentMetrics
from .queue import WaitQueue
from .seams import (
    Allocator,
    HostContainer,
    Identity,
    Resolver,
    SuspensionBook,
    TargetPolicy,
)
from .workers import Workers

__all__ = ["Core"]

log = logging.getLogger(__name__)


@dataclass
class Core:
    """The backend's seams and the state the core's users share (see the module docstring).

    Every user reads its parts from the one bundle when it acts, never a copy taken at
    construction: a part swapped here (a test's MIG tables, a faster queue) is swapped for
    all of them at once."""

    allocator: Allocator
    inventory: Inventory
    injector: Injector
    resolver: Resolver
    identity: Identity
    metrics: AgentMetrics
    workers: Workers
    """The ledger's thread and the host's pool: blocking calls never run on the loop."""
    locks: TargetLocks
    """One operation at a time per target, and reconciliation passes that step aside."""
    nodes: GpuNodes
    """Which device nodes each reserved GPU or MIG slice needs."""
    queue: WaitQueue
    """Attach requests waiting for GPUs, first come, first served; every release wakes it."""
    idle: IdleBook
    """The idle policy's shared state: requested periods, warnings, releases."""
    losses: LossBook
    """Announced revokes of GPUs whose reservation was lost (``lost.py``)."""
    checkpoints: Checkpoints
    """Where the crash tests stop an operation (nothing, unless configured)."""
    policy: TargetPolicy | None = None
    """The backend's tenant policy (Kubernetes: namespace allowlist, per-pod limit); None:
    the per-container limit alone (local mode, where a target is a process)."""
    driver_files: DriverFiles = field(default_factory=NoDriverFiles)
    """How a target gets the driver's libraries (``driver_files.py``); nothing by default."""
    hooks: BackendHooks = field(default_factory=BackendHooks)
    """The backend's part in the core's passes (``hooks.py``), fixed at ``build``: the idle
    and loss books were built with theirs, the reconciler reads its sweeps and ``assigned``."""
    suspensions: SuspensionBook | None = None
    """Where suspended targets are recorded durably (local: the ledger); None: the backend
    cannot keep a target's CUDA state (Kubernetes mode, for now)."""
    cuda: CudaCheckpoint | None = None
    """The CUDA driver's checkpoint calls (``nvml.checkpoint``); None: no driver library."""
    keep_budget: KeepBudget | None = None
    """How much host memory kept state may take (``keep_budget.py``); None: no bound."""

    @classmethod
    def build(
        cls,
        *,
        allocator: Allocator,
        inventory: Inventory,
        injector: Injector,
        resolver: Resolver,
        identity: Identity,
        metrics: AgentMetrics,
        workers: Workers,
        device_major: int,
        mig_caps: Callable[[], MigCaps] | None = None,
        idle_policy: IdlePolicy | None = None,
        checkpoints: Checkpoints | None = None,
        policy: TargetPolicy | None = None,
        driver_files: DriverFiles | None = None,
        hooks: BackendHooks | None = None,
        suspensions: SuspensionBook | None = None,
        cuda: CudaCheckpoint | None = None,
        keep_budget: KeepBudget | None = None,
    ) -> Core:
        """A core over a backend's seams, with fresh shared state (``mig_caps``: the host's
        MIG tables, None when no slices are handed out; ``idle_policy``: off by default;
        ``policy``: the backend's ``TargetPolicy``, if it has one; ``hooks``: the backend's
        ``BackendHooks``, none by default; ``suspensions``, ``cuda`` and ``keep_budget``: what
        suspending a target's CUDA state needs, ``suspend.py``)."""
        hooks = BackendHooks() if hooks is None else hooks
        return cls(
            allocator=allocator,
            inventory=inventory,
            injector=injector,
            resolver=resolver,
            identity=identity,
            metrics=metrics,
            workers=workers,
            locks=TargetLocks(),
            nodes=GpuNodes(major=device_major, mig_caps=mig_caps),
            queue=WaitQueue(on_change=metrics.queue_length.set),
            idle=IdleBook(
                idle_policy, per_target=hooks.idle_period, listeners=hooks.idle_listeners
            ),
            losses=LossBook(listeners=hooks.loss_listeners),
            checkpoints=checkpoints or Checkpoints(),
            policy=policy,
            driver_files=driver_files or NoDriverFiles(),
            hooks=hooks,
            suspensions=suspensions,
            cuda=cuda,
            keep_budget=keep_budget,
        )

    def unready(self, target: HostContainer) -> TargetNotReady | None:
        """``DriverFiles.check``'s refusal of ``target``, returned instead of raised: blocking,
        so an attach reads it in the trip that resolves its target (one trip fewer), and
        raises it where it decides. The check reads whether the target can load the driver or
        the node's CDI spec can give it: nothing a concurrent operation on the target takes
        away (a withdrawal of the files is undone by the grant's ``provide``)."""
        try:
            self.driver_files.check(target)
        except TargetNotReady as e:
            return e
        return None

    def grant_usable(self, target: HostContainer, nodes: Sequence[DeviceNode]) -> frozenset[str]:
        """The injector's grant of ``nodes`` to ``target``, then the driver's files for them
        (``DriverFiles.provide``): blocking, one trip to the host's pool for both (a trip is
        a thread wake-up each way, about 0.1 to 0.3 ms on a small VM). Returns the names of the
        nodes the grant created; raises what either raises (``InjectorError``: nothing given;
        ``DriverFilesFailed``: the devices are granted, the caller takes them back)."""
        created = self.injector.grant(target, nodes)
        self.driver_files.provide(target, nodes)
        return created

    def revoke_detached(
        self,
        target: HostContainer,
        nodes: Sequence[DeviceNode],
        *,
        force: bool,
        keep_nodes: Collection[str],
        withdraw: bool,
    ) -> None:
        """The injector's revoke of a detach, then, when it takes the target's last GPUs
        (``withdraw``), the driver's files (``withdraw_files``): blocking, one trip for both.
        Raises what the revoke raises, and then nothing is withdrawn. The files go before the
        ledger's release: a crash between leaves the entries ``releasing``, and recovery only
        finishes their release."""
        self.injector.revoke(target, nodes, force=force, keep_nodes=keep_nodes)
        if withdraw:
            self.withdraw_files(target)

    def withdraw_files(self, target: HostContainer) -> None:
        """Its last GPU gone, the target's driver's files go too (blocking); a failure is
        logged, never the detach's (the GPU is already taken back), and the reconciler's
        sweep retries."""
        try:
            self.driver_files.withdraw(target)
        except Exception:
            log.exception("taking the driver's files from %s failed; the sweep retries", target)

    async def release(self, uuids: Collection[GpuUuid]) -> None:
        """Return GPUs to the pool — the one release step every user takes (a detach, a
        take-back, an attach rolled back, the reconciler): the allocator frees them, their idle
        state is forgotten (it was the attachment's, never the next holder's) and the queue's
        waiters decide again. Call only once no container can open them any more."""
        await self.allocator.release(uuids)
        for uuid in uuids:
            self.idle.forget(uuid)
        self.queue.notify()
