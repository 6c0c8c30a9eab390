"""Local mode, assembled: the backend's parts built from the settings.

Why it exists: ``runtime.py`` wires every backend into the core the same way (its allocator,
resolver, identity and hooks go into the ``Core`` when it is built; it takes the parts its
hooks act through before the first reconciliation; it runs beside the core while the agent
serves; it closes last), and what is particular to
local mode lives here, as Kubernetes mode's lives in ``kubernetes/backend.py``:

- the **SQLite ledger** in the state dir is the durable state (opened first: it also holds the
  one-agent-per-state-dir lock, so a second agent stops before it touches anything), and the
  allocator works over it in the core's ledger thread;
- targets are **processes**, resolved to their containers through ``/proc`` and the device
  cgroups (``resolver.py``); callers are the **unix socket's peer**, bound to the connection
  at accept, or holders of the agent's 0600 **token** (``identity.py``);
- the core's node sweep (``core/sweep.py``) judges **every container of the host** that could
  be a target (``ProcResolver.running``, below ``--sweep-cgroup``): a sandbox granted a GPU
  behind the agent's back is found and reported, and revoked with ``--stray-policy=revoke``.
  Local mode knows no device plugin: nothing is ``assigned``, so a container its runtime gave
  a GPU (``docker run --gpus``) is reported as a stray too.

Local mode has nothing to run beside the core: a process tells nobody when it exits, so there
is no event stream to react to as Kubernetes mode reacts to pod events; the core's timed
reconciliation is what notices.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from ...linux import cgroups
from ..core.bundle import Core
from ..core.hooks import BackendHooks, ReconcileReport, RunningContainer
from ..core.lost import LostGpus
from ..core.seams import ContainerKey, HostContainer, Reservation, Resolver, SuspensionBook
from ..core.service import AgentService
from ..core.workers import Workers
from ..settings import AgentSettings
from .allocator import LedgerAllocator
from .identity import LocalIdentity, load_or_create_token
from .ledger import Ledger
from .resolver import ProcResolver

__all__ = ["LocalBackend"]


@dataclass
class LocalBackend:
    """Local mode's parts (see the module docstring)."""

    ledger: Ledger
    allocator: LedgerAllocator
    resolver: Resolver
    """``ProcResolver`` when the agent runs; tests give a resolver of in-memory processes."""
    identity: LocalIdentity
    policy: None = None
    """No tenant policy: a target is a process, held to the per-container limit alone."""
    containers: Callable[[Collection[ContainerKey]], list[HostContainer]] | None = None
    """The host's containers for the node sweep, given the reserved ones
    (``ProcResolver.running``); None: nothing is swept (tests' in-memory processes)."""

    @property
    def suspensions(self) -> SuspensionBook:
        """Suspended targets are rows of the ledger (``ledger.py``), as reservations are."""
        return self.ledger

    @property
    def hooks(self) -> BackendHooks:
        """The node sweep's containers (``running``); nothing else of its own: no device
        plugin hands out GPUs (nothing is ``assigned``), no per-target idle period, and nobody
        to tell of idle releases, losses or strays beyond the API and the log (a ledger
        reservation cannot be lost behind the agent's back)."""
        if self.containers is None:
            return BackendHooks()
        return BackendHooks(running=functools.partial(_running, self.containers))

    @classmethod
    def create(
        cls, settings: AgentSettings, hierarchies: cgroups.CgroupHierarchies, workers: Workers
    ) -> LocalBackend:
        """The real parts for ``settings``; the ledger is closed again if any other fails."""
        ledger = Ledger.open(settings.state_dir)
        try:
            token = load_or_create_token(settings.token_path)
            resolver = ProcResolver(
                host_proc=settings.host_proc, hierarchies=hierarchies, agent_pid=os.getpid()
            )
        except BaseException:
            ledger.close()
            raise
        return cls(
            ledger=ledger,
            allocator=LedgerAllocator(ledger, workers),
            resolver=resolver,
            identity=LocalIdentity(token, token_path=settings.token_path, resolver=resolver),
            containers=lambda owners: resolver.running(within=settings.sweep_cgroup, owners=owners),
        )

    def bind(self, core: Core, *, service: AgentService, lost: LostGpus) -> None:
        """Nothing to take: local mode's hooks act through nothing (see ``hooks``)."""

    def start(self, *, reconcile: Callable[[], Awaitable[ReconcileReport]]) -> None:
        """Nothing to react to (see the module docstring): the core's timer reconciles."""

    async def stop(self) -> None:
        """Nothing runs beside the core."""

    def close(self) -> None:
        """Close the ledger (and let go of the state dir's lock)."""
        self.ledger.close()


def _running(
    containers: Callable[[Collection[ContainerKey]], list[HostContainer]],
    reservations: Sequence[Reservation],
) -> list[RunningContainer]:
    """``BackendHooks.running`` for local mode: nothing is assigned outside the agent."""
    owners = {entry.container for entry in reservations if entry.container}
    return [RunningContainer(container) for container in containers(owners)]
