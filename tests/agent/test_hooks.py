"""A backend joins the core through its hooks, declared once and given at construction.

What must hold (issue 38, item 3): the hooks object is frozen (a backend cannot change its part
in the core once the core is built with it), and the agent builds its core with the backend's
hooks — the node sweep asks for the backend's containers in the first reconciliation, the idle
and loss books hear the backend's listeners — without ``bind`` or anyone writing an attribute
of the core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import PidTarget
from jupyter_gpu_hotplug.agent.core.hooks import BackendHooks, RunningContainer
from jupyter_gpu_hotplug.agent.core.idle import IdleReason, IdleRelease, IdleWarning
from jupyter_gpu_hotplug.agent.core.seams import Reservation
from jupyter_gpu_hotplug.agent.core.workers import Workers
from jupyter_gpu_hotplug.agent.local.allocator import LedgerAllocator
from jupyter_gpu_hotplug.agent.local.backend import LocalBackend
from jupyter_gpu_hotplug.agent.local.identity import LocalIdentity
from jupyter_gpu_hotplug.agent.local.ledger import Ledger
from jupyter_gpu_hotplug.agent.runtime import Agent, Components
from jupyter_gpu_hotplug.agent.settings import AgentSettings

from .api_harness import TOKEN
from .fakes import FakeHost, FakeInjector, FakeInventory, FakeResolver, fake_gpus


def test_the_hooks_are_frozen() -> None:
    hooks = BackendHooks()
    with pytest.raises(dataclasses.FrozenInstanceError):
        hooks.assigned = lambda container: ()  # type: ignore[misc]


@dataclasses.dataclass
class _HookedBackend(LocalBackend):
    """Local mode's parts with hooks of the test's own, as a backend declares them."""

    declared: BackendHooks = dataclasses.field(default_factory=BackendHooks)

    @property
    def hooks(self) -> BackendHooks:
        return self.declared


async def test_the_agent_builds_its_core_with_the_backends_hooks(
    tmp_path: Path, workers: Workers
) -> None:
    swept: list[Sequence[Reservation]] = []
    heard: list[IdleWarning | IdleRelease] = []

    def running(reservations: Sequence[Reservation]) -> Sequence[RunningContainer]:
        swept.append(reservations)
        return ()

    host = FakeHost()
    resolver = FakeResolver(host)
    ledger = Ledger.open(tmp_path / "state")
    hooks = BackendHooks(running=running, idle_listeners=(heard.append,))
    backend = _HookedBackend(
        ledger=ledger,
        allocator=LedgerAllocator(ledger, workers),
        resolver=resolver,
        identity=LocalIdentity(TOKEN, token_path=tmp_path / "token", resolver=resolver),
        declared=hooks,
    )
    agent = Agent(
        Components(
            settings=AgentSettings(state_dir=tmp_path / "state", simulate=0),
            backend=backend,
            inventory=FakeInventory(fake_gpus(2)),
            injector=FakeInjector(host),
            workers=workers,
        )
    )
    try:
        assert agent.core.hooks is hooks
        await agent.core.allocator.load()
        await agent.reconciler.run_once()
        assert len(swept) == 1, "the backend's sweep runs in the first pass, without bind"
        release = IdleRelease(
            fake_gpus(1)[0].uuid, PidTarget(100, 1), IdleReason.IDLE, datetime.now(UTC)
        )
        agent.core.idle.tell(release)
        assert heard == [release]
    finally:
        ledger.close()
