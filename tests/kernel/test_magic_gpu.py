"""``%gpu attach|detach|status|list|monitor``: parsing, output and errors, in a real IPython shell.

Most tests give the magic a fake agent client (``FakeAgent``) and read what it prints; the last
ones talk to a real local-mode agent process. From the test process an attach is refused (pytest
is no container: the agent will not grant a GPU to a root-cgroup process) — which is itself the
friendly-error path. Attaching for real, to a kernel in a sandbox, is ``test_kernel_e2e``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from jupyter_gpu_hotplug._structs import (
    NVIDIA_MAJOR,
    PID_MAX_LIMIT,
    SANDBOX_PID_ENV,
    GpuUuid,
    PidRef,
)
from jupyter_gpu_hotplug.client import (
    AgentClient,
    AgentUnavailable,
    Attachment,
    AttachmentState,
    Busy,
    Gpu,
    IdleNotice,
    IdleRelease,
    InsufficientGpus,
    InvalidRequest,
    QueuedRequest,
    Suspension,
    TargetNotReady,
)
from jupyter_gpu_hotplug.kernel.cuda import CudaState
from jupyter_gpu_hotplug.kernel.holders import HolderNames
from jupyter_gpu_hotplug.kernel.magic import (
    GpuCommandError,
    GPUMagics,
    MagicContext,
    holds_device,
    parse_line,
)
from jupyter_gpu_hotplug.kernel.progress import TerminalProgress
from jupyter_gpu_hotplug.linux.busy import holders_by_device
from jupyter_gpu_hotplug.linux.devrules import CharDevice
from jupyter_gpu_hotplug.nvml.sim import SimulatedProcess
from jupyter_gpu_hotplug.nvml.state import GpuMonitor
from tests.fixtures.agent import LocalAgent
from tests.fixtures.nvml import FakeNvml, add_gpu_node
from tests.fixtures.requirements import needs_root

from .samples import STARTED, attachment, node_gpu

UUID_A = "GPU-a4bd620b-df27-5b18-a4aa-19cb70a40624"
UUID_B = "GPU-0661fecd-d4d8-5592-9b31-d7fa74e84f1a"
UUID_C = "GPU-a4bd0000-0000-4000-8000-000000000000"
WAIT_S = 30.0
"""Upper bound for a thread to reach a point on a loaded shared machine; never asserted."""


class FakeAgent:
    """Stands in for ``AgentClient``: records calls, answers from ``attached``/``errors``."""

    agent_url = "unix:/fake/agent.sock"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.attached: list[Attachment] = []
        self.node: list[Gpu] = []
        self.released: list[IdleRelease] = []
        self.waiting: list[QueuedRequest] = []
        self.suspended: Suspension | None = None
        """What a kept detach leaves (``detach_all(keep=True)`` sets ``on_keep``)."""
        self.on_keep: Suspension | None = None
        self.errors: dict[str, Exception] = {}
        self.attach_started = threading.Event()
        self.release = threading.Event()
        """Cleared: ``attach`` blocks until it is set."""
        self.release.set()

    def _maybe_fail(self, method: str) -> None:
        if method in self.errors:
            raise self.errors[method]

    def attach(self, count: int = 1, **kwargs: Any) -> tuple[Attachment, ...]:
        call: tuple[Any, ...] = ("attach", count, kwargs.get("wait_seconds"))
        if kwargs.get("mig") is not None:
            call = (*call, kwargs["mig"])
        if kwargs.get("gpus"):
            call = (*call, tuple(kwargs["gpus"]))
        selector = {key: kwargs[key] for key in ("model", "min_memory") if kwargs.get(key)}
        if selector:
            call = (*call, selector)
        self.calls.append(call)
        self.attach_started.set()
        if not self.release.wait(WAIT_S):
            raise AssertionError("the test never released the attach")
        self._maybe_fail("attach")
        new = [attachment(UUID_A, 0)][:count]
        self.attached.extend(new)
        return tuple(new)

    def attachments(self, target: Any = None) -> tuple[Attachment, ...]:
        self.calls.append(("attachments",))
        self._maybe_fail("attachments")
        return tuple(self.attached)

    def attachment_state(self, target: Any = None) -> AttachmentState:
        self.calls.append(("attachment_state",))
        self._maybe_fail("attachments")
        return AttachmentState(tuple(self.attached), self.suspended)

    def queued(self, target: Any = None) -> tuple[QueuedRequest, ...]:
        self.calls.append(("queued",))
        self._maybe_fail("queued")
        return tuple(self.waiting)

    def idle_releases(self, target: Any = None) -> tuple[IdleRelease, ...]:
        self.calls.append(("idle_releases",))
        self._maybe_fail("idle_releases")
        return tuple(self.released)

    def detach(self, uuid: str, *, force: bool = False) -> None:
        self.calls.append(("detach", uuid, force))
        self._maybe_fail("detach")

    def detach_all(self, *, target: Any = None, force: bool = False, keep: bool = False) -> None:
        self.calls.append(("detach_all", force, keep) if keep else ("detach_all", force))
        self._maybe_fail("detach_all")
        if keep:
            self.attached, self.suspended = [], self.on_keep

    def gpus(self) -> tuple[Gpu, ...]:
        self.calls.append(("gpus",))
        self._maybe_fail("gpus")
        return tuple(self.node)


class RecordingProgress:
    """A ``Progress`` that remembers what it was told."""

    def __init__(self, on_update: Callable[[], None] | None = None) -> None:
        self.updates: list[tuple[str, float]] = []
        self.summaries: list[str] = []
        self._on_update = on_update

    def update(self, label: str, elapsed: float) -> None:
        self.updates.append((label, elapsed))
        if self._on_update is not None:
            self._on_update()

    def finish(self, summary: str) -> None:
        self.summaries.append(summary)


@pytest.fixture
def agent() -> Iterator[FakeAgent]:
    fake = FakeAgent()
    yield fake
    fake.release.set()  # never leave a worker thread blocked


@pytest.fixture
def progress() -> list[RecordingProgress]:
    return []


@pytest.fixture
def context(
    ipython_shell: InteractiveShell,
    agent: FakeAgent,
    cuda: list[CudaState],
    progress: list[RecordingProgress],
) -> MagicContext:
    def new_progress() -> RecordingProgress:
        progress.append(RecordingProgress())
        return progress[-1]

    return MagicContext(
        shell=ipython_shell,
        client=lambda: cast(AgentClient, agent),
        cuda=lambda: cuda[-1],
        holders=lambda: HolderNames(environ={"JPY_SESSION_NAME": "/work/mine.ipynb"}),
        progress=new_progress,
    )


@pytest.fixture
def shell(ipython_shell: InteractiveShell, context: MagicContext) -> InteractiveShell:
    ipython_shell.register_magics(GPUMagics(ipython_shell, context=context))
    return ipython_shell


def run(shell: InteractiveShell, line: str, capsys: pytest.CaptureFixture[str]) -> str:
    shell.run_line_magic("gpu", line)
    return capsys.readouterr().out


def run_refused(shell: InteractiveShell, line: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``%gpu line`` as a cell that fails with a friendly message; what the user sees."""
    result = shell.run_cell(f"%gpu {line}")  # type: ignore[no-untyped-call]

    captured = capsys.readouterr()
    shown = captured.out + captured.err
    assert isinstance(result.error_in_exec, GpuCommandError)
    assert "Traceback" not in shown
    return shown


# --- parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "name", "expected"),
    [
        ("attach", "attach", {"count": 1, "wait": None}),
        ("attach 3", "attach", {"count": 3, "wait": None}),
        ("attach 2 --wait 30", "attach", {"count": 2, "wait": 30.0}),
        ("attach --wait=0.5", "attach", {"count": 1, "wait": 0.5}),
        ("attach --wait 600", "attach", {"count": 1, "wait": 600.0}),
        ("attach 1 --mig 1g.10gb", "attach", {"count": 1, "mig": "1g.10gb"}),
        ("attach --mig=1g.10gb+me", "attach", {"count": 1, "mig": "1g.10gb+me"}),
        ("attach 2 --idle 300", "attach", {"count": 2, "idle": 300.0}),
        ("attach --gpu 1", "attach", {"count": 1, "gpu": "1"}),
        ("attach --gpu gpu-A4BD620B", "attach", {"count": 1, "gpu": "GPU-a4bd620b"}),
        ("attach 1 --model H100", "attach", {"model": "H100", "min_memory": None}),
        ("attach --min-memory 40G", "attach", {"model": None, "min_memory": 40 * 10**9}),
        ("attach --min-memory=40GiB", "attach", {"min_memory": 40 * 2**30}),
        ("attach --min-memory 512M", "attach", {"min_memory": 512 * 10**6}),
        ("attach --min-memory 1024", "attach", {"min_memory": 1024}),
        ("detach", "detach", {"gpu": None, "force": False}),
        ("detach all --force", "detach", {"gpu": "all", "force": True}),
        ("detach ALL", "detach", {"gpu": "all", "force": False}),
        (f"detach {UUID_A}", "detach", {"gpu": UUID_A}),
        ("detach gpu-A4BD620B", "detach", {"gpu": "GPU-a4bd620b"}),
        ("detach --force MIG-0abc", "detach", {"gpu": "MIG-0abc", "force": True}),
        ("status", "status", {}),
        ("list", "list", {}),
        ("", "monitor", {"interval": 1.0}),
        ("monitor --interval 2.5", "monitor", {"interval": 2.5}),
        ("--version", "version", {}),
        ("-h", "help", {}),
    ],
)
def test_parsing(line: str, name: str, expected: dict[str, Any]) -> None:
    command, args = parse_line(line)

    assert command.name == name
    assert {key: getattr(args, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("attach 0", "N must be a positive whole number of GPUs (1, 2, ...), got '0'"),
        ("attach -1", "N must be a positive whole number"),
        ("attach two", "got 'two'"),
        ("attach 1.5", "got '1.5'"),
        ("attach \u0661", "N must be a positive whole number"),  # an Arabic-Indic 1
        ("attach 1 2", "unrecognized arguments: 2"),
        ("attach --wait 0", "--wait must be a number of seconds, more than 0 and at most 600"),
        ("attach --wait 601", "at most 600, got '601'"),
        ("attach --wait nan", "got 'nan'"),
        ("attach --wait inf", "got 'inf'"),
        ("attach --wait", "expected one argument"),
        ("attach --mig 1g", "--mig takes a MIG profile such as 1g.10gb"),
        ("attach --mig 9g.10gb", "not '9g.10gb'"),
        ("attach --idle 0", "--idle must be a number of seconds, more than 0"),
        ("attach --gpu all", "--gpu takes a GPU index on the node"),
        ("attach --gpu GPU-zz", "got 'GPU-zz'"),
        ("attach --model ''", "--model must be 1 to 64 printable ASCII characters"),
        (
            "attach --min-memory 40X",
            "--min-memory must be a size such as 80G (10**9 bytes), 40Gi (2**30) or 512M",
        ),
        ("attach --min-memory 0G", '(2**30) or 512M, got "0G"'),
        ("detach foo", "expected 'all', a GPU index on the node (0, 1, ..."),
        ("detach GPU-zz", "got 'GPU-zz'"),
        ("detach all extra", "unrecognized arguments: extra"),
        ("monitor --interval 0", "--interval must be a number of seconds, at least 0.1"),
        ("status extra", "unrecognized arguments: extra"),
        ("list --force", "unrecognized arguments: --force"),
    ],
)
def test_bad_arguments_are_usage_errors(line: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_line(line)

    assert message in str(caught.value)
    assert "Run '%gpu help'" in str(caught.value)


# --- attach -------------------------------------------------------------------------------


def test_attach_says_gpu_ready(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run(shell, "attach", capsys)

    assert agent.calls == [("attachment_state",), ("attach", 1, None)]
    assert out.splitlines()[0] == "Attached 1 GPU to this kernel:"
    assert "  GPU 0  NVIDIA H100 80GB HBM3 (simulated)  /dev/nvidia0  attached at " in out
    assert out.splitlines()[1].endswith(UUID_A)  # the UUID last, for copying (issue 36)
    assert "GPU ready: CUDA has not started in this kernel" in out
    assert "already initialised" not in out


def test_attach_after_cuda_started_says_what_to_do(
    shell: InteractiveShell,
    cuda: list[CudaState],
    capsys: pytest.CaptureFixture[str],
) -> None:
    cuda.append(STARTED)

    out = run(shell, "attach 1 --wait 5", capsys)

    assert "CUDA is already initialised in this kernel (torch has initialised CUDA)" in out
    assert "THIS kernel will not see the new GPU" in out
    assert "!python train.py" in out
    assert "GPU ready" not in out


def test_attach_passes_the_wait(shell: InteractiveShell, agent: FakeAgent) -> None:
    shell.run_line_magic("gpu", "attach --wait 12.5")

    assert agent.calls == [("attachment_state",), ("attach", 1, 12.5)]


def test_attach_a_mig_slice(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_line_magic("gpu", "attach 1 --mig 1g.10gb")

    assert agent.calls == [("attachment_state",), ("attach", 1, None, "1g.10gb")]
    assert "Attached 1 GPU to this kernel" in capsys.readouterr().out


def test_attach_a_named_gpu(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 36 item 6: the node's GPU 1, not any free one.
    agent.node = [node_gpu(UUID_A, 0, state="free"), node_gpu(UUID_B, 1, state="free")]

    shell.run_line_magic("gpu", "attach --gpu 1 --wait 5")

    assert agent.calls == [("gpus",), ("attachment_state",), ("attach", 1, 5.0, (UUID_B,))]
    assert "Attached 1 GPU to this kernel" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--gpu names one GPU: leave N out"):
        shell.run_line_magic("gpu", "attach 2 --gpu 1")


def test_attach_a_named_gpu_that_is_not_there_or_taken(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    agent.node = [node_gpu(UUID_A, 0, state="free"), node_gpu(UUID_C, 1, state="attached")]

    unclear = run_refused(shell, "attach --gpu GPU-a4bd", capsys)
    missing = run_refused(shell, "attach --gpu 7", capsys)
    agent.errors["attach"] = InsufficientGpus(
        f"GPU 1 ({UUID_C}) is attached to another container; name a free GPU",
        status=409,
        code="insufficient_gpus",
        extra={"free": 0, "requested": 1},
    )
    taken = run_refused(shell, "attach --gpu 1", capsys)

    assert "--gpu GPU-a4bd: 2 of the node's GPUs match" in unclear
    assert "--gpu 7: none of the node's GPUs match" in missing
    assert f"  1  {UUID_C}  attached" in missing
    assert f"GPU 1 ({UUID_C}) is attached to another container" in taken
    assert "--wait" not in taken  # the count's advice is not a named GPU's
    assert [call for call in agent.calls if call[0] == "attach"] == [("attach", 1, None, (UUID_C,))]


def test_slow_attach_shows_progress(
    shell: InteractiveShell,
    agent: FakeAgent,
    context: MagicContext,
    progress: list[RecordingProgress],
    capsys: pytest.CaptureFixture[str],
) -> None:
    agent.release.clear()
    shown = RecordingProgress(on_update=agent.release.set)  # the agent answers once shown
    shell.register_magics(
        GPUMagics(
            shell, context=dataclasses.replace(context, progress=lambda: shown, progress_after=0.0)
        )
    )

    out = run(shell, "attach 2 --wait 60", capsys)

    assert shown.updates
    assert shown.updates[0][0] == "Attaching 2 GPUs (waiting up to 60 s)"
    assert len(shown.summaries) == 1
    assert shown.summaries[0].startswith("Attaching 2 GPUs (waiting up to 60 s): done after ")
    assert "Attached 1 GPU" in out
    assert progress == [], "the context's own progress factory was replaced"


def test_a_waiting_attach_shows_its_place_in_the_queue(
    shell: InteractiveShell,
    agent: FakeAgent,
    context: MagicContext,
    capsys: pytest.CaptureFixture[str],
) -> None:
    agent.release.clear()
    agent.waiting = [
        QueuedRequest("r1", PidRef(os.getpid()), 1, 2, 3, datetime(2026, 11, 24, tzinfo=UTC))
    ]
    shown = RecordingProgress(on_update=agent.release.set)
    shell.register_magics(
        GPUMagics(
            shell, context=dataclasses.replace(context, progress=lambda: shown, progress_after=0.0)
        )
    )

    run(shell, "attach --wait 30", capsys)

    assert shown.updates[0][0] == "Attaching 1 GPU (waiting up to 30 s), waiting, position 2 of 3"
    assert ("queued",) in agent.calls


def test_interrupting_the_wait_is_reported_not_raised(
    shell: InteractiveShell, agent: FakeAgent, context: MagicContext
) -> None:
    agent.release.clear()

    def interrupt() -> None:
        raise KeyboardInterrupt

    shown = RecordingProgress(on_update=interrupt)  # Ctrl-C while the line is shown
    shell.register_magics(
        GPUMagics(
            shell, context=dataclasses.replace(context, progress=lambda: shown, progress_after=0.0)
        )
    )

    with pytest.raises(GpuCommandError, match="Interrupted: stopped waiting"):
        shell.run_line_magic("gpu", "attach")
    assert shown.summaries[0].startswith("Attaching 1 GPU: interrupted after")


def test_quick_attach_shows_no_progress(
    shell: InteractiveShell, progress: list[RecordingProgress]
) -> None:
    shell.run_line_magic("gpu", "attach")

    assert progress == []


def test_attach_by_model_and_memory(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_line_magic("gpu", "attach 1 --model H100 --min-memory 40G")

    assert agent.calls == [
        ("attachment_state",),
        ("attach", 1, None, {"model": "H100", "min_memory": 40 * 10**9}),
    ]
    assert "Attached 1 GPU to this kernel" in capsys.readouterr().out


def test_no_matching_gpu_shows_the_agents_reason(shell: InteractiveShell, agent: FakeAgent) -> None:
    """The agent's 409 says what the node has; the magic's own "N free" would be wrong for
    a selector (it counts every GPU), so the agent's words are shown as they are."""
    reason = (
        "no GPU of this node matches model 'A100' (the node has: NVIDIA H100 80GB HBM3 "
        "(79.65 GiB) x2)"
    )
    agent.errors["attach"] = InsufficientGpus(
        reason, status=409, code="insufficient_gpus", extra={"free": 0, "requested": 1}
    )

    with pytest.raises(GpuCommandError) as caught:
        shell.run_line_magic("gpu", "attach --model A100")

    assert caught.value.message == reason
    assert agent.calls == [("attachment_state",), ("attach", 1, None, {"model": "A100"})]


def test_insufficient_gpus_offers_the_wait_and_points_to_list(
    shell: InteractiveShell, agent: FakeAgent
) -> None:
    agent.node = [
        node_gpu(UUID_A, 0, state="attached", pid=os.getpid()),
        node_gpu(UUID_B, 1, state="free"),
    ]
    agent.errors["attach"] = InsufficientGpus(
        "2 GPU(s) requested but 1 free on this node; ask for fewer",
        status=409,
        code="insufficient_gpus",
        extra={"free": 1, "requested": 2},
    )

    with pytest.raises(GpuCommandError) as caught:
        shell.run_line_magic("gpu", "attach 2")

    assert caught.value.message == (
        "2 GPU(s) requested but 1 free on this node; ask for fewer\n"
        "To wait for one in the queue (first come, first served): %gpu attach 2 --wait 120\n"
        "'%gpu list' shows the node's GPUs and who holds them."
    )


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequest(
            "count must be an integer from 1 to 8 (the number of GPUs to attach), got 99; "
            "the request format is described in /v1/openapi.json",
            status=400,
            code="invalid_request",
            extra={"field": "count"},
        ),
        InsufficientGpus(
            "99 GPU(s) requested but 1 free on this node; ask for fewer",
            status=409,
            code="insufficient_gpus",
            extra={"free": 1, "requested": 99},
        ),
    ],
    ids=["over-the-request-limit", "more-than-free"],
)
@pytest.mark.parametrize("count", [3, 99])
def test_asking_for_more_gpus_than_the_node_has_gets_one_friendly_message(
    shell: InteractiveShell, agent: FakeAgent, error: Exception, count: int
) -> None:
    """``%gpu attach 99`` (refused as a bad count) and ``%gpu attach 3`` (not enough free)
    on a 2-GPU node say the same thing, without the agent's API talk (issue 14)."""
    agent.node = [
        node_gpu(UUID_A, 0, state="attached", pid=os.getpid()),
        node_gpu(UUID_B, 1, state="free"),
    ]
    agent.errors["attach"] = error

    with pytest.raises(GpuCommandError) as caught:
        shell.run_line_magic("gpu", f"attach {count}")

    assert caught.value.message == (
        f"Cannot attach {count} GPUs: this node has 2 GPUs in all (1 free now).\n"
        "'%gpu list' shows the node's GPUs and who holds them."
    )
    assert "openapi" not in caught.value.message


def test_gpus_in_mig_mode_do_not_count_for_an_attach_of_a_count_alone(
    shell: InteractiveShell, agent: FakeAgent
) -> None:
    """A GPU in MIG mode and its free slices are listed, but ``%gpu attach 3`` can get only
    whole GPUs: the node has 2 of them, and waiting would not help."""
    agent.node = [
        node_gpu(UUID_A, 0, state="attached", pid=os.getpid()),
        node_gpu(UUID_B, 1, state="free"),
        node_gpu("GPU-00000002-0000-0000-0000-000000000000", 2, state="free", kind="mig_parent"),
        *(
            node_gpu(
                f"MIG-00000002-000{i}-0000-0000-000000000000", 2, state="free", kind="mig_slice"
            )
            for i in (1, 2)
        ),
    ]
    agent.errors["attach"] = InsufficientGpus(
        "that is more than this node's 2 GPU(s) in all",
        status=409,
        code="insufficient_gpus",
        extra={"free": 1, "requested": 3},
    )

    with pytest.raises(GpuCommandError) as caught:
        shell.run_line_magic("gpu", "attach 3")

    assert caught.value.message == (
        "Cannot attach 3 GPUs: this node has 2 GPUs in all (1 free now).\n"
        "'%gpu list' shows the node's GPUs and who holds them."
    )


def test_a_count_over_the_request_limit_on_a_big_node_is_said_plainly(
    shell: InteractiveShell, agent: FakeAgent
) -> None:
    agent.node = [
        node_gpu(f"GPU-{i:08x}-0000-0000-0000-000000000000", i, state="free") for i in range(16)
    ]
    agent.errors["attach"] = InvalidRequest(
        "count must be an integer from 1 to 8 (the number of GPUs to attach), got 10; "
        "the request format is described in /v1/openapi.json",
        status=400,
        code="invalid_request",
        extra={"field": "count"},
    )

    with pytest.raises(GpuCommandError) as caught:
        shell.run_line_magic("gpu", "attach 10")

    assert caught.value.message.startswith(
        "Cannot attach 10 GPUs: that is more than one request may ask for"
    )
    assert "openapi" not in caught.value.message


def test_agent_errors_show_the_message_without_traceback(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    agent.errors["gpus"] = AgentUnavailable(agent_url=agent.agent_url, reason="No such file")

    shown = run_refused(shell, "list", capsys)

    assert "No GPU agent on this node" in shown
    assert "GpuCommandError" not in shown


# --- detach -------------------------------------------------------------------------------


def test_detach_the_only_gpu(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    agent.attached = [attachment(UUID_A, 0)]

    out = run(shell, "detach", capsys)

    assert ("detach", UUID_A, False) in agent.calls
    assert out == "Detached GPU 0 (1 GPU).\n"


def test_detach_with_nothing_attached(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run(shell, "detach all", capsys)

    assert out == "No GPU is attached to this notebook; nothing to detach.\n"
    assert agent.calls == [("attachments",)]


def test_detach_without_argument_when_several_are_attached(
    shell: InteractiveShell, agent: FakeAgent
) -> None:
    agent.attached = [attachment(UUID_A, 0), attachment(UUID_B, 1)]

    with pytest.raises(UsageError, match="2 GPUs are attached; name one") as caught:
        shell.run_line_magic("gpu", "detach")

    assert UUID_A in str(caught.value) and UUID_B in str(caught.value)
    assert [call for call in agent.calls if call[0] == "detach"] == []


def test_detach_by_node_index(shell: InteractiveShell, agent: FakeAgent) -> None:
    # The kernel holds the node's GPUs 1 and 2 (its own CUDA numbers them 0 and 1).
    agent.attached = [attachment(UUID_B, 1), attachment(UUID_C, 2)]

    shell.run_line_magic("gpu", "detach 1")

    assert [call for call in agent.calls if call[0] == "detach"] == [("detach", UUID_B, False)]
    with pytest.raises(UsageError, match="'0' matches none of the GPUs attached"):
        shell.run_line_magic("gpu", "detach 0")


def test_queue_lists_the_places_of_this_notebook(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    idle = run(shell, "queue", capsys)
    assert idle.splitlines()[0] == "Waiting for GPUs: 0 requests of this notebook"
    assert "not waiting for a GPU. '%gpu attach N --wait 120' waits in" in idle
    assert max(len(line) for line in idle.splitlines()) <= 80
    agent.waiting = [
        QueuedRequest("req-1", PidRef(os.getpid()), 1, 2, 3, datetime(2026, 1, 1, tzinfo=UTC))
    ]
    lines = run(shell, "queue", capsys).splitlines()
    assert lines[0] == "Waiting for GPUs: 1 request of this notebook"
    assert lines[2].split()[:4] == ["2", "of", "3", "1"]


def test_detach_by_unique_beginning(shell: InteractiveShell, agent: FakeAgent) -> None:
    agent.attached = [attachment(UUID_A, 0), attachment(UUID_B, 1)]

    shell.run_line_magic("gpu", "detach GPU-0661")

    assert ("detach", UUID_B, False) in agent.calls


@pytest.mark.parametrize(
    ("selector", "matches"), [("GPU-a4bd", "matches 2 of"), ("GPU-ffff", "matches none of")]
)
def test_detach_by_unclear_beginning(
    shell: InteractiveShell, agent: FakeAgent, selector: str, matches: str
) -> None:
    agent.attached = [attachment(UUID_A, 0), attachment(UUID_C, 2)]

    with pytest.raises(UsageError, match=matches):
        shell.run_line_magic("gpu", f"detach {selector}")


def test_detach_unknown_full_uuid_lets_the_agent_decide(
    shell: InteractiveShell, agent: FakeAgent
) -> None:
    shell.run_line_magic("gpu", f"detach {UUID_B}")

    assert ("detach", UUID_B, False) in agent.calls


def test_detach_all(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    agent.attached = [attachment(UUID_A, 0), attachment(UUID_B, 1)]

    out = run(shell, "detach all", capsys)

    assert ("detach_all", False) in agent.calls
    assert out == "Detached GPU 0, GPU 1 (2 GPUs).\n"


KEPT = Suspension(
    state="suspended",
    model="NVIDIA H100 80GB HBM3",
    uuids=(GpuUuid(UUID_A), GpuUuid(UUID_B)),
    pids=(4242,),
    host_memory=3 * 2**30,
)


KEPT_BOTH = (
    "Released GPU 0, GPU 1 (2 GPUs). This kernel is suspended (state kept, 3.0 GiB in host "
    "memory); '%gpu attach' resumes it on 2 free NVIDIA H100 80GB HBM3 GPUs (the same ones when "
    "free).\n"
)
NOTHING_KEPT = (
    "Released GPU 0 (1 GPU). No process of this kernel used it: there was no CUDA state to keep.\n"
)


@pytest.mark.parametrize(
    ("line", "uuids", "kept", "said"),
    [
        ("release --keep", (UUID_A, UUID_B), KEPT, KEPT_BOTH),
        ("detach all --keep", (UUID_A, UUID_B), KEPT, KEPT_BOTH),
        # No process used the GPU: the agent detached it plainly and keeps nothing.
        ("detach --keep", (UUID_A,), None, NOTHING_KEPT),
    ],
    ids=["release", "detach-all", "nothing-to-keep"],
)
def test_release_keep_says_what_was_kept_and_how_it_comes_back(
    shell: InteractiveShell,
    agent: FakeAgent,
    capsys: pytest.CaptureFixture[str],
    line: str,
    uuids: tuple[str, ...],
    kept: Suspension | None,
    said: str,
) -> None:
    agent.attached = [attachment(uuid, index) for index, uuid in enumerate(uuids)]
    agent.on_keep = kept

    out = run(shell, line, capsys)

    assert [call for call in agent.calls if call[0] == "detach_all"] == [
        ("detach_all", False, True)
    ]
    assert out == said


def test_attach_of_a_suspended_kernel_says_it_resumed(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    agent.suspended = dataclasses.replace(KEPT, uuids=(GpuUuid(UUID_A),))

    out = run(shell, "attach 2", capsys)

    assert out.splitlines()[0] == (
        "Resumed this kernel on 1 GPU: the agent restored its CUDA state from host memory (it was "
        "suspended (state kept, 3.0 GiB in host memory); a resume takes GPUs of the suspended "
        "model, whatever the attach asked):"
    )
    assert out.splitlines()[1].split()[:2] == ["GPU", "0"]
    assert "CUDA" not in out.splitlines()[-1], "no advice about new GPUs: these are its own"


def test_release_keep_of_an_unknown_size_and_an_already_suspended_kernel(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    agent.attached = [attachment(UUID_A, 0)]
    agent.on_keep = dataclasses.replace(KEPT, uuids=(GpuUuid(UUID_A),), host_memory=None)

    first = run(shell, "release --keep", capsys)
    again = run(shell, "release --keep", capsys)

    assert (
        "This kernel is suspended (state kept in host memory); '%gpu attach' resumes it on "
        "1 free NVIDIA H100 80GB HBM3 GPU (the same one when free)." in first
    )
    assert again == (
        "No GPU is attached to this notebook; nothing to detach. It is suspended (state kept "
        "in host memory).\n"
    )
    assert [call for call in agent.calls if call[0] == "detach_all"] == [
        ("detach_all", False, True)
    ]


def test_release_without_keep_is_detach_all(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    agent.attached = [attachment(UUID_A, 0)]

    out = run(shell, "release", capsys)

    assert ("detach_all", False) in agent.calls
    assert out == "Detached GPU 0 (1 GPU).\n"


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("release --keep --force", "force and keep exclude each other"),
        ("detach all --force --keep", "force and keep exclude each other"),
        ("detach 0 --keep", "leave the GPU out"),
    ],
)
def test_keep_with_force_or_one_gpu_is_a_usage_error_and_sends_nothing(
    shell: InteractiveShell, agent: FakeAgent, line: str, words: str
) -> None:
    agent.attached = [attachment(UUID_A, 0)]

    with pytest.raises(UsageError, match=words):
        shell.run_line_magic("gpu", line)

    assert agent.calls == []


def test_a_refused_keep_shows_the_agents_words_and_no_force_advice(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    agent.attached = [attachment(UUID_A, 0)]
    agent.errors["detach_all"] = TargetNotReady(
        "the CUDA driver on this node lacks the checkpoint API", status=422, code="target_not_ready"
    )

    shown = run_refused(shell, "release --keep", capsys)

    assert "lacks the checkpoint API" in shown
    assert "--force" not in shown


def test_force_says_what_it_will_do(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    agent.attached = [attachment(UUID_A, 0)]

    out = run(shell, f"detach {UUID_A} --force", capsys)

    assert out.splitlines()[0] == (
        "--force: processes of this kernel's container that use GPU 0 will be stopped "
        "(SIGTERM, then SIGKILL) before the release."
    )
    assert ("detach", UUID_A, True) in agent.calls


def test_busy_gpu_suggests_force(shell: InteractiveShell, agent: FakeAgent) -> None:
    agent.attached = [attachment(UUID_A, 0)]
    agent.errors["detach"] = Busy(
        f"GPU {UUID_A} is in use by process(es) 42 (python); stop them",
        status=409,
        code="busy",
        extra={"processes": [{"pid": 42, "command": "python"}], "uuid": UUID_A},
    )

    with pytest.raises(GpuCommandError) as caught:
        shell.run_line_magic("gpu", "detach")

    assert caught.value.message.splitlines() == [
        "GPU 0 is in use by process(es) 42 (python).",
        "To stop them and detach the GPU: %gpu detach 0 --force",
    ]


def test_holds_device_ignores_other_devices(tmp_path: Path) -> None:
    fds = tmp_path / "fd"
    fds.mkdir()
    (fds / "0").symlink_to("/dev/null")
    (fds / "1").symlink_to(tmp_path / "gone")

    assert not holds_device(0, fd_dir=str(fds))
    assert not holds_device(0, fd_dir=str(tmp_path / "no-such-dir"))


@needs_root
def test_holds_device_sees_an_open_gpu_node(tmp_path: Path) -> None:
    node = tmp_path / "nvidia3"
    os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, 3))
    fds = tmp_path / "fd"
    fds.mkdir()
    (fds / "7").symlink_to(node)  # what /proc/self/fd/7 is while nvidia3 is open

    assert holds_device(3, fd_dir=str(fds))
    assert not holds_device(4, fd_dir=str(fds))


# --- load (issue 36, item 1) -------------------------------------------------------------


@needs_root
def test_load_keeps_the_kernels_gpu_busy_in_the_background(
    ipython_shell: InteractiveShell,
    context: MagicContext,
    dev: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``%gpu load`` returns once a helper in the background holds the GPU's node, as the busy
    scan (the simulation's "in use") sees it. The documented ``!python -m ...load &`` could
    not: ipykernel refuses background processes in ``!`` lines, so the demo's charts stayed
    flat. It returned before the helper opened the node: on a loaded machine a detach right
    after it was not refused."""
    node = add_gpu_node(dev, 3)
    loaded = dataclasses.replace(context, dev=dev)
    ipython_shell.register_magics(GPUMagics(ipython_shell, context=loaded))

    out = run(ipython_shell, "load --seconds 600", capsys)

    [helper] = loaded.background
    try:
        assert f"SIMULATED load: process {helper.pid} uses {node} for 600 s" in out
        gpu = CharDevice(major=NVIDIA_MAJOR, minor=3)
        assert [h.pid for h in holders_by_device([helper.pid], [gpu])[gpu]] == [helper.pid]
    finally:
        helper.terminate()
        helper.wait(timeout=WAIT_S)


def test_load_without_a_gpu_says_attach_first(
    ipython_shell: InteractiveShell,
    context: MagicContext,
    dev: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ipython_shell.register_magics(
        GPUMagics(ipython_shell, context=dataclasses.replace(context, dev=dev))
    )

    shown = run_refused(ipython_shell, "load", capsys)

    assert "no GPU to keep busy; attach one first ('%gpu attach')" in shown


# --- status, list, monitor ----------------------------------------------------------------


def test_status(
    shell: InteractiveShell,
    agent: FakeAgent,
    context: MagicContext,
    fake_nvml: FakeNvml,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    release_at = datetime(2026, 11, 24, 1, 2, 3, tzinfo=UTC)
    agent.attached = [
        dataclasses.replace(attachment(UUID_A, 0), idle_release=IdleNotice("idle", release_at))
    ]
    agent.released = [IdleRelease(GpuUuid(UUID_B), PidRef(os.getpid()), "idle", release_at)]
    shell.register_magics(
        GPUMagics(
            shell,
            context=dataclasses.replace(context, monitor=lambda: GpuMonitor(dev_dir=tmp_path)),
        )
    )

    lines = run(shell, "status", capsys).splitlines()

    local = release_at.astimezone().strftime("%H:%M:%S")
    assert lines[0] == "This notebook: 1 GPU attached (SIMULATED)"
    assert lines[1].split() == ["GPU", "CUDA", "ID", "DEVICE", "UTIL", "MEMORY", "SINCE"]
    assert lines[2].split()[:6] == ["0", "0", UUID_A[:12], "/dev/nvidia0", "0", "%"]
    text = " ".join(lines)
    assert f"! GPU 0: the agent releases it at {local} (unused) unless a process uses it." in text
    assert f"Released by the agent's idle policy: GPU {UUID_B} at {local} (unused)." in text
    assert "This kernel sees (NVML): 2 GPUs, SIMULATED (SIMULATED)." not in lines
    assert "This kernel sees (NVML): 2 GPUs (SIMULATED)." in lines
    assert lines[-1] == "CUDA: not started in this kernel; GPUs you attach now are usable here."
    assert max(len(line) for line in lines) <= 80


def test_status_shows_a_suspended_kernel(
    shell: InteractiveShell,
    agent: FakeAgent,
    context: MagicContext,
    tmp_path: Path,
    fake_nvml: FakeNvml,
    capsys: pytest.CaptureFixture[str],
) -> None:
    agent.suspended = KEPT
    shell.register_magics(
        GPUMagics(
            shell,
            context=dataclasses.replace(context, monitor=lambda: GpuMonitor(dev_dir=tmp_path)),
        )
    )

    lines = run(shell, "status", capsys).splitlines()

    assert lines[0] == "This notebook: 0 GPUs attached (SIMULATED)"
    assert (
        "! This kernel is suspended (state kept, 3.0 GiB in host memory); '%gpu attach' "
        "resumes it on 2 free NVIDIA H100 80GB HBM3 GPUs (the same ones when free)."
        in " ".join(lines)
    )
    assert max(len(line) for line in lines) <= 80


def test_status_without_agent_still_shows_this_kernel(
    shell: InteractiveShell,
    agent: FakeAgent,
    cuda: list[CudaState],
    capsys: pytest.CaptureFixture[str],
) -> None:
    agent.errors["attachments"] = AgentUnavailable(agent_url=agent.agent_url, reason="refused")
    cuda.append(STARTED)

    lines = run(shell, "status", capsys).splitlines()

    assert lines[0].startswith("GPU agent: No GPU agent on this node")
    assert any(line.startswith("This kernel sees (NVML): ") for line in lines)
    assert "CUDA: already initialised in this kernel (torch has" in " ".join(lines)


def test_list(
    shell: InteractiveShell, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    agent.node = [
        node_gpu(UUID_A, 0, state="attached", pid=os.getpid()),
        node_gpu(UUID_B, 1, state="free"),
    ]

    lines = run(shell, "list", capsys).splitlines()

    assert lines[0] == "GPUs on this node (SIMULATED): 1 free of 2"
    assert lines[1].split() == ["GPU", "ID", "MODEL", "MEMORY", "STATE", "HELD", "BY"]
    assert lines[2].split()[:2] == ["0", UUID_A[:12]]
    assert lines[2].endswith("attached  this notebook")
    assert lines[3].endswith("free")
    assert max(len(line) for line in lines) <= 80


def test_bare_magic_outside_a_notebook_prints_the_monitor_as_text(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run(shell, "", capsys)

    assert "This kernel sees (NVML):" in out
    assert out.endswith("(The live monitor needs a notebook; '%gpu' there shows it.)\n")


# --- terminal progress --------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_progress_rewrites_one_line() -> None:
    stream = _Tty()
    progress = TerminalProgress(stream)

    progress.update("Attaching 1 GPU", 1.2)
    progress.update("Attaching 1 GPU", 2.4)
    progress.finish("Attaching 1 GPU: done after 2.5 s")

    assert stream.getvalue() == (
        "\r⠋ Attaching 1 GPU… 1 s\r⠙ Attaching 1 GPU… 2 s\rAttaching 1 GPU: done after 2.5 s\n"
    )


def test_progress_into_a_file_is_one_line() -> None:
    stream = io.StringIO()
    progress = TerminalProgress(stream)

    progress.update("Attaching 1 GPU", 1.0)
    progress.update("Attaching 1 GPU", 2.0)
    progress.finish("Attaching 1 GPU: done after 2.1 s")

    assert stream.getvalue() == "Attaching 1 GPU…\n"


# --- against a real local agent -----------------------------------------------------------


@pytest.fixture
def agent_shell(
    ipython_shell: InteractiveShell, local_agent: LocalAgent, monkeypatch: pytest.MonkeyPatch
) -> InteractiveShell:
    monkeypatch.setenv("GPU_HOTPLUG_AGENT_URL", local_agent.unix_url)
    monkeypatch.delenv("GPU_HOTPLUG_TOKEN_PATH", raising=False)
    ipython_shell.run_line_magic("load_ext", "jupyter_gpu_hotplug")
    return ipython_shell


@pytest.mark.slow  # a real agent subprocess
def test_list_from_a_real_agent(
    agent_shell: InteractiveShell, local_agent: LocalAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = run(agent_shell, "list", capsys).splitlines()

    assert lines[0] == "GPUs on this node (SIMULATED): 2 free of 2"
    listed = {line.split()[1] for line in lines[2:]}
    assert listed == {gpu.uuid[:12] for gpu in local_agent.gpus()}


@pytest.mark.slow  # a real agent subprocess
def test_a_real_agent_refuses_a_process_outside_any_container(
    agent_shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "is not in a container" in run_refused(agent_shell, "attach 1", capsys)


@pytest.mark.slow  # a real agent subprocess
def test_status_from_a_real_agent(
    agent_shell: InteractiveShell, local_agent: LocalAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run(agent_shell, "status", capsys)

    assert out.startswith("GPU agent: ")  # the shell is not in a container: no attachments
    assert "\nThis kernel sees (NVML): " in out
    assert "\nCUDA: " in out


@pytest.fixture
def gpu_users() -> Iterator[tuple[int, int]]:
    """Two processes on a GPU: one below this "kernel" (the test process), one of another
    notebook (its session in its environment, as jupyter_server starts kernels)."""
    mine = subprocess.Popen(["sleep", "600"])
    other = subprocess.Popen(
        ["sleep", "600"], env={**os.environ, "JPY_SESSION_NAME": "/work/team/other.ipynb"}
    )
    try:
        yield mine.pid, other.pid
    finally:
        for process in (mine, other):
            process.kill()
            process.wait()


StatusOf = Callable[..., str]


@pytest.fixture
def status_of(
    shell: InteractiveShell,
    context: MagicContext,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> StatusOf:
    """``%gpu status`` with this test's NVML (and ``changes`` to the context)."""

    def status(**changes: Any) -> str:
        changed = dataclasses.replace(
            context, monitor=lambda: GpuMonitor(dev_dir=tmp_path), **changes
        )
        shell.register_magics(GPUMagics(shell, context=changed))
        return run(shell, "status", capsys)

    return status


def test_status_says_which_notebook_uses_each_gpu(
    status_of: StatusOf, fake_nvml: FakeNvml, gpu_users: tuple[int, int]
) -> None:
    """Issue 36: ``%gpu status`` shows the same attribution as the panel, from this kernel's
    side: its own processes, another notebook's by name, the rest as sums."""
    mine, other = gpu_users
    fake_nvml.update_gpu(
        fake_nvml.gpus[0].uuid,
        processes=(
            SimulatedProcess(mine, 3 * 2**30, 40),
            SimulatedProcess(other, 2**30, 10),
            SimulatedProcess(PID_MAX_LIMIT, 2 * 2**30),
        ),
    )
    lines = status_of().splitlines()

    at = lines.index("GPU use by notebook")
    assert lines[at + 1].split() == ["CUDA", "ID", "WHO", "MEMORY", "SM"]
    rows = [line.split(None, 2)[2] for line in lines[at + 2 : at + 5]]
    assert [row.rsplit(None, 4)[0] for row in rows] == [
        "this notebook",
        "team/other.ipynb",
        "unattributed",
    ]
    assert rows[0].split()[-4:] == ["3.0", "GiB", "40", "%"]
    assert str(PID_MAX_LIMIT) not in "\n".join(lines), "no pid it cannot see is shown"
    assert "Unattributed: NVML named processes by pids this kernel cannot see" in " ".join(lines)


def test_status_in_a_sandbox_names_no_process(
    status_of: StatusOf, fake_nvml: FakeNvml, gpu_users: tuple[int, int]
) -> None:
    """In a sandbox of its own NVML's pids are the host's: a pid that happens to exist here
    is another process, so nothing is named (the panel does it, from the server)."""
    mine, _ = gpu_users
    fake_nvml.update_gpu(fake_nvml.gpus[0].uuid, processes=(SimulatedProcess(mine, 2**30),))
    text = status_of(environ={SANDBOX_PID_ENV: "4242"})

    assert "this notebook" not in text.split("GPU use by notebook")[1].split("\n")[2]
    assert "unattributed" in text
    assert "own pid namespace" in text
