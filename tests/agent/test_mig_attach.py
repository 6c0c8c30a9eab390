"""MIG slices through the service, against in-memory host fakes and a real ledger.

The node: GPU 0 in MIG mode with two 1g.10gb slices, GPUs 1-3 whole. The capability tables
are test files (the simulator's ``mig-minors``, an ``nvidia-caps`` major of 241). What must
hold: a slice's attach grants its GPU's node and its two capability nodes, nothing of the other
slice; a GPU in MIG mode is never handed out whole; detaching a slice takes back exactly its
capabilities (and its GPU's node only when no other slice of that GPU stays with the
container, reserved or assigned by a device plugin); the reconciler leaves the shared GPU node
alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PidRef
from jupyter_gpu_hotplug.agent.core.devices import GpuNodes
from jupyter_gpu_hotplug.agent.core.errors import InsufficientGpus, InvalidRequest, Unavailable
from jupyter_gpu_hotplug.agent.core.injector import InjectionFailed
from jupyter_gpu_hotplug.agent.core.inventory import GpuDevice
from jupyter_gpu_hotplug.agent.core.seams import AttachRequest, HostContainer
from jupyter_gpu_hotplug.linux.devrules import CharDevice
from jupyter_gpu_hotplug.linux.mig import MigCaps
from jupyter_gpu_hotplug.nvml.sim import (
    FakeNvmlConfig,
    default_gpus,
    render_mig_minors,
    with_mig_devices,
)
from jupyter_gpu_hotplug.nvml.state import MigSlice

from .service_harness import ADMIN, MAJOR, Harness

CAPS_MAJOR = 241
PROFILE = "1g.10gb"


def mig_request(pid: int, count: int = 1, profile: str = PROFILE) -> AttachRequest:
    return AttachRequest(
        count=count, target=PidRef(pid), wait_seconds=60, request_id=None, mig=profile
    )


@pytest.fixture
def node(harness: Harness, tmp_path: Path) -> FakeNvmlConfig:
    """Put GPU 0 of the harness in MIG mode with two slices, as NVML and the driver show it."""
    first, *_ = default_gpus(4)
    config = FakeNvmlConfig(gpus=(with_mig_devices(first, [PROFILE, PROFILE]),))
    (tmp_path / "devices").write_text(f"Character devices:\n{CAPS_MAJOR} nvidia-caps\n")
    (tmp_path / "mig-minors").write_text(render_mig_minors(config))
    gpus = harness.inventory.gpus
    gpus[0] = dataclasses.replace(gpus[0], mig_enabled=True)
    for device in config.gpus[0].mig_devices:
        gpus.insert(
            1,
            GpuDevice(
                uuid=device.uuid,
                index=0,
                minor=0,
                name=device.name,
                memory_total=device.memory_total,
                simulated=True,
                mig=MigSlice(gpus[0].uuid, PROFILE, device.gpu_instance_id, 0),
            ),
        )
    nodes = GpuNodes(
        major=MAJOR,
        mig_caps=lambda: MigCaps.read(
            proc_devices=tmp_path / "devices", mig_minors=tmp_path / "mig-minors"
        ),
    )
    harness.core.nodes = nodes
    return config


def caps(node: FakeNvmlConfig, index: int) -> set[CharDevice]:
    device = node.gpus[0].mig_devices[index]
    return {
        CharDevice(CAPS_MAJOR, device.gi_access_minor),
        CharDevice(CAPS_MAJOR, device.ci_access_minor),
    }


GPU0 = CharDevice(195, 0)


async def test_two_kernels_each_get_one_slice(harness: Harness, node: FakeNvmlConfig) -> None:
    first, second = (harness.host.spawn(pid, f"kernel-{pid}") for pid in (100, 200))

    one = await harness.service.attach(ADMIN, mig_request(100))
    two = await harness.service.attach(ADMIN, mig_request(200))

    slices = {device.uuid: i for i, device in enumerate(node.gpus[0].mig_devices)}
    (a,), (b,) = one["attachments"], two["attachments"]
    assert {a["uuid"], b["uuid"]} == set(slices)
    assert (a["minor"], a["device"]) == (0, "/dev/nvidia0")
    assert harness.injector.usable(first.target) == {GPU0} | caps(node, slices[a["uuid"]])
    assert harness.injector.usable(second.target) == {GPU0} | caps(node, slices[b["uuid"]])
    with pytest.raises(InsufficientGpus):
        await harness.service.attach(ADMIN, mig_request(100))

    await harness.reconciler.run_once()  # the shared GPU node is nobody's stray
    assert harness.injector.usable(first.target) == {GPU0} | caps(node, slices[a["uuid"]])

    await harness.service.detach(ADMIN, GpuUuid(a["uuid"]), force=False)

    assert harness.injector.usable(first.target) == set()
    assert harness.injector.usable(second.target) == {GPU0} | caps(node, slices[b["uuid"]])


async def test_a_gpu_in_mig_mode_is_never_handed_out_whole(
    harness: Harness, node: FakeNvmlConfig
) -> None:
    harness.host.spawn(100, "kernel-100")

    result = await harness.service.attach(
        ADMIN, AttachRequest(count=3, target=PidRef(100), wait_seconds=60, request_id=None)
    )

    assert sorted(a["minor"] for a in result["attachments"]) == [1, 2, 3]
    assert all(a["uuid"].startswith("GPU-") for a in result["attachments"])
    harness.host.spawn(200, "kernel-200")
    with pytest.raises(InsufficientGpus):
        await harness.service.attach(
            ADMIN, AttachRequest(count=1, target=PidRef(200), wait_seconds=60, request_id=None)
        )


async def test_the_gpu_list_says_which_gpu_is_whole_in_mig_mode_or_a_slice(
    harness: Harness, node: FakeNvmlConfig
) -> None:
    # Every GPU is listed (free), but only the whole ones are what an attach of count alone
    # gets: a client counts "N free" by kind, never by guessing from the UUID.
    harness.host.spawn(100, "kernel-100")
    await harness.service.attach(ADMIN, mig_request(100))

    listed = (await harness.service.gpus(ADMIN))["gpus"]

    kinds = {g["uuid"]: g["kind"] for g in listed}
    slices = [device.uuid for device in node.gpus[0].mig_devices]
    assert kinds[harness.inventory.gpus[0].uuid] == "mig_parent"
    assert [kinds[uuid] for uuid in slices] == ["mig_slice", "mig_slice"]
    whole = [g for g in listed if g["kind"] == "gpu"]
    assert sorted(g["minor"] for g in whole) == [1, 2, 3]
    assert all(g["state"] == "free" for g in whole)
    assert sorted(g["state"] for g in listed if g["kind"] == "mig_slice") == ["attached", "free"]
    assert [g["uuid"] for g in listed if g["plain_attach"]] == [g["uuid"] for g in whole]


async def test_an_agent_of_one_profile_lists_its_slices_as_what_a_plain_attach_gets(
    harness: Harness, node: FakeNvmlConfig
) -> None:
    """Kubernetes mode with a MIG resource name: an attach of count alone gets slices, so
    they, not the whole GPUs, are what "N free" counts."""
    harness.service._config = dataclasses.replace(harness.service._config, mig_profile=PROFILE)

    listed = (await harness.service.gpus(ADMIN))["gpus"]

    assert sorted(g["uuid"] for g in listed if g["plain_attach"]) == sorted(
        device.uuid for device in node.gpus[0].mig_devices
    )


async def test_detaching_one_of_two_slices_keeps_the_other(
    harness: Harness, node: FakeNvmlConfig
) -> None:
    kernel = harness.host.spawn(100, "kernel-100")
    both = await harness.service.attach(ADMIN, mig_request(100, count=2))
    slices = {device.uuid: i for i, device in enumerate(node.gpus[0].mig_devices)}
    first, second = (a["uuid"] for a in both["attachments"])
    assert harness.injector.usable(kernel.target) == {GPU0} | caps(node, 0) | caps(node, 1)

    await harness.service.detach(ADMIN, GpuUuid(first), force=False)

    assert harness.injector.usable(kernel.target) == {GPU0} | caps(node, slices[second])


async def test_an_agent_of_one_profile_gives_every_attach_slices_of_it(
    harness: Harness, node: FakeNvmlConfig
) -> None:
    """Kubernetes mode with a MIG resource name: holders request slices of one profile only."""
    harness.service._config = dataclasses.replace(harness.service._config, mig_profile=PROFILE)
    kernel = harness.host.spawn(100, "kernel-100")

    result = await harness.service.attach(
        ADMIN, AttachRequest(count=1, target=PidRef(100), wait_seconds=60, request_id=None)
    )

    (a,) = result["attachments"]
    slices = {device.uuid: i for i, device in enumerate(node.gpus[0].mig_devices)}
    assert a["uuid"] in slices and a["minor"] == 0
    assert harness.injector.usable(kernel.target) == {GPU0} | caps(node, slices[a["uuid"]])
    with pytest.raises(InvalidRequest, match=r"profile 1g\.10gb only, not 2g\.20gb"):
        await harness.service.attach(ADMIN, mig_request(100, profile="2g.20gb"))


async def test_unknown_profile(harness: Harness, node: FakeNvmlConfig) -> None:
    harness.host.spawn(100, "kernel-100")
    with pytest.raises(InsufficientGpus, match=r"no MIG slice of profile 2g\.20gb") as caught:
        await harness.service.attach(ADMIN, mig_request(100, profile="2g.20gb"))
    assert "1g.10gb" in caught.value.message
    assert (caught.value.free, caught.value.retryable) == (0, False)


async def test_no_mig_on_the_node(harness: Harness) -> None:
    harness.host.spawn(100, "kernel-100")
    with pytest.raises(InsufficientGpus, match="no GPU of this node is in MIG mode"):
        await harness.service.attach(ADMIN, mig_request(100))


async def test_a_lost_slice_goes_through_the_same_rule_as_a_detach(
    harness: Harness, node: FakeNvmlConfig
) -> None:
    """Issue 23: ``take_back`` (a holder lost) revokes the slice's caps nodes and keeps the
    GPU node the container's other slice needs; the reservation is released."""
    kernel = harness.host.spawn(100, "kernel-100")
    both = await harness.service.attach(ADMIN, mig_request(100, count=2))
    slices = {device.uuid: i for i, device in enumerate(node.gpus[0].mig_devices)}
    lost, kept = (a["uuid"] for a in both["attachments"])
    entry = harness.allocator.get(GpuUuid(lost))
    assert entry is not None

    outcome = await harness.service.revoker.take_back(entry, force=False)

    assert outcome is not None and not outcome.gone and not outcome.forced
    assert harness.injector.usable(kernel.target) == {GPU0} | caps(node, slices[kept])
    assert harness.allocator.get(GpuUuid(lost)) is None
    assert await harness.service.revoker.take_back(entry, force=False) is None, "already released"


async def test_a_named_slice_is_the_one_attached(harness: Harness, node: FakeNvmlConfig) -> None:
    # A MIG- UUID names its slice as mig names a profile: the target gets that slice's nodes.
    kernel = harness.host.spawn(100, "kernel-100")
    second = node.gpus[0].mig_devices[1].uuid

    result = await harness.service.attach(
        ADMIN,
        AttachRequest(
            count=1, target=PidRef(100), wait_seconds=60, request_id=None, gpus=(second,)
        ),
    )

    assert [a["uuid"] for a in result["attachments"]] == [second]
    assert harness.injector.usable(kernel.target) == {GPU0} | caps(node, 1)
    # With mig, the slice must be of that profile.
    harness.host.spawn(200, "kernel-200")
    first = node.gpus[0].mig_devices[0].uuid
    both = AttachRequest(
        count=1, target=PidRef(200), wait_seconds=60, request_id=None, gpus=(first,), mig=PROFILE
    )
    assert (await harness.service.attach(ADMIN, both))["attachments"][0]["uuid"] == first


async def test_a_gpu_in_mig_mode_cannot_be_named_whole(
    harness: Harness, node: FakeNvmlConfig
) -> None:
    harness.host.spawn(100, "kernel-100")
    parent = harness.inventory.gpus[0]
    whole = harness.inventory.gpus[-1]

    with pytest.raises(InvalidRequest) as caught:
        await harness.service.attach(
            ADMIN,
            AttachRequest(
                count=1, target=PidRef(100), wait_seconds=60, request_id=None, gpus=(parent.uuid,)
            ),
        )
    assert caught.value.field == "gpus"
    assert "is in MIG mode" in caught.value.message
    with pytest.raises(InvalidRequest, match="not a MIG slice of profile"):
        await harness.service.attach(
            ADMIN,
            AttachRequest(
                count=1,
                target=PidRef(100),
                wait_seconds=60,
                request_id=None,
                gpus=(whole.uuid,),
                mig=PROFILE,
            ),
        )
    listed = {g["uuid"]: g["selectable"] for g in (await harness.service.gpus(ADMIN))["gpus"]}
    assert not listed[parent.uuid] and listed[whole.uuid]
    assert all(listed[device.uuid] for device in node.gpus[0].mig_devices)
    assert harness.ledger.attachments() == []


async def test_detaching_a_slice_keeps_the_gpu_node_of_the_plugins_slice(
    harness: Harness, node: FakeNvmlConfig
) -> None:
    """The device plugin gave the container slice 0 at its start (``BackendHooks.assigned``,
    its rules the runtime's); the agent attaches slice 1 and detaches it: slice 1's caps go,
    ``/dev/nvidia0`` stays, which the plugin's slice needs too. A whole GPU's detach never
    asks what was assigned (no other GPU needs its node)."""
    planned, attached = (device.uuid for device in node.gpus[0].mig_devices)
    asked: list[HostContainer] = []

    def assigned(container: HostContainer) -> set[GpuUuid]:
        asked.append(container)
        return {planned}

    harness.core.hooks = dataclasses.replace(harness.core.hooks, assigned=assigned)
    kernel = harness.host.spawn(100, "kernel-100")
    harness.injector.granted[kernel.container] = {GPU0} | caps(node, 0)
    named = AttachRequest(
        count=1, target=PidRef(100), wait_seconds=60, request_id=None, gpus=(attached,)
    )
    await harness.service.attach(ADMIN, named)
    assert harness.injector.usable(kernel.target) == {GPU0} | caps(node, 0) | caps(node, 1)

    await harness.service.detach(ADMIN, GpuUuid(attached), force=False)

    assert harness.injector.usable(kernel.target) == {GPU0} | caps(node, 0)
    assert len(asked) == 1
    whole = harness.inventory.gpus[-1]
    await harness.service.attach(ADMIN, dataclasses.replace(named, gpus=(whole.uuid,)))
    await harness.service.detach(ADMIN, whole.uuid, force=False)
    assert harness.injector.usable(kernel.target) == {GPU0} | caps(node, 0)
    assert len(asked) == 1, "a whole GPU's detach asks nothing of the backend"


async def test_a_slice_detach_while_the_plugins_gpus_cannot_be_read_is_a_retryable_503(
    harness: Harness, node: FakeNvmlConfig
) -> None:
    """What the container was assigned cannot be read just now (the kubelet restarting): the
    detach changes nothing and says to try again (503), rather than a final 422; once the
    backend answers again the same detach goes through."""
    slice_uuid = node.gpus[0].mig_devices[1].uuid
    answering = False

    def assigned(container: HostContainer) -> set[GpuUuid]:
        if not answering:
            raise InjectionFailed("PodResources: connection refused", clean=True, passing=True)
        return set()

    harness.core.hooks = dataclasses.replace(harness.core.hooks, assigned=assigned)
    kernel = harness.host.spawn(100, "kernel-100")
    named = AttachRequest(
        count=1, target=PidRef(100), wait_seconds=60, request_id=None, gpus=(slice_uuid,)
    )
    await harness.service.attach(ADMIN, named)
    granted = harness.injector.usable(kernel.target)

    with pytest.raises(Unavailable) as caught:
        await harness.service.detach(ADMIN, GpuUuid(slice_uuid), force=False)

    assert caught.value.retryable
    assert harness.injector.usable(kernel.target) == granted
    assert harness.core.allocator.get(GpuUuid(slice_uuid)) is not None
    answering = True
    await harness.service.detach(ADMIN, GpuUuid(slice_uuid), force=False)
    assert harness.core.allocator.get(GpuUuid(slice_uuid)) is None
    assert harness.injector.usable(kernel.target) == set()
