"""The REST API end to end: a real jupyter_server with the extension, a real local agent
subprocess with simulated GPUs, and (as root) probe sandboxes standing in for kernels.

Kernels are mapped to probe sandboxes through the ``kernel_sandboxes_class`` seam
(``RegisteredSandboxes``), so attach really injects a GPU into a running sandbox and the probe
reports what the process inside sees: the node exists and opening it gives ``ENXIO`` (the
cgroup allows it, no driver is behind it) after an attach; ``ENOENT`` after a detach.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_server.serverapp import ServerApp
from traitlets.config import Config

from jupyter_gpu_hotplug._structs import PID_MAX_LIMIT, PidRef
from jupyter_gpu_hotplug.nvml import sim
from jupyter_gpu_hotplug.nvml.sim import SimulatedProcess
from jupyter_gpu_hotplug.server.errors import HotplugError, KernelNotFound
from jupyter_gpu_hotplug.server.kernel_sandboxes import ProvisionerSandboxes
from tests.agent.test_e2e_suspend import CHECKPOINT_DIR_ENV, MEMORY_BYTES, TARGET
from tests.fixtures.agent import LocalAgent, LocalAgentFactory
from tests.fixtures.host_state import process_running, process_start_time
from tests.fixtures.nvml import FakeNvml
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory, SandboxProbe
from tests.fixtures.waiting import eventually

from .api_support import (
    BrokenClient,
    Fetch,
    NoAgent,
    call,
    local_mode,
    raw_exchange,
    sandboxes_of,
    upload,
)

# Starts real servers or toolchains: left out of the fast default run (conftest.py).
pytestmark = pytest.mark.slow

GPU0 = "/dev/nvidia0"
GPU_B = b"GPU-00000001-0000-4000-8000-000000000000"
"""A well-formed GPU UUID, for bodies refused before the agent is asked."""


@pytest.fixture
def jp_server_config(jp_server_config: Config, agent_url: str, token_path: Path | None) -> Config:
    return local_mode(
        jp_server_config, agent_url=agent_url, token_path=token_path, metrics_interval=0.1
    )


@pytest.fixture
def kernel(jp_serverapp: ServerApp, sandbox: SandboxProbe) -> str:
    """A kernel id mapped to a probe sandbox."""
    return sandboxes_of(jp_serverapp).register("kernel-a", sandbox.pid)


# --- without root: the node view and every error the agent or the input can cause -------------


@pytest.mark.parametrize("jp_base_url", ["/", "/user/al%20ice/"])
async def test_node_view_without_a_kernel(
    jp_fetch: Fetch, local_agent: LocalAgent, jp_base_url: str
) -> None:
    reply = await call(jp_fetch, "GET", "gpus")

    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    view = reply.json()
    assert (view["mode"], view["kernel_id"], view["attached"]) == ("local", None, [])
    assert (view["free"], view["total"], view["simulated"]) == (2, 2, True)
    assert set(view["nvml"]) == {"status", "message", "driver_version", "cuda_driver_version"}
    assert view["suspended"] is None


async def test_the_history_is_the_servers_and_reaches_an_hour_back(
    jp_fetch: Fetch, local_agent: LocalAgent, server_nvml: FakeNvml
) -> None:
    """Issue 36: each page kept its own five minutes (a reload emptied the charts, two
    notebooks showed different histories). The server keeps the node's readings of the last
    hour, one per reading it takes (at most two a second), for every page alike."""
    linked, unlinked = local_agent.gpus()
    local_agent.update_gpu(linked.uuid, nvlinks=18, nvlink_tx=10**6, nvlink_rx=10**6)
    for utilization in (11, 22):
        for gpu in local_agent.gpus():
            local_agent.update_gpu(gpu.uuid, utilization_gpu=utilization, pcie_rx=utilization)
        assert (await call(jp_fetch, "GET", "gpus")).status == 200
        await asyncio.sleep(0.6)

    reply = await call(jp_fetch, "GET", "history")

    assert reply.status == 200
    history = reply.json()
    assert history["seconds"] == 3600
    assert history["columns"] == [
        "taken_at",
        "utilization_gpu",
        "utilization_memory",
        "memory_used",
        "memory_total",
        "pcie_tx",
        "pcie_rx",
        "nvlink_tx",
        "nvlink_rx",
    ]
    assert set(history["gpus"]) == {gpu.uuid for gpu in local_agent.gpus()}
    for readings in history["gpus"].values():
        assert [reading[1] for reading in readings] == [11, 22]
        assert [reading[6] for reading in readings] == [11 * 1024, 22 * 1024]  # bytes/s
        assert readings[0][0] < readings[1][0]
    # NVLink: a rate from the second reading on where the GPU has links; none where not.
    assert history["gpus"][linked.uuid][1][7] > 0
    assert [reading[7:] for reading in history["gpus"][unlinked.uuid]] == [[None, None]] * 2


BAD_INPUT = [
    pytest.param("attach", b"", "body", "is empty", id="attach-empty"),
    pytest.param("attach", b"{", "body", "not valid JSON", id="attach-not-json"),
    pytest.param("attach", b"[1]", "body", "must be a JSON object", id="attach-array"),
    pytest.param("attach", b"{}", "count", "count is required", id="count-missing"),
    pytest.param("attach", b'{"count": 0}', "count", "from 1 to 8", id="count-zero"),
    pytest.param("attach", b'{"count": 9}', "count", "from 1 to 8", id="count-too-large"),
    pytest.param("attach", b'{"count": true}', "count", "whole number", id="count-bool"),
    pytest.param("attach", b'{"count": 1.5}', "count", "whole number", id="count-float"),
    pytest.param("attach", b'{"count": "1"}', "count", "whole number", id="count-string"),
    pytest.param("attach", b'{"count": 1, "cnt": 2}', "cnt", "unknown member", id="unknown"),
    pytest.param(
        "attach", b'{"count": 1, "wait_seconds": 0}', "wait_seconds", "greater than 0", id="w0"
    ),
    pytest.param(
        "attach", b'{"count": 1, "wait_seconds": 601}', "wait_seconds", "at most 600", id="w601"
    ),
    pytest.param("attach", b'{"count": 1, "request_id": "a b"}', "request_id", "letters", id="rid"),
    pytest.param(
        "attach", b'{"count": 1, "kernel_id": "../x"}', "kernel_id", "kernel's id", id="kid"
    ),
    pytest.param("attach", b'{"count": 1}', "kernel_id", "name the kernel", id="no-kernel"),
    pytest.param("attach", b'{"count": 1, "gpus": []}', "gpus", "non-empty array", id="gpus-empty"),
    pytest.param(
        "attach", b'{"count": 2, "gpus": ["%s"]}' % GPU_B, "gpus", "count is 2", id="gpus-count"
    ),
    pytest.param("attach", b'{"count": 1, "gpus": [1]}', "gpus[0]", "GPU UUID", id="gpus-index"),
    pytest.param("attach", b'{"count": 1, "model": ""}', "model", "printable", id="model-empty"),
    pytest.param(
        "attach", b'{"count": 1, "min_memory": "40G"}', "min_memory", "bytes", id="memory-text"
    ),
    pytest.param(
        "attach",
        b'{"count": 1, "gpus": ["%s"], "min_memory": 1}' % GPU_B,
        "min_memory",
        "cannot be given with gpus",
        id="memory-with-gpus",
    ),
    pytest.param("detach", b"{}", "uuid", "uuid is required", id="uuid-missing"),
    pytest.param("detach", b'{"uuid": "GPU-1"}', "uuid", "GPU UUID like", id="uuid-bad"),
    pytest.param("detach", b'{"uuid": 7}', "uuid", "GPU UUID like", id="uuid-number"),
    pytest.param(
        "detach", b'{"uuid": "all", "force": "yes"}', "force", "true or false", id="force"
    ),
    pytest.param("detach", b'{"uuid": "all", "keep": 1}', "keep", "true or false", id="keep"),
    pytest.param(
        "detach",
        b'{"uuid": "all", "keep": true, "force": true}',
        "keep",
        "force and keep exclude each other",
        id="keep-force",
    ),
    pytest.param(
        "detach",
        b'{"uuid": "%s", "keep": true}' % GPU_B,
        "keep",
        'give "uuid": "all"',
        id="keep-one-gpu",
    ),
    pytest.param("detach", b'{"uuid": "all", "x": 1}', "x", "unknown member", id="unknown"),
    pytest.param("detach", b'{"uuid": "all"}', "kernel_id", "name the kernel", id="no-kernel"),
    # Regression (issue 9): a 500 (ValueError, RecursionError) or accepted (last key wins).
    *(
        pytest.param(route, raw, "body", words, id=f"{route}-{name}")
        for route in ("attach", "detach")
        for name, raw, words in (
            ("digits", b'{"count": 1' + b"0" * 5000 + b"}", "too many digits"),
            ("deep", b'{"request_id": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
        )
    ),
    pytest.param("attach", b'{"count": 1, "count": 1}', "count", "twice", id="attach-dup"),
    pytest.param("detach", b'{"uuid": "all", "uuid": "x"}', "uuid", "twice", id="detach-dup"),
]


class TestRefusedBeforeAskingTheAgent(NoAgent):
    """Bad input and unknown kernels are answered without the agent: none runs here (it
    would answer 503 if it were asked)."""

    @pytest.mark.parametrize(("route", "body", "field", "words"), BAD_INPUT)
    async def test_bad_input_is_400_naming_the_field(
        self, jp_fetch: Fetch, route: str, body: bytes, field: str, words: str
    ) -> None:
        reply = await call(jp_fetch, "POST", route, raw=body)

        error = reply.error(400, "invalid_request")
        assert (error["field"], error["reason"]) == (field, "Bad Request")
        assert words in error["message"]
        assert "traceback" not in error

    @pytest.mark.parametrize(
        "params",
        [{"kernel": "k"}, {"kernel_id": ""}, {"kernel_id": "a/b"}],
        ids=["unknown-parameter", "empty", "slash"],
    )
    async def test_bad_query_is_400(self, jp_fetch: Fetch, params: dict[str, str]) -> None:
        for route in ("gpus", "stream"):
            reply = await call(jp_fetch, "GET", route, params=params)

            reply.error(400, "invalid_request")

    @pytest.mark.parametrize("route", ["attach", "detach"])
    async def test_oversized_body_is_413_before_it_is_read(
        self, jp_serverapp: ServerApp, http_server: object, jp_http_port: int, route: str
    ) -> None:
        # Regression (issue 9): the server read the whole body (up to 512 MiB) before a 400.
        head = (
            f"POST {jp_serverapp.base_url}gpu-hotplug/api/{route} HTTP/1.1\r\n"
            f"Host: 127.0.0.1\r\nAuthorization: token {jp_serverapp.identity_provider.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {50 * 2**20}\r\n\r\n"
        )
        # Only the headers and a few bytes are sent: the answer must not wait for 50 MB.
        status, body = await raw_exchange(jp_http_port, head.encode() + b'{"count": 1, "x": "')

        assert status == 413
        assert (body["error"], body["field"], body["reason"]) == (
            "invalid_request",
            "body",
            "Request Entity Too Large",
        )

    async def test_a_50_mb_upload_with_urllib_reads_the_413(
        self, jp_serverapp: ServerApp, http_server: object, jp_http_port: int
    ) -> None:
        """Issue 23: an ordinary client sends its whole body before it reads; the server
        answers 413 at the headers, then reads and drops the rest (a lingering close), so the
        client gets the answer, not "connection reset"."""
        url = f"http://127.0.0.1:{jp_http_port}{jp_serverapp.base_url}gpu-hotplug/api/attach"
        token = jp_serverapp.identity_provider.token

        status, body = await asyncio.to_thread(upload, url, 50 * 2**20, f"token {token}")

        assert (status, body["error"], body["field"]) == (413, "invalid_request", "body")

    async def test_oversized_chunked_body_is_413(
        self, jp_serverapp: ServerApp, http_server: object, jp_http_port: int
    ) -> None:
        chunk = b"x" * 4096
        framed = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"0\r\n\r\n"
        head = (
            f"POST {jp_serverapp.base_url}gpu-hotplug/api/attach HTTP/1.1\r\n"
            f"Host: 127.0.0.1\r\nAuthorization: token {jp_serverapp.identity_provider.token}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )

        status, body = await raw_exchange(jp_http_port, head.encode() + framed)

        assert (status, body["error"], body["field"]) == (413, "invalid_request", "body")

    async def test_unregistered_kernel_is_404(self, jp_fetch: Fetch) -> None:
        listed = await call(jp_fetch, "GET", "gpus", params={"kernel_id": "nope"})
        attached = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": "nope"})
        detached = await call(jp_fetch, "POST", "detach", {"uuid": "all", "kernel_id": "nope"})

        for reply in (listed, attached, detached):
            assert reply.error(404, "not_found")["message"] == KernelNotFound("nope").message

    async def test_kernel_without_sandbox_is_422(
        self, jp_fetch: Fetch, jp_serverapp: ServerApp
    ) -> None:
        sandboxes_of(jp_serverapp).register("plain", None)

        reply = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": "plain"})

        assert "does not run in a GPU sandbox" in reply.error(422, "target_not_ready")["message"]


async def test_the_agents_own_errors_keep_its_status_and_words(
    jp_fetch: Fetch, jp_serverapp: ServerApp, local_agent: LocalAgent
) -> None:
    # The test process itself is no container: the agent refuses it with its own 403.
    kernel_id = sandboxes_of(jp_serverapp).register("host", local_agent.pid)

    reply = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel_id})

    assert "is the GPU hot-plug agent itself" in reply.error(403, "forbidden")["message"]


class TestAgentDown(NoAgent):
    async def test_every_operation_is_503_saying_there_is_no_agent(
        self, jp_fetch: Fetch, jp_serverapp: ServerApp
    ) -> None:
        kernel_id = sandboxes_of(jp_serverapp).register("k", 4242)

        replies = [
            await call(jp_fetch, "GET", "gpus"),
            await call(jp_fetch, "GET", "gpus", params={"kernel_id": kernel_id}),
            await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel_id}),
            await call(jp_fetch, "POST", "detach", {"uuid": "all", "kernel_id": kernel_id}),
        ]

        for reply in replies:
            error = reply.error(503, "agent_unavailable")
            assert error["retryable"] is True
            assert error["message"].startswith("No GPU agent on this node")


class TestWrongToken:
    @pytest.fixture
    def token_path(self, tmp_path: Path) -> Path:
        path = tmp_path / "wrong-token"
        path.write_text("not-the-agents-token\n")
        return path

    async def test_agent_401_is_passed_on(self, jp_fetch: Fetch) -> None:
        reply = await call(jp_fetch, "GET", "gpus")

        assert "not this agent's token" in reply.error(401, "unauthenticated")["message"]


class TestUnexpectedFailure:
    @pytest.fixture
    def jp_server_config(self, jp_server_config: Config) -> Config:
        jp_server_config.GPUHotplug.agent_client_class = BrokenClient
        return jp_server_config

    async def test_is_a_json_500_without_details(
        self, jp_fetch: Fetch, caplog: pytest.LogCaptureFixture
    ) -> None:
        reply = await call(jp_fetch, "GET", "gpus")

        assert reply.status == 500
        assert reply.json() == {
            "error": "internal_error",
            "message": "the GPU hot-plug extension failed unexpectedly; the Jupyter server's "
            "log has the details",
            "reason": "Internal Server Error",
            "retryable": False,
        }
        assert "a bug in the client" in caplog.text


def test_provisioner_sandboxes_read_the_kernels_provisioner() -> None:
    class Provisioner:
        def __init__(self, pid: int | None) -> None:
            self.sandbox_pid = pid

    class Kernel:
        def __init__(self, provisioner: object | None) -> None:
            self.provisioner = provisioner

    kernels = {
        "boxed": Kernel(Provisioner(1234)),
        "starting": Kernel(Provisioner(None)),
        "plain": Kernel(object()),
        "down": Kernel(None),
    }

    class KernelManager:
        def get_kernel(self, kernel_id: str) -> Kernel:
            return kernels[kernel_id]

    sandboxes = ProvisionerSandboxes(kernel_manager=KernelManager())

    assert sandboxes.pid_of("boxed") == 1234  # type: ignore[arg-type]
    for kernel_id, code in [
        ("starting", "target_not_ready"),
        ("plain", "target_not_ready"),
        ("down", "target_not_ready"),
        ("missing", "not_found"),
    ]:
        with pytest.raises(HotplugError) as caught:
            sandboxes.pid_of(kernel_id)  # type: ignore[arg-type]
        assert caught.value.code == code, kernel_id


# --- as root: GPUs really attached to sandboxes ------------------------------------------------


@needs_root
async def test_attach_list_detach(
    jp_fetch: Fetch,
    jp_base_url: str,
    local_agent: LocalAgent,
    server_nvml: FakeNvml,
    sandbox: SandboxProbe,
    kernel: str,
) -> None:
    attached = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel})

    assert attached.status == 201
    assert attached.headers["Location"] == f"{jp_base_url}gpu-hotplug/api/gpus?kernel_id={kernel}"
    body = attached.json()
    assert body["kernel_id"] == kernel and len(body["request_id"]) == 32
    (attachment,) = body["attachments"]
    assert (attachment["device"], attachment["target"]) == (GPU0, {"pid": sandbox.pid})
    assert attachment["holder"] is None
    assert sandbox.stat(GPU0).rdev == (195, 0)
    assert sandbox.open(GPU0) == "ENXIO"  # allowed by the cgroup; no driver behind it

    local_agent.update_gpu(attachment["uuid"], utilization_gpu=42, temperature=61)
    listed = await call(jp_fetch, "GET", "gpus", params={"kernel_id": kernel})

    assert listed.status == 200
    view = listed.json()
    assert (view["kernel_id"], view["free"], view["total"]) == (kernel, 1, 2)
    (gpu,) = view["attached"]
    assert {k: v for k, v in gpu.items() if k not in ("metrics", "held_by")} == attachment
    holder = {"kind": "kernel", "name": f"kernel {kernel}", "kernel_id": kernel}
    assert gpu["held_by"] == holder, "named as the user knows it (no session: the kernel)"
    [node_gpu] = [g for g in view["node"] if g["uuid"] == attachment["uuid"]]
    assert (node_gpu["target"], node_gpu["held_by"]) == ({"pid": sandbox.pid}, holder)
    assert [g["held_by"] for g in view["node"] if g["state"] == "free"] == [None]
    assert gpu["metrics"]["utilization_gpu"] == 42
    assert gpu["metrics"]["temperature"] == 61
    assert gpu["metrics"]["lost"] is False
    # The panel charts every GPU of the node: each node GPU carries its metrics too.
    assert node_gpu["metrics"] == gpu["metrics"]
    assert all(g["metrics"] is not None for g in view["node"])
    assert view["queue"] == []
    assert view["nvml"]["status"] == "ok"
    assert view["suspended"] is None, "a kernel that holds its GPUs is not suspended"

    detached = await call(
        jp_fetch, "POST", "detach", {"uuid": attachment["uuid"], "kernel_id": kernel}
    )

    assert (detached.status, detached.body) == (204, b"")
    assert sandbox.stat(GPU0).result == "ENOENT"
    after = await call(jp_fetch, "GET", "gpus", params={"kernel_id": kernel})
    assert (after.json()["attached"], after.json()["free"]) == ([], 2)


@needs_root
async def test_detach_all_and_idempotent_attach(
    jp_fetch: Fetch, sandbox: SandboxProbe, kernel: str
) -> None:
    first = await call(
        jp_fetch, "POST", "attach", {"count": 2, "kernel_id": kernel, "request_id": "r-1"}
    )
    repeated = await call(
        jp_fetch, "POST", "attach", {"count": 2, "kernel_id": kernel, "request_id": "r-1"}
    )

    assert (first.status, repeated.status) == (201, 201)
    assert repeated.json()["attachments"] == first.json()["attachments"]
    assert {"nvidia0", "nvidia1"} <= set(sandbox.listdir("/dev"))

    detached = await call(jp_fetch, "POST", "detach", {"uuid": "all", "kernel_id": kernel})

    assert detached.status == 204
    assert not {"nvidia0", "nvidia1"} & set(sandbox.listdir("/dev"))


@needs_root
async def test_every_reading_says_why_a_gpu_left_its_kernel(
    jp_fetch: Fetch,
    jp_serverapp: ServerApp,
    local_agent: LocalAgent,
    sandbox: SandboxProbe,
    sandbox_factory: SandboxFactory,
    kernel: str,
) -> None:
    """Issue 36, item 3: pages called every GPU they did not detach "released (the kernel
    restarted or the GPU sat unused)", also after ``%gpu detach`` or an operator's CLI
    detach. The readings now carry each loss with the reason the server saw."""

    async def released() -> list[tuple[int, str]]:
        view = (await call(jp_fetch, "GET", "gpus", params={"kernel_id": kernel})).json()
        return [(r["index"], r["reason"]) for r in view["released"]]

    async def attach_one() -> None:
        answer = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel})
        assert answer.status == 201
        assert await released() is not None  # a reading that holds it

    await attach_one()
    # From the kernel's side (the magic) or an operator's CLI: past this server.
    local_agent.client().detach_all(target=PidRef(sandbox.pid))
    assert await released() == [(0, "detached_elsewhere")]

    await attach_one()
    answer = await call(jp_fetch, "POST", "detach", {"uuid": "all", "kernel_id": kernel})
    assert answer.status == 204
    assert (await released())[1:] == [(0, "detached_here")]

    await attach_one()
    sandboxes_of(jp_serverapp).register(kernel, sandbox_factory().pid)  # a restart
    assert (await released())[2:] == [(0, "kernel_restarted")]


@needs_root
async def test_a_gpu_of_another_kernel_cannot_be_detached(
    jp_fetch: Fetch, jp_serverapp: ServerApp, sandbox_factory: SandboxFactory, kernel: str
) -> None:
    other = sandboxes_of(jp_serverapp).register("kernel-b", sandbox_factory().pid)
    attached = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel})
    uuid = attached.json()["attachments"][0]["uuid"]

    reply = await call(jp_fetch, "POST", "detach", {"uuid": uuid, "kernel_id": other})

    message = reply.error(404, "not_found")["message"]
    assert message == f"GPU {uuid} is not attached to kernel {other}"
    still = await call(jp_fetch, "GET", "gpus", params={"kernel_id": kernel})
    assert [gpu["uuid"] for gpu in still.json()["attached"]] == [uuid]


@needs_root
async def test_busy_gpu_is_409_until_forced(
    jp_fetch: Fetch, local_agent: LocalAgent, sandbox: SandboxProbe, kernel: str
) -> None:
    attached = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel})
    uuid = attached.json()["attachments"][0]["uuid"]
    # A process in the sandbox uses the GPU. Without a driver no process can open the node,
    # so NVML's process list (the agent's other witness, filled here through the simulated
    # node) says so.
    worker = sandbox.spawn(["/bin/sleep", "600"])
    started = process_start_time(worker)
    assert started is not None
    local_agent.update_gpu(uuid, processes=(SimulatedProcess(pid=worker, used_memory=None),))

    busy = await call(jp_fetch, "POST", "detach", {"uuid": uuid, "kernel_id": kernel})

    error = busy.error(409, "busy")
    assert error["processes"] == [{"pid": worker, "command": "sleep"}]
    assert sandbox.stat(GPU0).rdev == (195, 0)

    forced = await call(
        jp_fetch, "POST", "detach", {"uuid": uuid, "kernel_id": kernel, "force": True}
    )

    assert forced.status == 204
    assert sandbox.stat(GPU0).result == "ENOENT"
    assert not process_running(worker, started)


@needs_root
async def test_keep_reaches_the_agent_and_a_holder_it_cannot_suspend_keeps_its_gpu(
    jp_fetch: Fetch, local_agent: LocalAgent, sandbox: SandboxProbe, kernel: str
) -> None:
    """``keep`` travels to the agent: a holder with no CUDA context is refused as one that
    cannot be checkpointed (422, not a plain detach's 409 busy), and keeps its GPU."""
    attached = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel})
    uuid = attached.json()["attachments"][0]["uuid"]
    worker = sandbox.spawn(["/bin/sleep", "600"])
    local_agent.update_gpu(uuid, processes=(SimulatedProcess(pid=worker, used_memory=None),))

    kept = await call(
        jp_fetch, "POST", "detach", {"uuid": "all", "kernel_id": kernel, "keep": True}
    )

    kept.error(422, "target_not_ready")
    assert sandbox.stat(GPU0).rdev == (195, 0)
    after = await call(jp_fetch, "GET", "gpus", params={"kernel_id": kernel})
    assert [gpu["uuid"] for gpu in after.json()["attached"]] == [uuid]


@needs_root
async def test_forced_detach_that_ends_the_kernel_itself_releases_the_gpu(
    jp_fetch: Fetch, local_agent: LocalAgent, sandbox: SandboxProbe, kernel: str
) -> None:
    """The kernel process itself uses the GPU: force ends it, and the GPU is still freed."""
    attached = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel})
    uuid = attached.json()["attachments"][0]["uuid"]
    started = process_start_time(sandbox.pid)
    assert started is not None
    local_agent.update_gpu(uuid, processes=(SimulatedProcess(pid=sandbox.pid, used_memory=None),))

    forced = await call(
        jp_fetch, "POST", "detach", {"uuid": uuid, "kernel_id": kernel, "force": True}
    )

    assert forced.status == 204
    assert not process_running(sandbox.pid, started)
    gpus = await call(jp_fetch, "GET", "gpus")
    assert gpus.json()["free"] == gpus.json()["total"]


@needs_root
async def test_a_named_gpu_is_the_one_attached(
    jp_fetch: Fetch,
    jp_serverapp: ServerApp,
    server_nvml: FakeNvml,
    sandbox: SandboxProbe,
    sandbox_factory: SandboxFactory,
    kernel: str,
) -> None:
    # Issue 36 item 6: a GPU card's Attach names its GPU; the second card gets the second GPU.
    view = (await call(jp_fetch, "GET", "gpus", params={"kernel_id": kernel})).json()
    assert all(gpu["selectable"] for gpu in view["node"])
    second = view["node"][1]

    attached = await call(
        jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel, "gpus": [second["uuid"]]}
    )

    assert attached.status == 201
    assert [a["uuid"] for a in attached.json()["attachments"]] == [second["uuid"]]
    assert sandbox.stat(f"/dev/nvidia{second['minor']}").rdev == (195, second["minor"])
    assert sandbox.stat(GPU0).result == "ENOENT"
    # Another kernel naming it hears which GPU is taken and by whom.
    other = sandboxes_of(jp_serverapp).register("kernel-b", sandbox_factory().pid)
    taken = await call(
        jp_fetch, "POST", "attach", {"count": 1, "kernel_id": other, "gpus": [second["uuid"]]}
    )
    error = taken.error(409, "insufficient_gpus")
    assert error["message"].startswith(f"GPU {second['index']} ({second['uuid']}) is attached to")
    unknown = "GPU-deadbeef-0000-4000-8000-000000000000"
    missing = await call(
        jp_fetch, "POST", "attach", {"count": 1, "kernel_id": other, "gpus": [unknown]}
    )
    assert missing.error(404, "not_found")["resource"] == "gpu"


@needs_root
async def test_insufficient_gpus_is_409_with_the_counts(jp_fetch: Fetch, kernel: str) -> None:
    await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel})

    reply = await call(jp_fetch, "POST", "attach", {"count": 2, "kernel_id": kernel})

    error = reply.error(409, "insufficient_gpus")
    assert (error["free"], error["requested"]) == (1, 2)
    assert error["retryable"] is True


@needs_root
async def test_attribution_names_the_kernel_whose_process_uses_the_gpu(
    jp_fetch: Fetch,
    jp_serverapp: ServerApp,
    local_agent: LocalAgent,
    server_nvml: FakeNvml,
    sandbox_factory: SandboxFactory,
    kernel: str,
    sandbox: SandboxProbe,
) -> None:
    """Issue 36: which kernel uses how much of each GPU. A worker below kernel A's sandbox and
    kernel B's sandbox itself are on the GPU with their memory and SM samples; a pid this
    server cannot see is unattributed, a process outside the server only a sum."""
    other = sandboxes_of(jp_serverapp).register("kernel-b", sandbox_factory().pid)
    uuid = local_agent.gpus()[0].uuid
    worker = sandbox.spawn(["/bin/sleep", "600"])
    other_pid = sandboxes_of(jp_serverapp).pid_of(other)
    gib = 2**30
    local_agent.update_gpu(
        uuid,
        processes=(
            SimulatedProcess(worker, 3 * gib, 60),
            SimulatedProcess(other_pid, gib, 10),
            SimulatedProcess(PID_MAX_LIMIT, 2 * gib, 5),
            SimulatedProcess(1, 4 * gib),
        ),
    )

    reply = await call(jp_fetch, "GET", "attribution")

    assert reply.status == 200
    gpu = next(gpu for gpu in reply.json()["gpus"] if gpu["uuid"] == uuid)
    assert gpu["kernels"] == [
        {
            "kernel_id": "kernel-a",
            "notebook": None,
            "memory_bytes": 3 * gib,
            "sm_util_percent": 60,
            "processes": 1,
        },
        {
            "kernel_id": "kernel-b",
            "notebook": None,
            "memory_bytes": gib,
            "sm_util_percent": 10,
            "processes": 1,
        },
    ]
    assert (gpu["unattributed_bytes"], gpu["unattributed_processes"]) == (2 * gib, 1)
    assert (gpu["other_bytes"], gpu["server"]) == (4 * gib, None)
    assert str(PID_MAX_LIMIT) not in reply.body.decode(), "no pid of anyone else is shown"
    view = (await call(jp_fetch, "GET", "gpus", params={"kernel_id": kernel})).json()
    assert [entry["uuid"] for entry in view["attribution"]] == [
        entry["uuid"] for entry in reply.json()["gpus"]
    ], "every reading carries the same attribution"


SIMULATION_INTERVAL = 0.2
"""Seconds between two passes of the suspend tests' agent simulation."""


@needs_root
class TestSuspendedKernel:
    """Issue 39 through the server: a ``keep`` detach of a kernel whose CUDA process (the
    simulated driver's, as in ``tests/agent/test_e2e_suspend.py``) uses its GPU is shown in
    every reading until the next attach resumes it."""

    @pytest.fixture
    def checkpoints(self) -> Iterator[Path]:
        # A short directory: a unix socket's path has room for 107 bytes.
        sockets = Path(tempfile.mkdtemp(prefix="ckpt-"))
        sockets.chmod(0o777)
        yield sockets
        shutil.rmtree(sockets)

    @pytest.fixture
    def local_agent(self, local_agent_factory: LocalAgentFactory, checkpoints: Path) -> LocalAgent:
        """The agent drives the simulated driver's checkpoint calls over ``checkpoints``, and
        its simulation runs (NVML lists a process while it holds its GPU, and no longer once it
        is checkpointed, as the agent checks)."""
        return local_agent_factory(
            env={CHECKPOINT_DIR_ENV: str(checkpoints)},
            simulation_interval=SIMULATION_INTERVAL,
        )

    async def test_the_readings_show_the_suspension_until_the_attach_resumes(
        self,
        jp_fetch: Fetch,
        local_agent: LocalAgent,
        sandbox: SandboxProbe,
        kernel: str,
        checkpoints: Path,
        tmp_path: Path,
    ) -> None:
        attached = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel})
        (attachment,) = attached.json()["attachments"]
        library = sim.ensure_fake_cuda(tmp_path / "cuda") / sim.CUDA_LIBRARY_NAME
        ready = tmp_path / "ready"
        env = [
            f"{CHECKPOINT_DIR_ENV}={checkpoints}",
            f"{sim.CONFIG_ENV}={local_agent.simulation_config}",
        ]
        pid = sandbox.spawn(
            [
                "/usr/bin/env",
                *env,
                sys.executable,
                "-c",
                TARGET,
                str(library),
                str(MEMORY_BYTES),
                str(ready),
            ]
        )
        await eventually(
            lambda: ready.exists() and ready.read_text() != "", "the CUDA process is up"
        )
        assert ready.read_text() == "0", "it holds a context on its GPU"
        await eventually(
            lambda: any(p.pid == pid for gpu in local_agent.gpus() for p in gpu.processes),
            "NVML lists the CUDA process on its GPU (the simulation's next pass)",
        )

        kept = await call(
            jp_fetch, "POST", "detach", {"uuid": "all", "kernel_id": kernel, "keep": True}
        )

        assert kept.status == 204, kept.body
        view = (await call(jp_fetch, "GET", "gpus", params={"kernel_id": kernel})).json()
        assert view["attached"] == []
        assert view["suspended"] == {
            "state": "suspended",
            "model": attachment["name"],
            "uuids": [attachment["uuid"]],
            "pids": [pid],
            "host_memory": MEMORY_BYTES,
        }
        node = (await call(jp_fetch, "GET", "gpus")).json()
        assert node["suspended"] is None, "no kernel named: nobody's suspension"

        resumed = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel})

        assert resumed.status == 201, resumed.body
        view = (await call(jp_fetch, "GET", "gpus", params={"kernel_id": kernel})).json()
        assert [gpu["uuid"] for gpu in view["attached"]] == [attachment["uuid"]]
        assert view["suspended"] is None
