"""The running agent: its components wired together, started and stopped in order.

Why it exists: the application (``app.py``) deals with configuration; this module deals with
life. ``Agent.create`` builds the real components from ``AgentSettings`` in one path for both
modes: what every mode needs of the host (the device cgroups, the simulated NVML when asked,
the inventory, the engine behind the injector), and the backend the settings name
(``local/backend.py`` or ``kubernetes/backend.py``: allocator, resolver, identity, its hooks
in the core's passes, and what it runs beside the core). ``Agent`` builds the ``Core`` once
from both — the backend's hooks included, so nothing joins the core later — and hands it to
the service, the node sweep, the reconciler (which runs the sweep at the end of each pass),
the idle releaser and the backend, then the API server over the service. ``start``
reconciles the allocator with the host *before* serving, then serves and runs the background
loops (reconciliation, idle policy, simulated readings, the cached health probe, the
backend's own); ``stop`` stops accepting, lets running operations finish, and closes
everything in reverse order.

Tests build an ``Agent`` from fakes through the same constructor, so the wiring they exercise
is the wiring that runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .._structs import format_memory
from ..linux import cgroups
from ..linux.cdi_spec import CdiRegistry
from ..linux.mig import MigCaps
from ..nvml.checkpoint import DRIVER_LIBRARY, CheckpointError, CudaCheckpoint
from . import openapi_document
from .api.handlers import (
    ApiContext,
    Unwell,
    api_only_handlers,
    default_handlers,
    metrics_handlers,
)
from .api.server import AgentServer, make_application
from .core.bundle import Core
from .core.checkpoints import Checkpoints
from .core.driver_files import CdiDriverFiles, DriverFiles, DriverFilesMode, NoDriverFiles
from .core.hooks import BackendHooks, ReconcileReport
from .core.idle import IdlePolicy
from .core.idle_releaser import IdleReleaser, Usage
from .core.injector import EngineInjector, Injector
from .core.inventory import Inventory, NvmlInventory
from .core.keep_budget import KeepBudget, node_memory
from .core.lost import LossRules, LostGpus
from .core.metrics import AgentMetrics
from .core.reconcile import Reconciler
from .core.seams import Allocator, Identity, Resolver, SuspensionBook, TargetPolicy
from .core.service import AgentService, ServiceConfig
from .core.sweep import NodeSweep
from .core.workers import Workers
from .local.backend import LocalBackend
from .local.simulate import Simulation
from .settings import AgentSettings, Backend, SettingsError
from .statedir import prepare_state_dir

if TYPE_CHECKING:
    from ..linux.engine import HotplugEngine

__all__ = ["Agent", "AgentBackend", "Components", "HealthProbe"]

log = logging.getLogger(__name__)

_WORKERS = 8
_HEALTH_INTERVAL = 5.0
_DRAIN_TIMEOUT = 30.0


class HealthProbe:
    """The cached verdicts of ``/healthz`` (liveness) and ``/readyz`` (readiness).

    A cheap ledger read every few seconds, cached (as kopf's probes are) so that a probe never
    queues behind slow work and a burst of probes costs nothing. Liveness and readiness differ
    as Kubernetes means them: while the agent starts (reconciling, before the first probe) and
    while it stops, it is alive but not ready; a failed ledger read, or a verdict older than
    three intervals (the probe itself is stuck), makes it neither.
    """

    def __init__(
        self,
        check: Callable[[], Coroutine[Any, Any, None]],
        *,
        interval: float = _HEALTH_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._check = check
        self._interval = interval
        self._clock = clock
        self._problem: str | None = None
        self._at: float | None = None
        self._stopping = False

    def verdict(self) -> Unwell | None:
        """Liveness: None when alive (starting included), else what is wrong."""
        if self._at is not None and self._clock() - self._at > 3 * self._interval:
            return Unwell("failing", f"no health probe for {self._clock() - self._at:.0f} s")
        return None if self._problem is None else Unwell("failing", self._problem)

    def readiness(self) -> Unwell | None:
        """Readiness: None when requests are served, else why not (starting, stopping...)."""
        if self._stopping:
            return Unwell("stopping", "the agent finishes the operations in flight and exits")
        if self._at is None:
            return Unwell("starting", "the agent reconciles its ledger with the host")
        return self.verdict()

    def stopping(self) -> None:
        """From now on, not ready (the agent is shutting down)."""
        self._stopping = True

    async def probe(self) -> None:
        try:
            await self._check()
        except Exception as e:
            if self._problem is None:
                log.error("health probe failed: %s", e)
            self._problem = f"{type(e).__name__}: {e}"
        else:
            self._problem = None
        self._at = self._clock()

    async def run_forever(self) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(self._interval)


class AgentBackend(Protocol):
    """A backend (``local/backend.py``, ``kubernetes/backend.py``): the seams it implements,
    which go into the ``Core``, and its life beside the core."""

    @property
    def allocator(self) -> Allocator: ...

    @property
    def resolver(self) -> Resolver: ...

    @property
    def identity(self) -> Identity: ...

    @property
    def policy(self) -> TargetPolicy | None: ...

    @property
    def suspensions(self) -> SuspensionBook | None:
        """Where suspended CUDA state is recorded (local: the ledger; None: not kept)."""

    @property
    def hooks(self) -> BackendHooks:
        """Its part in the core's passes, handed to ``Core.build`` (``core/hooks.py``)."""

    def bind(self, core: Core, *, service: AgentService, lost: LostGpus) -> None:
        """Take the parts its own reactions act through (Kubernetes: a lost holder is taken
        back through the service and the loss sequence), before the first reconciliation;
        the core itself is never written to."""

    def start(self, *, reconcile: Callable[[], Awaitable[ReconcileReport]]) -> None:
        """Run beside the core once the agent serves (Kubernetes: reactions to pod events)."""

    async def stop(self) -> None:
        """Stop what ``start`` began, before the agent closes."""

    def close(self) -> None:
        """Close what the backend opened (the ledger; the API, CRI and kubelet clients)."""


@dataclass
class Components:
    """The parts of an agent; ``Agent.create`` makes the real ones, tests pass fakes."""

    settings: AgentSettings
    backend: AgentBackend
    inventory: Inventory
    injector: Injector
    workers: Workers
    """Shared with the backend (local mode's allocator runs in its ledger thread)."""
    simulation: Simulation | None = None
    usage: Usage = dict
    """GPU utilisation by UUID, for the idle policy (NVML's; tests give their own)."""
    mig_caps: Callable[[], MigCaps] | None = None
    """The host's MIG capability tables (``None``: no slices are handed out)."""
    metrics: AgentMetrics = field(default_factory=AgentMetrics)
    driver_files: DriverFiles = field(default_factory=NoDriverFiles)
    """How targets get the driver's libraries (``Agent.create``: from the settings)."""
    cuda: CudaCheckpoint | None = None
    """The CUDA driver's checkpoint calls, for a detach that keeps the kernel's state."""
    closers: list[Callable[[], None]] = field(default_factory=list)
    """Called in reverse order when the agent stops (the backend's ``close`` among them)."""


def _core(components: Components) -> Core:
    """The one ``Core``: the backend's seams, the host's parts, the shared state."""
    settings, backend = components.settings, components.backend
    return Core.build(
        allocator=backend.allocator,
        inventory=components.inventory,
        injector=components.injector,
        resolver=backend.resolver,
        identity=backend.identity,
        policy=backend.policy,
        metrics=components.metrics,
        workers=components.workers,
        device_major=settings.device_major,
        mig_caps=components.mig_caps,
        idle_policy=IdlePolicy(
            idle_seconds=settings.idle_release_seconds,
            warning_seconds=settings.idle_warning_seconds,
            max_lease_seconds=settings.max_lease_seconds,
            handover_seconds=settings.idle_handover_seconds,
        ),
        checkpoints=Checkpoints(pause_at=settings.hooks.pause_at, marker_dir=settings.state_dir),
        driver_files=components.driver_files,
        hooks=backend.hooks,
        suspensions=backend.suspensions,
        cuda=components.cuda,
        keep_budget=None if backend.suspensions is None else _keep_budget(settings),
    )


def _keep_budget(settings: AgentSettings) -> KeepBudget:
    """The budget for kept CUDA state: its share of the host's memory, one target's bound."""
    meminfo = settings.host_proc / "meminfo"
    try:
        memory = node_memory(meminfo)
    except (OSError, ValueError) as e:
        raise SettingsError(f"host_proc: cannot read the node's memory from {meminfo}: {e}") from e
    budget = KeepBudget(
        node_bytes=int(memory * settings.keep_memory_fraction),
        target_bytes=settings.keep_memory_per_target,
    )
    log.info(
        "kept CUDA state may take %s of host memory, %s for one target",
        format_memory(budget.node_bytes),
        "all" if budget.target_bytes is None else format_memory(budget.target_bytes),
    )
    return budget


def _cuda(simulation: Simulation | None) -> CudaCheckpoint | None:
    """The CUDA driver's checkpoint calls: the simulated driver's with ``--simulate``, else
    the host's ``libcuda.so.1``; None where there is none (a keep is refused, saying why)."""
    library = DRIVER_LIBRARY if simulation is None else str(simulation.cuda_library())
    try:
        cuda = CudaCheckpoint(library)
    except CheckpointError as e:
        log.info("no CUDA driver library (%s): a detach cannot keep a kernel's state", e)
        return None
    log.info("CUDA checkpoint API: %s", "present" if cuda.supported() else "not in this driver")
    return cuda


def _driver_files(settings: AgentSettings) -> DriverFiles:
    mode = settings.driver_files_mode
    log.info(
        "driver files: %s (CDI specs in %s)", mode, ", ".join(map(str, settings.cdi_spec_dirs))
    )
    if mode is DriverFilesMode.OFF:
        return NoDriverFiles()
    return CdiDriverFiles(
        mode,
        CdiRegistry(settings.cdi_spec_dirs, kind=settings.cdi_kind),
        settings.state_dir,
        host_proc=settings.host_proc,
        host_root=settings.host_root,
    )


def _service_config(settings: AgentSettings) -> ServiceConfig:
    return ServiceConfig(
        max_gpus_per_target=settings.max_gpus_per_target,
        simulated=settings.simulated,
        mig_profile=None if settings.kubernetes is None else settings.kubernetes.mig_profile,
    )


class Agent:
    """One running agent (see the module docstring)."""

    def __init__(self, components: Components) -> None:
        self.components = components
        self.settings = settings = components.settings
        self.metrics = components.metrics
        self.backend = components.backend
        self.core = _core(components)
        self.service = AgentService(self.core, config=_service_config(settings))
        self.lost = LostGpus(
            rules=LossRules(grace_seconds=settings.lost_grace_seconds, policy=settings.lost_policy),
            book=self.core.losses,
            metrics=self.metrics,
        )
        keeps = settings.idle_held == "suspend" and self.service.suspender.available()
        self.idle = IdleReleaser(
            self.core,
            usage=components.usage,
            release=self.service.release_unused,
            suspend=self.service.suspend_idle if keeps else None,
        )
        self.sweep = NodeSweep(
            self.core,
            revoker=self.service.revoker,
            lost=self.lost,
            revoke_strays=settings.stray_policy == "revoke",
            spawn=self._spawn,
        )
        self.reconciler = Reconciler(self.core, sweep=self.sweep, suspender=self.service.suspender)
        self.health = HealthProbe(self._health_check)
        self.server, self.metrics_server = self._api_servers()
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics.simulated.set(1 if settings.simulated else 0)

    def _api_servers(self) -> tuple[AgentServer, AgentServer | None]:
        """The HTTP API over the service, bound to connections by the backend's identity, and
        ``/metrics`` on an address of its own when one is given (its handlers never read a
        caller)."""
        identity = self.core.identity
        context = ApiContext(
            service=self.service,
            identity=identity,
            metrics=self.metrics,
            openapi=openapi_document(),
            health=self.health.verdict,
            readiness=self.health.readiness,
        )
        if not self.settings.metrics_listen:
            api = make_application(context, default_handlers)
            return AgentServer(api, binder=identity.bind_connection), None
        return (
            AgentServer(
                make_application(context, api_only_handlers), binder=identity.bind_connection
            ),
            AgentServer(
                make_application(context, metrics_handlers), binder=identity.bind_connection
            ),
        )

    @classmethod
    def create(cls, settings: AgentSettings) -> Agent:
        """The real components for ``settings``, in either mode; everything opened is closed
        on failure."""
        closers: list[Callable[[], None]] = []
        workers = Workers(host_threads=_WORKERS)  # its threads start with the first call
        try:
            # Local mode: the ledger's directory. Kubernetes mode: holder pods are the state;
            # the directory keeps only simulation files and the crash tests' markers.
            prepare_state_dir(settings.state_dir)
            # Rebased, the mounts are the host's (its init's mount namespace, seen with
            # hostPID): our own would list the host's hierarchies where we see them, already
            # under the root.
            hierarchies = cgroups.discover(
                host_proc=settings.host_proc,
                pid="self" if settings.cgroup_root is None else 1,
                rebase=settings.cgroup_root,
            )
            log.info("device cgroups: %s layout", hierarchies.layout)
            backend = _open_backend(settings, hierarchies, workers)
            closers.append(backend.close)
            simulation, inventory = _nvml(settings, closers)
            injector = EngineInjector(_engine(settings, hierarchies, inventory))
        except BaseException:
            for close in reversed(closers):
                close()
            raise
        return cls(
            Components(
                settings=settings,
                backend=backend,
                inventory=inventory,
                injector=injector,
                workers=workers,
                simulation=simulation,
                usage=inventory.utilization,
                mig_caps=_mig_caps(settings, simulation),
                driver_files=_driver_files(settings),
                cuda=_cuda(simulation),
                closers=closers,
            )
        )

    async def _health_check(self) -> None:
        """The allocator answers (the ledger: behind whatever is queued for it)."""
        await self.core.allocator.check()

    async def start(self) -> None:
        """Reconcile, then serve and run the background loops."""
        self.backend.bind(self.core, service=self.service, lost=self.lost)
        await self.core.allocator.load()
        await self.service.suspender.recover()
        report = await self.reconciler.run_once()
        log.info(
            "start-up reconciliation: %s",
            dict(report.actions) if report.changed else "ledger and host agree",
        )
        for failure in report.failures:
            log.error("start-up reconciliation could not fix: %s", failure)
        await self.service.refresh_gpu_metrics()
        self.backend.start(reconcile=self.reconciler.run_once)
        settings = self.settings
        self.server.start(
            settings.listen, socket_mode=settings.socket_mode, socket_group=settings.socket_group
        )
        if self.metrics_server is not None:
            self.metrics_server.start(
                settings.metrics_listen, socket_mode=settings.socket_mode, socket_group=None
            )
        await self.health.probe()
        self._spawn(self.health.run_forever())
        if settings.reconcile_interval > 0:
            self._spawn(self.reconciler.run_forever(settings.reconcile_interval))
        self._spawn(self.idle.run_forever(settings.idle_check_interval))
        simulation = self.components.simulation
        if simulation is not None and settings.simulation_interval > 0:
            cuda = self.components.cuda
            self._spawn(
                simulation.animate(
                    interval=settings.simulation_interval,
                    in_use=self.idle.held_gpus,
                    # The simulated driver knows which users hold only a CUDA context (idle).
                    context_memory=None if cuda is None else cuda.device_memory,
                )
            )

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run ``coroutine`` beside the agent until it ends or the agent stops (the loops, and
        the node sweep's loss sequences: a finished one is forgotten)."""
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reconcile_now(self) -> None:
        """One reconciliation pass outside the schedule (SIGHUP); a failure is logged."""
        try:
            report = await self.reconciler.run_once()
        except Exception:
            log.exception("reconciliation on request failed")
            return
        log.info("reconciliation on request: %s", dict(report.actions) or "nothing to do")

    async def stop(self) -> None:
        """Stop serving, let running operations finish, close everything."""
        log.info("stopping: no new connections; waiting for operations in flight")
        self.health.stopping()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self.server.stop_listening()
        if self.metrics_server is not None:
            self.metrics_server.stop_listening()
        try:
            await asyncio.wait_for(self.service.wait_idle(), _DRAIN_TIMEOUT)
        except TimeoutError:
            log.error("operations still running after %.0f s; stopping anyway", _DRAIN_TIMEOUT)
        await self.server.close_connections()
        if self.metrics_server is not None:
            await self.metrics_server.close_connections()
        await self.backend.stop()
        self.core.workers.shutdown()
        for close in reversed(self.components.closers):
            close()
        log.info("stopped")


def _mig_caps(settings: AgentSettings, simulation: Simulation | None) -> Callable[[], MigCaps]:
    """How to read the MIG capability tables: the simulated node's, or the host's (from the
    host's procfs, read each time: the driver numbers instances when they are created)."""
    proc_devices = settings.host_proc / "devices"
    mig_minors = settings.host_proc / "driver" / "nvidia-caps" / "mig-minors"
    if simulation is not None and simulation.mig_minors is not None:
        proc_devices, mig_minors = simulation.proc_devices or proc_devices, simulation.mig_minors
    return lambda: MigCaps.read(proc_devices=proc_devices, mig_minors=mig_minors)


def _open_backend(
    settings: AgentSettings, hierarchies: cgroups.CgroupHierarchies, workers: Workers
) -> AgentBackend:
    """The backend ``settings`` names, with its parts built (and closed again on failure)."""
    if settings.backend is not Backend.KUBERNETES:
        return LocalBackend.create(settings, hierarchies, workers)
    try:
        from .kubernetes.backend import KubernetesBackend
    except ModuleNotFoundError as e:
        # The Kubernetes client, grpcio and protobuf are the [agent] extra: notebook images
        # install the package without them (pyproject.toml says why).
        raise RuntimeError(
            f"Kubernetes mode needs the agent's dependencies ({e.name} is not installed):"
            " pip install 'jupyter-gpu-hotplug[agent]'"
        ) from e
    return KubernetesBackend.create(settings, hierarchies)


def _nvml(
    settings: AgentSettings, closers: list[Callable[[], None]]
) -> tuple[Simulation | None, NvmlInventory]:
    """The node's GPUs through NVML — the simulated library first, when asked (either mode);
    what must be closed is added to ``closers``."""
    simulation = None
    if settings.simulated:
        simulation = Simulation.prepare(
            settings.simulation_dir or settings.state_dir / "simulation",
            settings.simulate,
            mig_profiles=settings.simulate_mig,
            nvlink_gpus=settings.simulate_nvlink,
            host_proc_devices=settings.host_proc / "devices",
        )
        simulation.load_in_process()
    inventory = NvmlInventory()
    closers.append(inventory.close)
    return simulation, inventory


def _engine(
    settings: AgentSettings, hierarchies: cgroups.CgroupHierarchies, inventory: NvmlInventory
) -> HotplugEngine:
    """The hot-plug engine, asking NVML too which processes hold a GPU open."""
    from ..linux.engine import HotplugEngine

    major = settings.device_major

    def nvml_holders(device: Any) -> list[int]:
        return inventory.running_pids(device.minor) if device.major == major else []

    return HotplugEngine(
        host_proc=settings.host_proc,
        hierarchies=hierarchies,
        extra_holders=nvml_holders,
        terminate_grace=settings.force_grace,
    )
