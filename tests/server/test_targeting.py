"""The targets strategies (``server/targeting.py``): whom each mode's operations act on.

Unit tests over ``RegisteredSandboxes`` (kernel ids mapped to pids, no kernels started); the
REST tests (``test_api*.py``) prove the same answers through the manager against a real agent.
"""

from __future__ import annotations

import json

import pytest

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.server.errors import KernelIdRequired, KernelNotFound, KernelNotSandboxed
from jupyter_gpu_hotplug.server.models import Mode
from jupyter_gpu_hotplug.server.openapi import openapi_document
from jupyter_gpu_hotplug.server.targeting import (
    PodTargets,
    SandboxTargets,
    Target,
    kernel_required,
    targets_for,
)
from jupyter_gpu_hotplug.server.validation import KernelId
from tests.server.api_support import RegisteredSandboxes

OPERATIONS = ("attach a GPU", "detach a GPU", "cancel a waiting attach")


@pytest.fixture
def sandboxes() -> RegisteredSandboxes:
    registered = RegisteredSandboxes(kernel_manager=None)
    registered.register("k-1", 4242)
    registered.register("k-2", 4343)
    registered.register("plain", None)  # a kernel without a sandbox
    return registered


@pytest.mark.parametrize(
    ("mode", "kind"), [("local", SandboxTargets), ("kubernetes", PodTargets)], ids=str
)
def test_each_mode_gets_its_strategy(
    sandboxes: RegisteredSandboxes, mode: Mode, kind: type[object]
) -> None:
    targets = targets_for(mode, sandboxes=sandboxes)

    assert isinstance(targets, kind)
    assert targets.mode == mode


def test_local_targets_are_the_named_kernels_sandboxes(sandboxes: RegisteredSandboxes) -> None:
    targets = targets_for("local", sandboxes=sandboxes)
    expected = Target(ref=PidRef(4242), scope="k-1", label="kernel k-1 (process 4242)")

    assert targets.of(KernelId("k-1")) == expected
    for operation in OPERATIONS:
        assert targets.required(KernelId("k-1"), operation) == expected
    # Holders are this server's sandboxed kernels; the one without a sandbox holds nothing.
    assert targets.kernels_by_pid() == {4242: "k-1", 4343: "k-2"}
    assert targets.reports_queue_place


def test_local_reads_without_a_kernel_ask_for_nobodys_gpus(sandboxes: RegisteredSandboxes) -> None:
    assert targets_for("local", sandboxes=sandboxes).of(None) is None


@pytest.mark.parametrize("operation", OPERATIONS)
def test_local_changes_must_name_their_kernel(
    sandboxes: RegisteredSandboxes, operation: str
) -> None:
    with pytest.raises(KernelIdRequired, match=f"to {operation}, name the kernel") as raised:
        targets_for("local", sandboxes=sandboxes).required(None, operation)
    assert raised.value.field == "kernel_id"


@pytest.mark.parametrize(
    ("kernel_id", "error"),
    [("nobody", KernelNotFound), ("plain", KernelNotSandboxed)],
    ids=["unknown", "not-sandboxed"],
)
def test_local_refuses_a_kernel_that_cannot_be_a_target(
    sandboxes: RegisteredSandboxes, kernel_id: str, error: type[Exception]
) -> None:
    targets = targets_for("local", sandboxes=sandboxes)

    with pytest.raises(error):
        targets.of(KernelId(kernel_id))
    with pytest.raises(error):
        targets.required(KernelId(kernel_id), "attach a GPU")


@pytest.mark.parametrize("kernel_id", [None, "k-1", "nobody", "plain"])
def test_kubernetes_targets_are_the_pod_whatever_kernel_is_named(
    sandboxes: RegisteredSandboxes, kernel_id: str | None
) -> None:
    targets = targets_for("kubernetes", sandboxes=sandboxes)
    pod = Target(ref=None, scope=None, label="this pod")
    named = None if kernel_id is None else KernelId(kernel_id)

    # The agent knows the pod from the token: no kernel is looked up, none is required, and
    # every stream of the pod sees every attach (no scope).
    assert targets.of(named) == pod
    for operation in OPERATIONS:
        assert targets.required(named, operation) == pod
    assert targets.kernels_by_pid() == {}
    assert targets.reports_queue_place  # the agent answers for the caller's own pod


@pytest.mark.parametrize("mode", ["local", "kubernetes"])
def test_the_served_document_requires_a_kernel_exactly_where_the_strategy_does(
    sandboxes: RegisteredSandboxes, mode: Mode
) -> None:
    targets = targets_for(mode, sandboxes=sandboxes)
    try:
        targets.required(None, "attach a GPU")
        refuses_no_kernel = False
    except KernelIdRequired:
        refuses_no_kernel = True
    schemas = json.loads(openapi_document(mode=mode, max_count=2))["components"]["schemas"]

    assert kernel_required(mode) is refuses_no_kernel
    for body in ("AttachBody", "DetachBody", "CancelBody"):
        assert ("kernel_id" in schemas[body]["required"]) is refuses_no_kernel
