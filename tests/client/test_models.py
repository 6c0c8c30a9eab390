"""Parsing answers into values: the contract's shapes are accepted, anything else is named."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import pytest

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.client.models import (
    Attachment,
    Gpu,
    Health,
    parse_attachment_state,
    parse_attachments,
    parse_gpus,
    parse_health,
    plain_free,
)

from . import samples
from .stub_agent import check_against_contract


def test_samples_are_contract_answers() -> None:
    check_against_contract("GET", "/v1/gpus", 200, samples.GPUS)
    check_against_contract("GET", "/v1/attachments", 200, samples.ATTACHMENTS)
    check_against_contract("POST", "/v1/attachments", 201, samples.LOCAL_ATTACHMENTS)
    check_against_contract("GET", "/v1/attachments", 200, samples.SUSPENDED)


def test_parse_gpus() -> None:
    first, second = parse_gpus(samples.GPUS)

    assert first.target == samples.POD
    assert (second.state, second.target, second.simulated) == ("free", None, True)
    assert first.raw is samples.GPUS["gpus"][0]


def test_parse_attachments() -> None:
    (attachment,) = parse_attachments(samples.LOCAL_ATTACHMENTS)

    assert attachment.target == PidRef(4242)
    assert attachment.attached_at == dt.datetime(2025, 1, 2, 2, 4, 5, 250000, tzinfo=dt.UTC)
    assert attachment.device == "/dev/nvidia4"


def test_newer_members_are_ignored() -> None:
    body: Any = copy.deepcopy(samples.GPUS)
    body["gpus"][0]["mig_profile"] = "1g.10gb"
    body["node"] = "gpu-node-7"

    assert parse_gpus(body)[0].uuid == samples.UUID_A


def test_values_are_frozen_and_compare_without_raw() -> None:
    gpu = parse_gpus(samples.GPUS)[0]
    twin = parse_gpus(copy.deepcopy(samples.GPUS))[0]

    assert gpu == twin
    with pytest.raises(AttributeError):
        gpu.name = "other"  # type: ignore[misc]


def _broken_gpu(**changes: object) -> dict[str, Any]:
    body: dict[str, Any] = copy.deepcopy(dict(samples.GPUS))
    body["gpus"][1].update(changes)
    return body


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ([], "body must be an object, not list"),
        ({}, "body.gpus is missing"),
        ({"gpus": {}}, "body.gpus must be list"),
        ({"gpus": [7]}, r"gpus\[0\] must be an object"),
        (_broken_gpu(index=True), r"gpus\[1\].index must be int, not bool"),
        (_broken_gpu(state="stolen"), r"gpus\[1\].state 'stolen' is not one of"),
        (_broken_gpu(simulated=1), r"gpus\[1\].simulated must be bool"),
        (_broken_gpu(target={"pod": "x"}), r"gpus\[1\].target is not a target"),
        (_broken_gpu(target={"pid": 1}), r"gpus\[1\].target is not a target: pid 1"),
        (_broken_gpu(target={"pod": {"namespace": "A", "name": "b"}}), "not a DNS-1123 label"),
    ],
)
def test_parse_gpus_refuses(body: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_gpus(body)


def _broken_attachment(**changes: object) -> dict[str, Any]:
    body: dict[str, Any] = copy.deepcopy(dict(samples.ATTACHMENTS))
    body["attachments"][0].update(changes)
    return body


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (_broken_attachment(holder=3), r"attachments\[0\].holder must be str or null"),
        (_broken_attachment(attached_at="yesterday"), r"attachments\[0\].attached_at"),
        (_broken_attachment(attached_at="2025-01-02T03:04:05"), "has no timezone"),
        (_broken_attachment(target=None), r"attachments\[0\].target must be an object"),
    ],
)
def test_parse_attachments_refuses(body: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_attachments(body)


@pytest.mark.parametrize("member", sorted(samples.ATTACHMENTS["attachments"][0]))
def test_every_attachment_member_is_required(member: str) -> None:
    body: dict[str, Any] = copy.deepcopy(dict(samples.ATTACHMENTS))
    del body["attachments"][0][member]

    with pytest.raises(ValueError, match=rf"attachments\[0\].{member} is missing"):
        parse_attachments(body)


@pytest.mark.parametrize(
    "member", sorted(set(samples.GPUS["gpus"][0]) - {"selectable", "kind", "plain_attach"})
)
def test_every_gpu_member_is_required(member: str) -> None:
    body: dict[str, Any] = copy.deepcopy(dict(samples.GPUS))
    del body["gpus"][0][member]

    with pytest.raises(ValueError, match=rf"gpus\[0\].{member} is missing"):
        parse_gpus(body)


def test_selectable_is_read_and_an_older_agents_silence_means_false() -> None:
    # An agent older than the member cannot honour a named GPU (it refuses the field).
    body: dict[str, Any] = copy.deepcopy(dict(samples.GPUS))
    assert [gpu.selectable for gpu in parse_gpus(body)] == [True, True]
    body["gpus"][0]["selectable"] = False
    del body["gpus"][1]["selectable"]
    assert [gpu.selectable for gpu in parse_gpus(body)] == [False, False]
    body["gpus"][0]["selectable"] = "yes"
    with pytest.raises(ValueError, match=r"gpus\[0\]\.selectable must be bool"):
        parse_gpus(body)


def test_kind_and_plain_attach_are_read_and_an_older_agents_gpus_are_whole() -> None:
    # Only GPUs an attach of count alone may get count as free for it (plain_free); an agent
    # older than the members listed no MIG-mode GPU as such, so its GPUs read as whole.
    body: dict[str, Any] = copy.deepcopy(dict(samples.GPUS))
    body["gpus"][0].update(kind="mig_parent", plain_attach=False, state="free")
    gpus = parse_gpus(body)
    assert [(gpu.kind, gpu.plain_attach) for gpu in gpus] == [("mig_parent", False), ("gpu", True)]
    assert plain_free(gpus) == 1
    body["gpus"][1].update(kind="mig_slice", plain_attach=False)
    assert plain_free(parse_gpus(body)) == 0
    for member in ("kind", "plain_attach"):
        del body["gpus"][0][member]
    assert [(gpu.kind, gpu.plain_attach) for gpu in parse_gpus(body)] == [
        ("gpu", True),
        ("mig_slice", False),
    ]
    assert plain_free(parse_gpus(body)) == 1
    body["gpus"][0]["kind"] = "slice"
    with pytest.raises(ValueError, match=r"gpus\[0\]\.kind 'slice' is not one of"):
        parse_gpus(body)
    body["gpus"][0].update(kind="gpu", plain_attach="yes")
    with pytest.raises(ValueError, match=r"gpus\[0\]\.plain_attach must be bool"):
        parse_gpus(body)


def test_parse_health() -> None:
    assert parse_health({"status": "ok"}) == Health("ok")
    with pytest.raises(ValueError, match=r"body\.status is missing"):
        parse_health({})


def test_from_wire_defaults_name_the_object() -> None:
    with pytest.raises(ValueError, match=r"^gpu must be an object"):
        Gpu.from_wire(None)
    with pytest.raises(ValueError, match=r"^attachment must be an object"):
        Attachment.from_wire("x")


def _broken_suspension(**changes: object) -> dict[str, Any]:
    body: dict[str, Any] = copy.deepcopy(dict(samples.SUSPENDED))
    body["suspended"].update(changes)
    return body


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (_broken_suspension(state="asleep"), r"body.suspended.state 'asleep' is not one of"),
        (_broken_suspension(host_memory="3G"), r"body.suspended.host_memory must be int or null"),
        (_broken_suspension(host_memory=True), r"body.suspended.host_memory must be int or null"),
        (_broken_suspension(pids=["42"]), r"body.suspended.pids\[0\] must be int"),
        (_broken_suspension(uuids=[7]), r"body.suspended.uuids\[0\] must be str"),
        ({"attachments": [], "suspended": []}, "body.suspended must be an object"),
    ],
)
def test_parse_attachment_state_refuses(body: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_attachment_state(body)


def test_a_suspension_of_unknown_size_reads_as_none() -> None:
    state = parse_attachment_state(_broken_suspension(host_memory=None))

    assert state.suspended is not None
    assert (state.suspended.host_memory, state.suspended.pids) == (None, (4242,))
