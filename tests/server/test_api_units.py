"""The REST API's pure parts: input parsing, the one error mapping, and the stream machinery."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from tornado import web

from jupyter_gpu_hotplug._structs import GpuUuid
from jupyter_gpu_hotplug.agent.api.validation import parse_attach_request
from jupyter_gpu_hotplug.agent.core.errors import InvalidRequest as AgentInvalidRequest
from jupyter_gpu_hotplug.client import (
    AgentConnectionLost,
    AgentProtocolError,
    AgentUnavailable,
    Busy,
    ClientConfigError,
    InsufficientGpus,
    Unauthenticated,
)
from jupyter_gpu_hotplug.server.errors import (
    GpuNotAttached,
    InvalidInput,
    KernelIdRequired,
    KernelNotFound,
    KernelNotRunning,
    KernelNotSandboxed,
    ShuttingDown,
    error_reply,
    internal_error_reply,
)
from jupyter_gpu_hotplug.server.models import GpusJson, NvmlJson, ProgressJson
from jupyter_gpu_hotplug.server.stream import EventHub, Reading, StreamEvent, Subscription
from jupyter_gpu_hotplug.server.validation import (
    AttachRequest,
    CancelRequest,
    DetachRequest,
    parse_attach,
    parse_cancel,
    parse_detach,
    parse_kernel_query,
)
from tests.fixtures.waiting import eventually

UUID = GpuUuid("GPU-0123abcd-4567-89ef-0123-456789abcdef")

# --- input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"count": 1}', AttachRequest(count=1)),
        (
            b'{"count": 8, "kernel_id": "k-1", "wait_seconds": 30, "request_id": "a:b.c_d-1"}',
            AttachRequest(count=8, kernel_id="k-1", wait_seconds=30.0, request_id="a:b.c_d-1"),  # type: ignore[arg-type]
        ),
        (b'{"count": 2, "kernel_id": null}', AttachRequest(count=2)),
        (b'{"count": 1, "wait_seconds": 0.5}', AttachRequest(count=1, wait_seconds=0.5)),
    ],
)
def test_attach_bodies_accepted(body: bytes, expected: AttachRequest) -> None:
    assert parse_attach(body, max_count=8) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"uuid": "all"}', DetachRequest(uuid=None)),
        (
            f'{{"uuid": "{UUID}", "force": true, "kernel_id": "k"}}'.encode(),
            DetachRequest(uuid=UUID, force=True, kernel_id="k"),  # type: ignore[arg-type]
        ),
        (
            b'{"uuid": "all", "keep": true, "force": false, "kernel_id": "k"}',
            DetachRequest(uuid=None, keep=True, kernel_id="k"),  # type: ignore[arg-type]
        ),
    ],
)
def test_detach_bodies_accepted(body: bytes, expected: DetachRequest) -> None:
    assert parse_detach(body) == expected


def test_count_limit_follows_the_setting() -> None:
    assert parse_attach(b'{"count": 3}', max_count=3).count == 3
    with pytest.raises(InvalidInput, match="from 1 to 2"):
        parse_attach(b'{"count": 3}', max_count=2)


@pytest.mark.parametrize(
    "body",
    [b'{"count": NaN}', b'{"count": 1, "wait_seconds": Infinity}', b'{"count": 1e400}'],
)
def test_non_finite_numbers_are_refused(body: bytes) -> None:
    with pytest.raises(InvalidInput):
        parse_attach(body, max_count=8)


def test_cancel_names_a_request_and_optionally_a_kernel() -> None:
    assert parse_cancel(b'{"request_id": "r-1", "kernel_id": "k"}') == CancelRequest(
        request_id="r-1",  # type: ignore[arg-type]
        kernel_id="k",  # type: ignore[arg-type]
    )
    assert parse_cancel(b'{"request_id": "r-1"}').kernel_id is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{}", "request_id"),
        (b'{"request_id": "a/b"}', "request_id"),
        (b'{"request_id": 7}', "request_id"),
        (b'{"request_id": "r", "kernel_id": "../k"}', "kernel_id"),
        (b'{"request_id": "r", "force": true}', "force"),
    ],
)
def test_bad_cancel_bodies_name_their_field(body: bytes, field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_cancel(body)
    assert caught.value.field == field


def test_oversized_body_is_refused_unparsed() -> None:
    with pytest.raises(InvalidInput, match="the limit is") as caught:
        parse_attach(b" " * 20_000 + b'{"count": 1}', max_count=8)
    assert caught.value.field == "body"


# Regression (issue 9): these gave a ValueError, a RecursionError (both a 500) or were
# accepted (duplicate keys: last wins) before the two APIs shared one body reader.
HOSTILE_BODIES = [
    pytest.param(b'{"count": 1' + b"0" * 5000 + b"}", "body", "too many digits", id="digits"),
    pytest.param(
        b'{"count": 1, "request_id": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
        "body",
        "nested too deeply",
        id="deep",
    ),
    pytest.param(b'{"count": 1, "count": 2}', "count", "appears twice", id="duplicate"),
    pytest.param(b'{"uuid": "all", "uuid": "all"}', "uuid", "appears twice", id="duplicate-2"),
    pytest.param(b'{"count": 1, "x": "\xff"}', "body", "not UTF-8", id="not-utf8"),
    pytest.param(b'{"count": NaN}', "body", "JSON does not allow", id="nan"),
]


@pytest.mark.parametrize(("raw", "field", "message"), HOSTILE_BODIES)
@pytest.mark.parametrize("parse", [parse_attach, parse_detach], ids=["attach", "detach"])
def test_hostile_bodies_are_invalid_input(raw: bytes, field: str, message: str, parse: Any) -> None:
    with pytest.raises(InvalidInput, match=message) as caught:
        parse(raw, max_count=8) if parse is parse_attach else parse(raw)
    assert caught.value.field == field


@pytest.mark.parametrize(("raw", "field", "message"), HOSTILE_BODIES)
def test_both_apis_refuse_a_body_alike(raw: bytes, field: str, message: str) -> None:
    with pytest.raises(InvalidInput) as ours:
        parse_attach(raw, max_count=8)
    with pytest.raises(AgentInvalidRequest) as agents:
        parse_attach_request(raw)
    assert ours.value.field == agents.value.field
    assert agents.value.message.startswith(ours.value.message)  # the agent adds a hint


def test_kernel_query() -> None:
    assert parse_kernel_query({}) is None
    assert parse_kernel_query({"kernel_id": [b"abc-1"]}) == "abc-1"
    with pytest.raises(InvalidInput, match="at most once"):
        parse_kernel_query({"kernel_id": [b"a", b"b"]})
    with pytest.raises(InvalidInput, match="must be text"):
        parse_kernel_query({"kernel_id": [b"\xff"]})


# --- the one error mapping -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "code", "retryable"),
    [
        (InvalidInput("x", field="count"), 400, "invalid_request", False),
        (KernelIdRequired("attach a GPU"), 400, "invalid_request", False),
        (KernelNotFound("k"), 404, "not_found", False),
        (GpuNotAttached(UUID, kernel_id="k"), 404, "not_found", False),
        (KernelNotSandboxed("k"), 422, "target_not_ready", False),
        (KernelNotRunning("k"), 422, "target_not_ready", True),
        (ShuttingDown(), 503, "shutting_down", False),
        (AgentUnavailable(agent_url="unix:/x", reason="no socket"), 503, "agent_unavailable", True),
        (
            AgentConnectionLost(
                agent_url="u", operation="o", reason="r", timed_out=True, attempts=3
            ),
            504,
            "agent_timeout",
            True,
        ),
        (
            AgentConnectionLost(
                agent_url="u", operation="o", reason="r", timed_out=False, attempts=1
            ),
            502,
            "agent_connection_lost",
            True,
        ),
        (
            AgentProtocolError(agent_url="u", operation="o", detail="d"),
            502,
            "agent_protocol_error",
            False,
        ),
        (ClientConfigError("bad URL"), 500, "server_misconfigured", False),
        (
            Unauthenticated("who?", status=401, code="unauthenticated"),
            401,
            "unauthenticated",
            False,
        ),
    ],
)
def test_error_statuses_and_codes(
    error: Exception, status: int, code: str, retryable: bool
) -> None:
    reply = error_reply(error)

    assert reply is not None
    assert (reply.status, reply.body["error"], reply.body["retryable"]) == (status, code, retryable)
    assert isinstance(reply.body["message"], str) and reply.body["message"]
    assert isinstance(reply.body["reason"], str) and reply.body["reason"]
    json.dumps(reply.body)  # every body is JSON


def test_agent_errors_keep_the_agents_words_and_extras() -> None:
    error = InsufficientGpus(
        "only 1 GPU is free, 2 requested",
        status=409,
        code="insufficient_gpus",
        retryable=True,
        extra={"free": 1, "requested": 2, "message": "an extra may not replace the envelope"},
    )

    reply = error_reply(error)

    assert reply is not None
    assert reply.status == 409
    assert reply.body == {
        "error": "insufficient_gpus",
        "message": "only 1 GPU is free, 2 requested",
        "reason": "Conflict",
        "retryable": True,
        "free": 1,
        "requested": 2,
    }


def test_busy_lists_the_processes() -> None:
    error = Busy(
        "in use",
        status=409,
        code="busy",
        extra={"uuid": UUID, "processes": [{"pid": 7, "command": "python"}]},
    )

    reply = error_reply(error)

    assert reply is not None
    assert reply.body["processes"] == [{"pid": 7, "command": "python"}]


@pytest.mark.parametrize(
    "error", [RuntimeError("a bug"), web.HTTPError(403), KeyError("x")], ids=str
)
def test_other_exceptions_are_not_ours_to_describe(error: Exception) -> None:
    assert error_reply(error) is None


def test_a_bug_is_described_without_details() -> None:
    reply = internal_error_reply()

    assert (reply.status, reply.body["error"], reply.body["retryable"]) == (
        500,
        "internal_error",
        False,
    )
    assert "log" in str(reply.body["message"])


# --- the stream machinery ------------------------------------------------------------------------


def test_events_are_one_json_line_each() -> None:
    event = StreamEvent("error", {"message": "two\nlines"})

    assert event.encode() == b'event: error\ndata: {"message":"two\\nlines"}\n\n'


def _progress(request_id: str, state: str) -> ProgressJson:
    return ProgressJson(
        request_id=request_id,
        kernel_id=None,
        state=state,  # type: ignore[typeddict-item]
        count=1,
        elapsed=0.0,
    )


def _view(key: str | None) -> GpusJson:
    return GpusJson(
        mode="local",
        kernel_id=key,
        attached=[],
        free=0,
        total=0,
        node=[],
        queue=[],
        max_count=8,
        simulated=False,
        nvml=NvmlJson(status="no_gpu", message="", driver_version=None, cuda_driver_version=None),
        taken_at=0.0,
        released=[],
        attribution=[],
        suspended=None,
    )


class CountingReader:
    """The hub's ``read``: answers every key at once and records what each poll asked."""

    def __init__(self) -> None:
        self.asked: list[frozenset[str | None]] = []
        self.fail: dict[str | None, BaseException] = {}

    async def __call__(self, keys: frozenset[str | None]) -> Reading:
        self.asked.append(keys)
        return {key: self.fail.get(key) or _view(key) for key in keys}


async def test_one_poll_feeds_every_stream_and_stops_with_the_last() -> None:
    reader = CountingReader()
    hub = EventHub(read=reader, interval=0.01)
    streams = [Subscription(key=key, scope=key) for key in ("k1", "k1", "k1", "k2", None)]
    for subscription in streams:
        hub.add(subscription)

    for subscription in streams:
        event = await subscription.next()
        assert event is not None and event.kind == "metrics"
        assert event.data["kernel_id"] == subscription.key
    await eventually(lambda: len(reader.asked) >= 5, "five polls")

    assert set(reader.asked) == {frozenset({"k1", "k2", None})}  # one read of all, each time
    assert hub.polling
    for subscription in streams:
        hub.remove(subscription)
    assert not hub.polling
    polls = len(reader.asked)
    await asyncio.sleep(0.05)
    assert len(reader.asked) == polls  # nobody listens: nothing is read


async def test_a_slow_stream_gets_the_latest_reading_not_a_backlog() -> None:
    reader = CountingReader()
    hub = EventHub(read=reader, interval=0.001)
    slow = Subscription(key="k", scope="k")
    hub.add(slow)
    await eventually(lambda: len(reader.asked) >= 20, "twenty polls while nobody reads")

    assert (await slow.next()) is not None
    hub.remove(slow)
    assert await slow.next() is None  # at most one reading was held


class SilentReader(CountingReader):
    """A reader whose agent stopped answering (SIGSTOP keeps its socket): every read
    waits until ``answer`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def __call__(self, keys: frozenset[str | None]) -> Reading:
        await self.answer.wait()
        return await super().__call__(keys)


async def test_a_silent_agent_is_reported_while_its_reading_waits() -> None:
    """Issue 36, item 2: a hung agent looked healthy, its last reading shown as live for the
    ~90 s of the client's timeouts. The streams now hear ``agent_timeout`` (504, what the
    views show as disconnected) after ``silent_after``, again each interval, and the
    reading, once it comes, as usual; the agent is not asked again meanwhile."""
    reader = SilentReader()
    hub = EventHub(read=reader, interval=0.01, silent_after=0.05)
    stream = Subscription(key="k", scope="k")
    hub.add(stream)

    first, second = await stream.next(), await stream.next()
    for event in (first, second):
        assert event is not None and event.kind == "error"
        assert (event.data["status"], event.data["error"]) == (504, "agent_timeout")
        assert event.data["retryable"] is True
        assert "has not answered for" in str(event.data["message"])
    assert reader.asked == []

    reader.answer.set()
    while (event := await stream.next()) is not None and event.kind == "error":
        pass
    assert event is not None and event.kind == "metrics"
    hub.remove(stream)


def test_the_default_silence_is_three_intervals_and_at_least_five_seconds() -> None:
    async def never(keys: frozenset[str | None]) -> Reading:
        raise AssertionError("not read")

    assert EventHub(read=never, interval=1.0)._silent_after == 5.0
    assert EventHub(read=never, interval=4.0)._silent_after == 12.0


async def test_errors_are_events_and_a_gone_kernel_ends_its_stream_only() -> None:
    reader = CountingReader()
    reader.fail["gone"] = KernelNotFound("gone")
    hub = EventHub(read=reader, interval=0.01, ends_stream=(KernelNotFound,))
    gone, alive = Subscription(key="gone", scope="gone"), Subscription(key="k", scope="k")
    hub.add(gone)
    hub.add(alive)

    error = await gone.next()
    assert error is not None and error.kind == "error"
    assert (error.data["status"], error.data["error"]) == (404, "not_found")
    assert await gone.next() is None
    first, second = await alive.next(), await alive.next()
    assert first is not None and second is not None and second.kind == "metrics"
    hub.remove(gone)
    await hub.close(timeout=0)
    assert not hub.polling


async def _drain(hub: EventHub, subscription: Subscription) -> list[str]:
    """Read like the stream handler does; the states of the progress events seen."""
    states = []
    while (event := await subscription.next()) is not None:
        if event.kind == "progress":
            states.append(str(event.data["state"]))
    hub.remove(subscription)
    return states


async def test_hub_routes_progress_by_scope_and_replays_what_is_in_flight() -> None:
    hub = EventHub(read=CountingReader(), interval=3600)
    mine, theirs, everyone = (Subscription(key=None, scope=scope) for scope in ("k1", "k2", None))
    for subscription in (mine, theirs, everyone):
        hub.add(subscription)

    hub.publish(_progress("r1", "started"), scope="k1")
    late = Subscription(key=None, scope="k1")
    hub.add(late)
    hub.publish(_progress("r1", "attached"), scope="k1")
    after = Subscription(key=None, scope=None)
    hub.add(after)
    readers = [asyncio.create_task(_drain(hub, s)) for s in (mine, theirs, everyone, late, after)]

    await hub.close(timeout=60)

    assert hub.subscriptions == frozenset()
    assert [await reader for reader in readers] == [
        ["started", "attached"],
        [],
        ["started", "attached"],
        ["started", "attached"],
        [],  # a finished attach is not replayed
    ]
