"""The kernel's suspension in the ``gpus`` reply (issue 39): what the agent says of a kernel
whose CUDA state it keeps without GPUs reaches the lab in the agent's own shape, and the reply
keeps to the document the server serves, with and without one."""

from __future__ import annotations

import json
from typing import Any, Final

import pytest
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from jupyter_gpu_hotplug._structs import GpuUuid, SuspendedWire
from jupyter_gpu_hotplug.client.models import parse_attachment_state
from jupyter_gpu_hotplug.server.models import GpusJson, gpus_json
from jupyter_gpu_hotplug.server.openapi import openapi_document

from .test_holders import KERNELS, _snapshot, gpu

UUID: Final = GpuUuid("GPU-00000000-0000-0000-0000-000000000000")
BASE: Final = "urn:gpu-hotplug:server"


def _reply(agent_body: dict[str, Any]) -> GpusJson:
    """The reply for kernel ``k-1`` whose attachments the agent answered with ``agent_body``."""
    state = parse_attachment_state(agent_body)
    return gpus_json(
        mode="local",
        kernel_id="k-1",
        attachments=state.attachments,
        node=[gpu(0, None)],
        snapshot=_snapshot(),
        max_count=8,
        kernels=KERNELS,
        suspended=state.suspended,
    )


def _conforms(reply: GpusJson) -> list[str]:
    """What in ``reply`` the served document's ``Gpus`` schema refuses (JSON as sent)."""
    document = json.loads(openapi_document(mode="local", max_count=8))
    registry = Registry().with_resource(BASE, DRAFT202012.create_resource(document))
    validator = Draft202012Validator(
        {"$ref": f"{BASE}#/components/schemas/Gpus"}, registry=registry
    )
    return [error.message for error in validator.iter_errors(json.loads(json.dumps(reply)))]


def test_a_kernel_that_is_not_suspended_says_so_with_null() -> None:
    reply = _reply({"attachments": []})

    assert reply["suspended"] is None
    assert _conforms(reply) == []


@pytest.mark.parametrize(
    "suspended",
    [
        SuspendedWire(
            state="suspended",
            model="NVIDIA H100",
            uuids=[UUID],
            pids=[4242],
            host_memory=3 * 2**30,
        ),
        SuspendedWire(
            state="suspending",
            model="NVIDIA H100",
            uuids=[UUID],
            pids=[4242],
            host_memory=None,
        ),
    ],
    ids=["suspended-with-size", "suspending-size-unknown"],
)
def test_a_suspended_kernel_gets_the_agents_shape(suspended: SuspendedWire) -> None:
    """The agent's members, all of them and nothing else, so the lab words it as the magic
    does (state, host memory, what resumes it); the kernel has no GPU meanwhile."""
    reply = _reply({"attachments": [], "suspended": {**suspended, "from_a_newer_agent": 1}})

    assert reply["suspended"] == suspended
    assert reply["attached"] == []
    assert _conforms(reply) == []


def test_a_kernel_without_a_name_has_no_suspension() -> None:
    """The node view (no kernel named) answers ``null`` too: the member is always there."""
    reply = gpus_json(
        mode="local",
        kernel_id=None,
        attachments=(),
        node=[gpu(0, None)],
        snapshot=_snapshot(),
        max_count=8,
    )

    assert reply["suspended"] is None
    assert _conforms(reply) == []
