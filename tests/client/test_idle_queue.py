"""The client's calls for issue 11: the idle policy's notices and releases, the wait queue.

Both client flavours against the stub agent, whose answers are checked against openapi.json.
"""

from __future__ import annotations

import datetime as dt

from jupyter_gpu_hotplug._structs import Attachment as AttachmentWire
from jupyter_gpu_hotplug._structs import AttachmentList, PidRef
from jupyter_gpu_hotplug.client import IdleNotice, IdleRelease, LostHolderNotice, QueuedRequest
from jupyter_gpu_hotplug.server.models import attachment_json

from . import samples
from .conftest import Api
from .stub_agent import StubAgent, check_attach_request

MOMENT = dt.datetime(2026, 11, 24, 1, 2, 3, tzinfo=dt.UTC)


async def test_attachment_with_an_idle_notice(api: Api, stub: StubAgent) -> None:
    wire = AttachmentWire(**samples.ATTACHMENTS["attachments"][0])
    wire["idle_release"] = {"reason": "idle", "release_at": "2026-11-24T01:02:03Z"}
    stub.respond("GET", "/v1/attachments", 200, AttachmentList(attachments=[wire]))

    (attachment,) = await api("attachments")

    assert attachment.idle_release == IdleNotice("idle", MOMENT)
    plain = AttachmentWire(**samples.ATTACHMENTS["attachments"][0])
    stub.respond("GET", "/v1/attachments", 200, AttachmentList(attachments=[plain]))
    assert (await api("attachments"))[0].idle_release is None


async def test_idle_releases(api: Api, stub: StubAgent) -> None:
    stub.respond(
        "GET",
        "/v1/idle-releases",
        200,
        {
            "releases": [
                {
                    "uuid": samples.UUID_B,
                    "target": {"pid": 4242},
                    "reason": "lease",
                    "released_at": "2026-11-24T01:02:03Z",
                }
            ]
        },
    )

    releases = await api("idle_releases", PidRef(4242))

    assert releases == (IdleRelease(samples.UUID_B, PidRef(4242), "lease", MOMENT),)
    (request,) = stub.requests
    assert (request.path, request.query) == ("/v1/idle-releases", {"pid": "4242"})


async def test_queue_and_cancel(api: Api, stub: StubAgent) -> None:
    stub.respond(
        "GET",
        "/v1/queue",
        200,
        {
            "length": 3,
            "requests": [
                {
                    "request_id": "abc.1",
                    "target": {"pid": 4242},
                    "count": 1,
                    "position": 2,
                    "queued_at": "2026-11-24T01:02:03Z",
                }
            ],
        },
    )
    stub.respond("DELETE", "/v1/queue/{request_id}", 204)

    waiting = await api("queued")
    await api("cancel_queued", "abc.1")

    assert waiting == (QueuedRequest("abc.1", PidRef(4242), 1, 2, 3, MOMENT),)
    listed, cancelled = stub.requests
    assert (listed.method, listed.path) == ("GET", "/v1/queue")
    assert (cancelled.method, cancelled.path) == ("DELETE", "/v1/queue/abc.1")


async def test_attach_a_slice_with_an_idle_period(api: Api, stub: StubAgent) -> None:
    stub.respond("POST", "/v1/attachments", 201, samples.LOCAL_ATTACHMENTS)

    await api("attach", 1, mig="1g.10gb", idle_release_seconds=600, request_id="r.1")

    (request,) = stub.requests
    body = request.json()
    assert body == {
        "count": 1,
        "request_id": "r.1",
        "mig": "1g.10gb",
        "idle_release_seconds": 600,
    }
    check_attach_request(body)


async def test_attachment_with_a_lost_holder_notice(api: Api, stub: StubAgent) -> None:
    """Issue 21: the agent's announcement of a lost holder's revoke reaches the notebook side,
    and the server extension passes it on to the lab (``attachment_json``)."""
    wire = AttachmentWire(**samples.ATTACHMENTS["attachments"][0])
    wire["holder_lost"] = {
        "reason": "its holder pod was deleted",
        "revoke_at": "2026-11-24T01:02:03Z",
    }
    stub.respond("GET", "/v1/attachments", 200, AttachmentList(attachments=[wire]))

    (attachment,) = await api("attachments")

    assert attachment.holder_lost == LostHolderNotice("its holder pod was deleted", MOMENT)
    assert attachment_json(attachment)["holder_lost"] == wire["holder_lost"]
    plain = AttachmentWire(**samples.ATTACHMENTS["attachments"][0])
    stub.respond("GET", "/v1/attachments", 200, AttachmentList(attachments=[plain]))
    (attachment,) = await api("attachments")
    assert attachment.holder_lost is None and "holder_lost" not in attachment_json(attachment)
