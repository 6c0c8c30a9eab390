"""Keeping a target's CUDA state without its GPUs: suspend on a detach with ``keep``, resume on
its next attach (issue 39).

Why it exists: a kernel that has used a GPU holds a CUDA context, so a detach is refused as
busy, and the ways out (``force``, a restart) end the kernel and lose its state. The CUDA
driver's checkpoint API (``nvml.checkpoint``) can move a process's device memory into host
memory and release its GPU handles, and later bring it back, onto another GPU of the same chip
type if need be. This module drives those calls around the core's own detach and attach; the
kernel is never ended on this path.

Suspend (the caller holds the target's lock): the target's CUDA processes are those that hold
its GPUs — ``Injector.holders``, the busy check's own answer (the device-node scan and NVML's
process list, mapped to the container) → the host memory their state will take held to
the node's and the target's budgets (``keep_budget.py``) → ``suspending`` recorded (before
anything changes, so a restart knows what to roll back) → every process locked (bounded by
``lock_timeout_ms``), then every one checkpointed → verified: none holds a GPU node and
NVML lists none of them on any GPU → the detach's own revoke and release
(``Revoker.detach_locked``) → ``suspended`` recorded. Any failure rolls every process
back — restored onto the GPUs it still holds and unlocked — and forgets the record: the
target runs as before, with its GPUs.

Resume (``AgentService.attach`` for a suspended target, under its lock): ``placement`` picks
free GPUs of exactly the model (the same GPUs first), the service attaches them as an attach
that names them does, and ``resume`` restores each process with the old → new UUID pairs and
unlocks it. A failure checkpoints again what was restored, the service detaches the new GPUs,
and the target stays suspended.

Recovery (``recover``, at start-up before the first reconciliation): a ``suspending`` record
whose GPUs are all still granted is rolled back; one whose GPUs were released (the release
was under way) is finished as ``suspended``; a ``suspended`` one whose target already holds
the GPUs of an interrupted resume is resumed; a record whose target is gone is forgotten.

Forgetting (``forget_gone``, every reconciliation pass, and ``recover``): a suspended kernel
that exits while the agent runs (shut down from JupyterLab, its container removed) takes its
kept state with it; its record is dropped at the next pass, so that it no longer takes a share
of the keep budget or shows a suspended kernel that is no more. Not while a checkpointed process
of it lives on without it (a script the kernel started): that process still holds its state in
host memory, so its record stays, counted in the budget, until it ends too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Collection, Mapping, Sequence

from ..._structs import GpuUuid, Target
from ...linux.devnodes import DeviceNode
from ...nvml.checkpoint import CheckpointError, CudaCheckpoint, ProcessState
from .bundle import Core
from .devices import flat
from .errors import (
    AgentError,
    Busy,
    InsufficientGpus,
    LookupFailed,
    TargetNotReady,
    Unavailable,
)
from .hooks import ReconcileReport
from .injector import InjectorError, ScanUnfinished
from .inventory import InventorySnapshot
from .revoke import Revoker
from .seams import (
    HostContainer,
    Reservation,
    ReservationState,
    Suspension,
    SuspensionBook,
    SuspensionState,
)

__all__ = ["Suspender"]

log = logging.getLogger(__name__)

_SETTLE_STEP = 0.1
"""Seconds between two looks at whether the checkpointed processes let go of the GPUs."""
LOCK_TIMEOUT_MS = 10_000
"""How long a lock waits for a process's GPU work in flight to drain, by default."""


class Suspender:
    """Suspend, resume and the start-up recovery of suspended targets (module docstring)."""

    def __init__(
        self,
        core: Core,
        revoker: Revoker,
        *,
        lock_timeout_ms: int = LOCK_TIMEOUT_MS,
        settle_seconds: float = 10.0,
    ) -> None:
        self._core = core
        self._revoker = revoker
        self._lock_timeout_ms = lock_timeout_ms
        """How long a process's GPU work in flight may take to drain before the lock gives up."""
        self._settle_seconds = settle_seconds
        """How long NVML may take to stop listing a checkpointed process."""
        self._copy: dict[str, Suspension] | None = None
        """The book's suspensions by target key (``find``)."""

    async def find(self, target: Target) -> Suspension | None:
        """The target's suspension, if the backend keeps them and it has one: from the
        in-memory copy, as the allocator's reads are (every attach and listing asks, and
        this agent is the book's only writer), loaded on first use."""
        known = await self._known()
        return None if known is None else known.get(target.key)

    async def _known(self) -> dict[str, Suspension] | None:
        book = self._core.suspensions
        if book is None:
            return None
        if self._copy is None:
            found = await self._core.workers.ledger(book.suspensions)
            self._copy = {suspension.target.key: suspension for suspension in found}
        return self._copy

    async def _record(self, suspension: Suspension) -> None:
        """Write ``suspension`` to the book, then to the copy."""
        await self._core.workers.ledger(self._book().record_suspension, suspension)
        known = await self._known()
        assert known is not None
        known[suspension.target.key] = suspension

    async def _forget(self, target: Target) -> None:
        """Drop the target's suspension from the book, then from the copy."""
        await self._core.workers.ledger(self._book().forget_suspension, target)
        known = await self._known()
        assert known is not None
        known.pop(target.key, None)

    # --- suspend ---------------------------------------------------------------------------

    async def suspend(
        self, container: HostContainer, entries: Sequence[Reservation]
    ) -> Suspension | None:
        """Checkpoint ``container``'s CUDA processes, then detach ``entries`` (its GPUs) as a
        detach does; None when no process uses them (a plain detach: nothing to keep)."""
        cuda = self._driver()
        if any(entry.state is ReservationState.RESERVING for entry in entries):
            raise Busy.operation_in_progress(str(container.target))
        nodes = flat(self._core.nodes.of(entry.gpu) for entry in entries)
        pids = await self._cuda_processes(container, nodes)
        if not pids:
            await self._revoker.detach_locked(container, entries, force=False)
            return None
        gpus = tuple(entry.gpu for entry in entries)
        uuids = {gpu.uuid for gpu in gpus}
        size = await self._core.workers.host(self._kept_size, cuda, pids, uuids)
        await self._within_budget(container.target, size)
        suspension = Suspension(
            target=container.target,
            container=container.key,
            model=_model(entries),
            gpus=gpus,
            pids=pids,
            state=SuspensionState.SUSPENDING,
            host_memory=size,
        )
        await self._record(suspension)
        await self._core.checkpoints.reach("after_suspend_intent")
        try:
            await self._core.workers.host(_checkpoint_all, cuda, pids, self._lock_timeout_ms)
            await self._core.checkpoints.reach("after_checkpoint")
            await self._verify_released(container, nodes, pids)
            await self._revoker.detach_locked(container, entries, force=False)
        except (CheckpointError, AgentError) as e:
            raise await self._rolled_back(container, suspension, e) from e
        await self._core.checkpoints.reach("after_suspend_revoke")
        suspended = dataclasses.replace(suspension, state=SuspensionState.SUSPENDED)
        await self._record(suspended)
        log.info(
            "suspended %s: processes %s checkpointed, %s released",
            container,
            ", ".join(map(str, pids)),
            ", ".join(gpu.uuid for gpu in suspended.gpus),
        )
        return suspended

    def _kept_size(
        self, cuda: CudaCheckpoint, pids: Sequence[int], gpus: Collection[GpuUuid]
    ) -> int | None:
        """The device memory ``pids`` use together, which a checkpoint moves to host memory
        (blocking): the driver's figure for each process where it gives one (the
        simulator's), else NVML's for it on ``gpus`` — none for a process NVML does not list,
        which has no CUDA context there; None when NVML lists one without saying how much."""
        by_nvml: dict[int, int | None] = {}
        for gpu in self._core.inventory.snapshot().gpus:
            if gpu.uuid in gpus:
                for pid, used in self._core.inventory.used_memory(gpu.minor).items():
                    before = by_nvml.get(pid, 0)
                    by_nvml[pid] = None if used is None or before is None else before + used
        total = 0
        for pid in pids:
            amount = cuda.device_memory(pid)
            if amount is None:
                amount = by_nvml.get(pid, 0)
            if amount is None:
                return None
            total += amount
        return total

    async def _within_budget(self, target: Target, size: int | None) -> None:
        """Refuse a suspend that would pass the node's or the target's budget for kept
        state (``keep_budget.py``), before anything is recorded or changed."""
        budget = self._core.keep_budget
        if budget is None:
            return
        known = await self._known()
        kept = sum(s.host_memory or 0 for s in (known or {}).values() if s.target.key != target.key)
        budget.check(target, size, kept)

    def available(self) -> bool:
        """Whether this agent can keep a target's CUDA state at all: its backend records
        suspensions and the driver has the checkpoint API."""
        cuda = self._core.cuda
        return self._core.suspensions is not None and cuda is not None and cuda.supported()

    def _book(self) -> SuspensionBook:
        """Where suspensions are recorded, or the refusal of a backend that keeps none."""
        book = self._core.suspensions
        if book is None:
            raise TargetNotReady(
                "this agent cannot keep a kernel's CUDA state in its mode (local mode only)",
                hint="detach without keep",
                retryable=False,
            )
        return book

    def _driver(self) -> CudaCheckpoint:
        """The driver's checkpoint calls, once the backend keeps suspensions (``_book``), or
        the refusal that says which of the two lacks."""
        self._book()
        cuda = self._core.cuda
        if cuda is None or not cuda.supported():
            raise TargetNotReady(
                "the CUDA driver on this node lacks the checkpoint API "
                "(cuCheckpointProcess*, display driver 550 or later)",
                hint="detach without keep (the kernel's GPU state is then lost)",
                retryable=False,
            )
        return cuda

    async def _cuda_processes(
        self, container: HostContainer, nodes: Sequence[DeviceNode]
    ) -> tuple[int, ...]:
        """The container's processes that use its GPUs (the busy check's holders)."""
        try:
            holders = await self._core.workers.host(self._core.injector.holders, container, nodes)
        except ScanUnfinished as e:
            raise Unavailable(
                f"could not tell in time which processes of {container} use its GPUs: {e}",
                retry_after=max(1, round(e.seconds)),
                hint="nothing was changed; try again",
            ) from e
        except InjectorError as e:
            raise TargetNotReady(
                f"cannot tell which processes of {container} use its GPUs: {e}"
            ) from e
        return tuple(sorted({holder.pid for holder in holders}))

    async def _verify_released(
        self, container: HostContainer, nodes: Sequence[DeviceNode], pids: Sequence[int]
    ) -> None:
        """Wait (bounded) until no checkpointed process holds a GPU node and NVML lists none
        of them on any GPU; ``TargetNotReady`` past ``settle_seconds``."""
        deadline = time.monotonic() + self._settle_seconds
        while True:
            left = await self._core.workers.host(self._still_using, container, nodes, pids)
            if not left:
                return
            if time.monotonic() >= deadline:
                raise TargetNotReady(
                    f"after the checkpoint, processes {', '.join(map(str, left))} of "
                    f"{container} still use a GPU",
                    hint="nothing was changed; try again, and see the agent's log",
                )
            await asyncio.sleep(_SETTLE_STEP)

    def _still_using(
        self, container: HostContainer, nodes: Sequence[DeviceNode], pids: Collection[int]
    ) -> list[int]:
        """Which of ``pids`` hold a GPU node or are listed by NVML on any GPU (blocking)."""
        held = {holder.pid for holder in self._core.injector.holders(container, nodes)}
        inventory = self._core.inventory
        for gpu in inventory.snapshot().gpus:
            held.update(pid for pid in inventory.running_pids(gpu.minor) if pid in pids)
        return sorted(held)

    async def _rolled_back(
        self, container: HostContainer, suspension: Suspension, cause: Exception
    ) -> AgentError:
        """Put every process back as it was and forget the record (``_put_back``); the error
        to answer with: the cause's own, or what a failed roll-back left."""
        problems = await self._put_back(container, suspension)
        if problems:
            return TargetNotReady(
                f"suspending {container} failed ({cause}) and putting its processes back "
                f"failed too: {'; '.join(problems)}",
                hint="the agent tries again at its next start; see its log",
            )
        log.info("suspend of %s rolled back: %s", container, cause)
        if isinstance(cause, CheckpointError):
            return _refusal(cause, container)
        assert isinstance(cause, AgentError)
        return cause

    async def _put_back(self, container: HostContainer, suspension: Suspension) -> list[str]:
        """Every process restored onto the GPUs it still holds and unlocked, then the record
        forgotten; what could not be done (the record is then kept for the next start)."""
        cuda = self._driver()
        problems = await self._core.workers.host(_roll_back, cuda, suspension.pids)
        if problems:
            log.error("rolling back the suspend of %s failed: %s", container, "; ".join(problems))
            return problems
        await self._forget(container.target)
        return []

    # --- resume ----------------------------------------------------------------------------

    def placement(
        self, suspension: Suspension, snapshot: InventorySnapshot, free: Collection[GpuUuid]
    ) -> tuple[GpuUuid, ...]:
        """The free GPUs a resume takes: of exactly the suspended model, the same GPUs first;
        ``InsufficientGpus`` when too few are free (the state stays kept)."""
        wanted = len(suspension.gpus)
        same = [gpu.uuid for gpu in suspension.gpus if gpu.uuid in free]
        others = [
            gpu.uuid
            for gpu in snapshot.gpus
            if gpu.whole and gpu.name == suspension.model and gpu.uuid in free
            if gpu.uuid not in same
        ]
        chosen = (same + others)[:wanted]
        if len(chosen) < wanted:
            raise InsufficientGpus(
                free=len(chosen),
                requested=wanted,
                message=f"{suspension.target} is suspended from {wanted} {suspension.model} "
                f"GPU(s) and {len(chosen)} of that model are free",
                hint="its CUDA state stays kept; try again when one is free",
            )
        return tuple(chosen)

    async def resume(
        self, container: HostContainer, suspension: Suspension, granted: Sequence[GpuUuid]
    ) -> None:
        """Restore the suspended processes onto ``granted`` (in the order of
        ``suspension.gpus``), unlock them and forget the record. On failure what was restored
        is checkpointed again and ``TargetNotReady`` raised: the caller detaches ``granted``."""
        cuda = self._driver()
        pairs = {old.uuid: new for old, new in zip(suspension.gpus, granted, strict=True)}
        moved = None if all(old == new for old, new in pairs.items()) else pairs
        try:
            await self._core.workers.host(_restore_all, cuda, suspension.pids, moved)
        except CheckpointError as e:
            problems = await self._core.workers.host(_checkpoint_again, cuda, suspension.pids)
            if problems:
                log.error("re-suspending %s failed: %s", container, "; ".join(problems))
            raise TargetNotReady(
                f"resuming {container} on {', '.join(granted)} failed: {e}",
                hint="its CUDA state stays kept in host memory; try again",
                retryable=e.name != "CUDA_ERROR_INVALID_VALUE",
            ) from e
        await self._forget(container.target)
        log.info("resumed %s on %s", container, ", ".join(granted))

    # --- recovery --------------------------------------------------------------------------

    async def recover(self) -> None:
        """Bring every recorded suspension to a consistent state (module docstring); one
        target's failure is logged and never stops the others."""
        self._copy = None  # read the book afresh
        known = await self._known()
        if known is None:
            return
        for suspension in list(known.values()):
            try:
                await self._recover(suspension)
            except Exception:
                log.exception("recovering the suspension of %s failed", suspension.target)

    async def forget_gone(self, report: ReconcileReport) -> None:
        """Forget the suspensions whose target exited (module docstring), each GPU it was
        suspended from reported as ``forgot_suspension``. A target an operation holds (a
        suspend or resume under way) or that cannot be looked up now (``LookupFailed``) is
        looked at again on the next pass."""
        known = await self._known()
        for suspension in list((known or {}).values()):
            with self._core.locks.reconciling(suspension.target) as held:
                if not held:
                    report.skipped_busy.append(suspension.target.key)
                    continue
                try:
                    forgotten = await self._look_up(suspension) is None and (
                        await self._forget_if_ended(suspension)
                    )
                except (LookupFailed, CheckpointError) as e:
                    report.failures.append(f"{suspension.target}: cannot be looked up now: {e}")
                    continue
            if forgotten:
                for gpu in suspension.gpus:
                    report.add("forgot_suspension", gpu.uuid)

    async def _look_up(self, suspension: Suspension) -> HostContainer | None:
        core = self._core
        return await core.workers.host(
            core.resolver.lookup, suspension.target, suspension.container
        )

    async def _forget_if_ended(self, suspension: Suspension) -> bool:
        """Forget the suspension of a target that is gone, unless a process of it lives on,
        checkpointed (module docstring); whether it was forgotten."""
        cuda = self._core.cuda
        living = (
            []
            if cuda is None or not cuda.supported()  # no driver: nothing can be resumed
            else await self._core.workers.host(_still_kept, cuda, suspension.pids)
        )
        if living:
            log.warning(
                "%s is gone, but its checkpointed process(es) %s live on, holding their state "
                "in host memory: its suspension is kept until they end",
                suspension.target,
                ", ".join(map(str, living)),
            )
            return False
        await self._forget(suspension.target)
        log.info("%s is gone: its suspension is forgotten", suspension.target)
        return True

    async def _recover(self, suspension: Suspension) -> None:
        container = await self._look_up(suspension)
        if container is None:
            await self._forget_if_ended(suspension)
            return
        core = self._core
        granted = [
            entry.gpu.uuid
            for entry in core.allocator.attachments_of(suspension.target)
            if entry.state is ReservationState.GRANTED
        ]
        kept = {gpu.uuid for gpu in suspension.gpus}
        if suspension.state is SuspensionState.SUSPENDED:
            if len(granted) >= len(kept):  # an attach granted them; the resume was cut short
                await self.resume(container, suspension, granted[: len(kept)])
            return
        if kept <= set(granted):
            if not await self._put_back(container, suspension):
                log.info("the suspend of %s was cut short: rolled back", container)
            return
        finished = dataclasses.replace(suspension, state=SuspensionState.SUSPENDED)
        await self._record(finished)
        log.info("the suspend of %s was cut short after its release: finished", container)


# --- the driver's calls, blocking (run in the host's pool) -------------------------------------


def _model(entries: Sequence[Reservation]) -> str:
    """The one product name of ``entries``' GPUs (a resume must find them all alike)."""
    names = {entry.gpu.name for entry in entries}
    if len(names) != 1:
        raise TargetNotReady(
            f"the GPUs to suspend from are of different models ({', '.join(sorted(names))})",
            hint="detach the GPUs of one model first",
            retryable=False,
        )
    return names.pop()


def _checkpoint_all(cuda: CudaCheckpoint, pids: Sequence[int], timeout_ms: int) -> None:
    """Lock every process first (none runs on while another is checkpointed), then
    checkpoint each."""
    for pid in pids:
        cuda.lock(pid, timeout_ms)
    for pid in pids:
        cuda.checkpoint(pid)


def _state(cuda: CudaCheckpoint, pid: int) -> ProcessState | None:
    """The process's checkpoint state; None once it is no CUDA process (it exited)."""
    try:
        return cuda.state(pid)
    except CheckpointError as e:
        if e.name == "CUDA_ERROR_NOT_SUPPORTED":
            return None
        raise


def _still_kept(cuda: CudaCheckpoint, pids: Sequence[int]) -> list[int]:
    """Those of ``pids`` whose state the driver still keeps (not running: a running CUDA
    process under one of these numbers is another's, the number reused)."""
    return [pid for pid in pids if _state(cuda, pid) not in (None, ProcessState.RUNNING)]


def _roll_back(cuda: CudaCheckpoint, pids: Sequence[int]) -> list[str]:
    """Each process back to running on the GPUs it held; what could not be done."""
    problems = []
    for pid in pids:
        try:
            state = _state(cuda, pid)
            if state is ProcessState.CHECKPOINTED:
                cuda.restore(pid)
            if state in (ProcessState.CHECKPOINTED, ProcessState.LOCKED):
                cuda.unlock(pid)
        except CheckpointError as e:
            problems.append(str(e))
    return problems


def _restore_all(
    cuda: CudaCheckpoint, pids: Sequence[int], pairs: Mapping[str, str] | None
) -> None:
    """Restore every checkpointed process (onto ``pairs``' new GPUs), then unlock each and
    check that it runs; a process already restored is only unlocked (idempotent)."""
    for pid in pids:
        if _state(cuda, pid) is ProcessState.CHECKPOINTED:
            cuda.restore(pid, pairs)
    for pid in pids:
        if _state(cuda, pid) is ProcessState.LOCKED:
            cuda.unlock(pid)
        state = _state(cuda, pid)
        if state not in (ProcessState.RUNNING, None):
            raise CheckpointError("resume", "CUDA_ERROR_ILLEGAL_STATE", None, f"process {pid}")


def _checkpoint_again(cuda: CudaCheckpoint, pids: Sequence[int]) -> list[str]:
    """A failed resume undone: every process restored but not yet running is checkpointed
    again (a running one is locked first); what could not be done."""
    problems = []
    for pid in pids:
        try:
            state = _state(cuda, pid)
            if state is ProcessState.RUNNING:
                cuda.lock(pid, LOCK_TIMEOUT_MS)
            if state in (ProcessState.RUNNING, ProcessState.LOCKED):
                cuda.checkpoint(pid)
        except CheckpointError as e:
            problems.append(str(e))
    return problems


def _refusal(error: CheckpointError, container: HostContainer) -> AgentError:
    """The API's answer to a driver's refusal: what to do about it, by its cause."""
    if error.name == "CUDA_ERROR_TIMEOUT":
        return Unavailable(
            f"a process of {container} did not finish its GPU work in time to be suspended: "
            f"{error}",
            retry_after=5,
            hint="nothing was changed; try again when the kernel is idle",
        )
    if error.name in ("CUDA_ERROR_NOT_SUPPORTED", "UNSUPPORTED_DRIVER", "NO_DRIVER"):
        return TargetNotReady(
            f"the CUDA state of {container} cannot be checkpointed: {error} (the driver "
            "refuses processes that use UVM or IPC memory)",
            hint="nothing was changed; detach without keep (the GPU state is then lost)",
            retryable=False,
        )
    return TargetNotReady(
        f"suspending {container} failed: {error}",
        hint="nothing was changed and the kernel runs on its GPUs; try again",
    )
