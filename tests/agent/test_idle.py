"""The idle policy against in-memory host fakes and a real ledger, with clocks the test moves.

What must hold: an unused GPU is announced, then released and free again; a GPU that a process
of its target holds open, or that NVML sees busy, is never released however long it stays so;
use in the meantime calls the release off; a request can make the policy stricter, never
laxer; the lease ends only for an unused GPU; nothing is released while an operation runs on
the target.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PidRef
from jupyter_gpu_hotplug.agent.core.hooks import BackendHooks
from jupyter_gpu_hotplug.agent.core.idle import (
    IdlePolicy,
    IdleReason,
    IdleRelease,
    IdleWarning,
)
from jupyter_gpu_hotplug.agent.core.idle_releaser import IdleReleaser
from jupyter_gpu_hotplug.agent.core.seams import AttachRequest
from jupyter_gpu_hotplug.agent.core.workers import Workers

from .fakes import FakeProcess
from .service_harness import ADMIN, Harness, built


@dataclass
class Clocks:
    """A monotonic clock and a wall clock that move together, only when told."""

    now: float = 1000.0
    start: datetime = field(default_factory=lambda: datetime.now(UTC))

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return self.start + timedelta(seconds=self.now - 1000.0)

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Idle:
    harness: Harness
    releaser: IdleReleaser
    clocks: Clocks
    usage: dict[GpuUuid, int | None]

    def policy(self, **settings: float) -> None:
        self.harness.core.idle.policy = IdlePolicy(**settings)

    async def attach(
        self, pid: int, *, idle_release_seconds: float | None = None
    ) -> tuple[FakeProcess, GpuUuid]:
        process = self.harness.host.spawn(pid, f"kernel-{pid}")
        result = await self.harness.service.attach(
            ADMIN,
            AttachRequest(
                count=1,
                target=PidRef(pid),
                wait_seconds=60.0,
                request_id=None,
                idle_release_seconds=idle_release_seconds,
            ),
        )
        return process, result["attachments"][0]["uuid"]

    async def after(self, seconds: float) -> list[GpuUuid]:
        """Move both clocks, run one pass, return what it released."""
        self.clocks.advance(seconds)
        return [release.uuid for release in await self.releaser.run_once()]

    def attached(self, process: FakeProcess) -> list[GpuUuid]:
        return [e.gpu.uuid for e in self.harness.allocator.attachments_of(process.target)]


def _idle(harness: Harness) -> Idle:
    clocks = Clocks()
    usage: dict[GpuUuid, int | None] = {}
    releaser = IdleReleaser(
        harness.core,
        usage=lambda: dict(usage),
        release=harness.service.release_unused,
        clock=clocks.monotonic,
        wall=clocks.wall,
    )
    return Idle(harness, releaser, clocks, usage)


@pytest.fixture
def idle(harness: Harness, workers: Workers) -> Iterator[Idle]:
    yield _idle(harness)


async def test_off_by_default(idle: Idle) -> None:
    process, _ = await idle.attach(100)
    assert await idle.after(0) == []
    assert await idle.after(10**7) == []
    assert idle.attached(process) != []


async def test_unused_gpu_is_announced_then_released_and_free(idle: Idle) -> None:
    idle.policy(idle_seconds=600, warning_seconds=60)
    process, uuid = await idle.attach(100)

    assert await idle.after(0) == []  # the idle period starts now
    assert await idle.after(539) == []
    view = await idle.harness.service.attachments(ADMIN, PidRef(100))
    assert "idle_release" not in view["attachments"][0], "not yet within the warning time"

    assert await idle.after(1) == []
    (attachment,) = (await idle.harness.service.attachments(ADMIN, PidRef(100)))["attachments"]
    release_at = (idle.clocks.wall() + timedelta(seconds=60)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert attachment["idle_release"] == {"reason": "idle", "release_at": release_at}
    assert idle.harness.sample("gpu_hotplug_idle_warnings_total", reason="idle") == 1
    assert await idle.after(30) == [], "warned once, released only when due"
    assert idle.harness.sample("gpu_hotplug_idle_warnings_total", reason="idle") == 1

    assert await idle.after(30) == [uuid]

    assert idle.attached(process) == []
    assert idle.harness.injector.usable(process.target) == set()
    assert idle.harness.sample("gpu_hotplug_idle_releases_total", reason="idle") == 1
    (record,) = (await idle.harness.service.idle_releases(ADMIN, PidRef(100)))["releases"]
    assert (record["uuid"], record["target"], record["reason"]) == (uuid, {"pid": 100}, "idle")
    _other, again = await idle.attach(200)
    assert again == uuid, "the released GPU is free again (the first in index order)"
    assert (await idle.harness.service.idle_releases(ADMIN, PidRef(200)))["releases"] == []


async def test_gpu_held_open_is_never_released(idle: Idle) -> None:
    idle.policy(idle_seconds=60, warning_seconds=10)
    process, uuid = await idle.attach(100)
    idle.harness.injector.hold(process, 0, pid=101, command="python")

    for _ in range(5):
        assert await idle.after(3600) == []

    assert idle.attached(process) == [uuid]
    view = await idle.harness.service.attachments(ADMIN, PidRef(100))
    assert "idle_release" not in view["attachments"][0]
    assert idle.harness.sample("gpu_hotplug_idle_warnings_total", reason="idle") == 0


async def test_gpu_busy_in_nvml_is_never_released(idle: Idle) -> None:
    idle.policy(idle_seconds=60)
    process, uuid = await idle.attach(100)
    idle.usage[uuid] = 35

    assert await idle.after(0) == []
    assert await idle.after(3600) == []
    assert idle.attached(process) == [uuid]


async def test_use_calls_a_release_off_and_restarts_the_period(idle: Idle) -> None:
    idle.policy(idle_seconds=100, warning_seconds=50)
    _process, uuid = await idle.attach(100)
    assert await idle.after(0) == []
    assert await idle.after(60) == []
    assert uuid in idle.harness.core.idle.warnings

    idle.usage[uuid] = 80
    assert await idle.after(10) == []
    assert uuid not in idle.harness.core.idle.warnings
    idle.usage[uuid] = 0

    assert await idle.after(90) == [], "a new idle period started when it was last used"
    assert await idle.after(10) == [uuid]


async def test_a_request_may_be_stricter_never_laxer(idle: Idle) -> None:
    strict, strict_uuid = await idle.attach(100, idle_release_seconds=30)
    assert await idle.after(0) == []
    assert await idle.after(30) == [strict_uuid], "the agent's policy is off; the request's is on"

    idle.policy(idle_seconds=100, warning_seconds=0)
    lax, lax_uuid = await idle.attach(200, idle_release_seconds=10_000)
    assert await idle.after(0) == []
    assert await idle.after(100) == [lax_uuid], "a laxer request changes nothing"
    assert idle.attached(strict) == idle.attached(lax) == []


async def test_a_backend_per_target_period_is_stricter_only_and_listeners_hear_all(
    tmp_path: Path, workers: Workers
) -> None:
    """As Kubernetes mode's pod annotation: read at each pass; warnings and releases told —
    the backend's hooks, given to the core when it is built."""
    periods: dict[int, float | None] = {100: 120.0, 200: 10**6, 300: None}
    heard: list[IdleWarning | IdleRelease] = []
    hooks = BackendHooks(
        idle_period=lambda target: periods[target.pid],  # type: ignore[union-attr]
        idle_listeners=(heard.append,),
    )
    async with built(tmp_path, workers, hooks=hooks) as harness:
        await _a_backend_period(_idle(harness), heard)


async def _a_backend_period(idle: Idle, heard: list[IdleWarning | IdleRelease]) -> None:
    idle.policy(idle_seconds=600, warning_seconds=60)
    strict, uuid = await idle.attach(100)
    lax, _ = await idle.attach(200)
    plain, _ = await idle.attach(300)

    assert await idle.after(0) == []
    assert await idle.after(60) == []
    assert [(type(e), e.uuid, e.target) for e in heard] == [(IdleWarning, uuid, strict.target)]
    assert await idle.after(60) == [uuid]
    assert isinstance(heard[-1], IdleRelease) and heard[-1].uuid == uuid
    assert await idle.after(479) == [], "a laxer period changes nothing, nor none"
    assert len(await idle.after(1)) == 2
    assert idle.attached(lax) == idle.attached(plain) == []


async def test_lease_ends_only_for_an_unused_gpu(idle: Idle) -> None:
    idle.policy(max_lease_seconds=3600, warning_seconds=0)
    process, uuid = await idle.attach(100)
    idle.clocks.start = datetime.now(UTC)  # the wall clock starts at the grant
    idle.harness.injector.hold(process, 0, pid=101)

    assert await idle.after(7200) == [], "in use: kept past its lease"
    idle.harness.injector.holders_of.clear()
    (release,) = await idle.releaser.run_once()

    assert (release.uuid, release.reason) == (uuid, IdleReason.LEASE)
    assert idle.harness.sample("gpu_hotplug_idle_releases_total", reason="lease") == 1


async def test_opened_during_the_release_is_kept(
    idle: Idle, monkeypatch: pytest.MonkeyPatch
) -> None:
    idle.policy(idle_seconds=60, warning_seconds=0)
    process, uuid = await idle.attach(100)
    assert await idle.after(0) == []
    holders = idle.harness.injector.holders
    # The busy check finds nothing, then a process opens the GPU before the revoke.
    monkeypatch.setattr(idle.harness.injector, "holders", lambda *args, **how: [])
    idle.harness.injector.hold(process, 0, pid=101)

    assert await idle.after(60) == []

    assert idle.attached(process) == [uuid]
    assert idle.harness.injector.usable(process.target) != set()
    monkeypatch.setattr(idle.harness.injector, "holders", holders)


async def test_target_with_an_operation_running_is_left_for_the_next_pass(idle: Idle) -> None:
    idle.policy(idle_seconds=60, warning_seconds=0)
    process, uuid = await idle.attach(100)
    assert await idle.after(0) == []

    async with idle.harness.core.locks.operation(process.target):
        assert await idle.after(60) == []
    assert await idle.after(0) == [uuid]


async def test_detached_gpu_is_forgotten(idle: Idle) -> None:
    idle.policy(idle_seconds=100, warning_seconds=100)
    _process, uuid = await idle.attach(100, idle_release_seconds=50)
    assert await idle.after(0) == []
    assert uuid in idle.harness.core.idle.warnings

    await idle.harness.service.detach(ADMIN, uuid, force=False)
    assert await idle.after(0) == []

    book = idle.harness.core.idle
    assert uuid not in book.warnings and uuid not in book.requested


async def test_a_gpu_taken_back_is_forgotten_too(idle: Idle) -> None:
    """Every release is the one step ``Core.release``: a take-back (a lost holder) forgets the
    GPU's idle state as a detach does (it used to stay, for the GPU's next holder to inherit)."""
    idle.policy(idle_seconds=100, warning_seconds=100)
    _process, uuid = await idle.attach(100, idle_release_seconds=50)
    assert await idle.after(0) == []
    entry = idle.harness.allocator.get(uuid)
    assert entry is not None and uuid in idle.harness.core.idle.warnings

    await idle.harness.service.revoker.take_back(entry, force=False)

    book = idle.harness.core.idle
    assert idle.harness.allocator.get(uuid) is None
    assert uuid not in book.warnings and uuid not in book.requested


def test_policy_values() -> None:
    assert not IdlePolicy().enabled
    assert IdlePolicy(max_lease_seconds=1).enabled
    assert IdlePolicy().stricter(30).idle_seconds == 30
    assert IdlePolicy(idle_seconds=60).stricter(90).idle_seconds == 60
    assert IdlePolicy(idle_seconds=60).stricter(None).idle_seconds == 60
    with pytest.raises(ValueError, match="idle_seconds must not be negative"):
        IdlePolicy(idle_seconds=-1)


async def test_the_next_holder_starts_its_own_idle_period(idle: Idle) -> None:
    """Attack (issue 25, item 6): idle state was kept per GPU, so B, who got the GPU A had left
    unused for 590 s, lost it 10 s later (and saw A's warning). It belongs to the attachment."""
    idle.policy(idle_seconds=600, warning_seconds=60)
    _, uuid = await idle.attach(100)
    assert await idle.after(0) == []
    assert await idle.after(590) == []  # A: unused for 590 s, warned
    await idle.harness.service.detach(ADMIN, uuid, force=False)

    second, again = await idle.attach(200)
    assert again == uuid, "B gets the GPU A left"

    view = await idle.harness.service.attachments(ADMIN, PidRef(200))
    assert "idle_release" not in view["attachments"][0], "A's warning is not B's"
    assert await idle.after(10) == []  # B's idle period starts at this pass
    assert await idle.after(599) == []
    assert await idle.after(1) == [uuid], "B's own 600 s"
    assert idle.attached(second) == []


async def test_held_gpus_are_those_a_process_holds_open_not_nvml_busy_ones(idle: Idle) -> None:
    """What the simulation asks to decide which simulated GPUs work: the device-node scan only
    (NVML's utilisation is the simulation's own output there)."""
    first, held = await idle.attach(100)
    _, other = await idle.attach(200)
    idle.usage[other] = 90
    assert await idle.releaser.held_gpus() == {}

    [entry] = idle.harness.allocator.attachments_of(first.target)
    idle.harness.injector.hold(first, entry.gpu.minor, pid=101)

    assert await idle.releaser.held_gpus() == {held: (101,)}
