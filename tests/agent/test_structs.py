"""Targets as values: wire round trips, stable keys that tell reused pids apart, timestamps."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jupyter_gpu_hotplug._structs import (
    PID_MAX_LIMIT,
    PidRef,
    PidTarget,
    PodTarget,
    format_timestamp,
    is_dns1123_label,
    is_dns1123_subdomain,
    parse_timestamp,
    target_from_key,
    target_from_wire,
)

labels = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
subdomains = st.lists(labels, min_size=1, max_size=3).map(".".join)
pids = st.integers(min_value=2, max_value=PID_MAX_LIMIT - 1)


def test_pod_target_wire_and_key() -> None:
    target = PodTarget("jhub", "jupyter-alice", "notebook")
    assert target.to_wire() == {
        "pod": {"namespace": "jhub", "name": "jupyter-alice", "container": "notebook"}
    }
    assert target.key == "pod:jhub/jupyter-alice/notebook"
    assert str(target) == "pod jhub/jupyter-alice container notebook"


def test_unresolved_container_is_left_out() -> None:
    target = PodTarget("jhub", "jupyter-alice")
    assert target.to_wire() == {"pod": {"namespace": "jhub", "name": "jupyter-alice"}}
    assert target.key == "pod:jhub/jupyter-alice"
    assert target.with_container("nb") == PodTarget("jhub", "jupyter-alice", "nb")


def test_pid_needs_its_start_time_for_a_key() -> None:
    ref = PidRef(1234)
    first = ref.resolve(start_time=100)
    reused = ref.resolve(start_time=900)
    assert first.key == "pid:1234@100"
    assert first.key != reused.key
    assert first.to_wire() == reused.to_wire() == {"pid": 1234}
    assert not hasattr(ref, "key")
    assert PidTarget.from_wire({"pid": 1234}, start_time=100) == first


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PodTarget("Bad", "x"), "namespace"),
        (lambda: PodTarget("ns", "a/b"), "pod name"),
        (lambda: PodTarget("ns", "x", "c.d"), "container"),
        (lambda: PidRef(1), "outside"),
        (lambda: PidRef(PID_MAX_LIMIT), "outside"),
        (lambda: PidTarget(5, -1), "negative"),
    ],
    ids=["namespace", "name", "container", "pid-1", "pid-max", "start-time"],
)
def test_invalid_values_are_refused(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@given(labels, subdomains, st.none() | labels)
def test_pod_key_and_wire_round_trip(namespace: str, name: str, container: str | None) -> None:
    target = PodTarget(namespace, name, container)
    assert target_from_key(target.key) == target
    assert target_from_wire(target.to_wire()) == target


@given(pids, st.integers(min_value=0, max_value=2**63))
def test_pid_key_round_trip(pid: int, start_time: int) -> None:
    target = PidTarget(pid, start_time)
    assert target_from_key(target.key) == target
    assert target_from_wire(target.to_wire()) == PidRef(pid)


@pytest.mark.parametrize(
    "key", ["", "pod:ns", "pod:ns/a/b/c", "pid:12", "pid:12@", "pid:x@1", "node:a", "pod:NS/a"]
)
def test_malformed_keys_are_refused(key: str) -> None:
    with pytest.raises(ValueError):
        target_from_key(key)


def test_dns1123_lengths() -> None:
    assert is_dns1123_label("a" * 63)
    assert not is_dns1123_label("a" * 64)
    assert is_dns1123_subdomain(".".join(["a" * 63] * 3) + "." + "a" * 61)  # 253
    assert not is_dns1123_subdomain(".".join(["a" * 63] * 3) + "." + "a" * 62)  # 254


def test_timestamps_are_rfc3339_utc() -> None:
    moment = datetime(2025, 3, 4, 5, 6, 7, 891000, tzinfo=timezone(timedelta(hours=2)))
    assert format_timestamp(moment) == "2025-03-04T03:06:07Z"
    assert parse_timestamp("2025-03-04T03:06:07Z") == moment.replace(microsecond=0)
    assert parse_timestamp("2025-03-04T05:06:07.5+02:00").tzinfo == UTC


def test_naive_timestamps_are_refused() -> None:
    with pytest.raises(ValueError, match="timezone"):
        format_timestamp(datetime(2025, 1, 1))
    with pytest.raises(ValueError, match="timezone"):
        parse_timestamp("2025-01-01T00:00:00")
