"""Local mode end to end: a detach that keeps the kernel's CUDA state, and the attach that
resumes it (issue 39), with the real agent, real sandboxes and the fake CUDA driver (root).

A sandbox is the kernel's container; inside it a CUDA process (``fakeCudaHoldContext`` of the
fake ``libcuda.so.1``) holds its GPU's node as a context does and answers the driver's
checkpoint calls. The agent (``--simulate``) drives them through ``nvml.checkpoint`` over the
same library. What counts is what the processes can do afterwards: whether the CUDA process is
alive and in which checkpoint state the driver says it is (asked by this test through the same
library), which GPU node it holds (its ``/proc/<pid>/fd``), and what the sandboxes can open
(ENXIO: allowed, EPERM: denied, ENOENT: no node).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
from IPython.core.error import UsageError

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.agent.core.checkpoints import SUSPEND_STEPS, marker_path
from jupyter_gpu_hotplug.agent.core.keep_budget import node_memory
from jupyter_gpu_hotplug.agent.local.ledger import Ledger
from jupyter_gpu_hotplug.agent.local.simulate import CONFIG_NAME
from jupyter_gpu_hotplug.agent.settings import TcpAddress
from jupyter_gpu_hotplug.cli import main
from jupyter_gpu_hotplug.kernel.magic import run_line
from jupyter_gpu_hotplug.nvml import sim
from jupyter_gpu_hotplug.nvml.checkpoint import CudaCheckpoint, ProcessState
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory, SandboxProbe

from .agent_process import REPLY_TIMEOUT, AgentProcess
from .api_harness import ApiClient, Response
from .test_e2e_idle_queue import opens, poll

pytestmark = [*needs_root, pytest.mark.slow]

ROOT: Final = Path(__file__).parents[2]
GPUS: Final = 2
MEMORY_BYTES: Final = 5 * 2**20
CHECKPOINT_DIR_ENV: Final = "FAKE_CUDA_CHECKPOINT_DIR"
FAIL_ENV: Final = "FAKE_CUDA_CHECKPOINT_FAIL"

TARGET: Final = """
import ctypes, pathlib, sys, threading
cuda = ctypes.CDLL(sys.argv[1])
result = cuda.cuInit(0)
if result == 0:
    result = cuda.fakeCudaHoldContext(0, ctypes.c_ulonglong(int(sys.argv[2])))
pathlib.Path(sys.argv[3]).write_text(str(result))
threading.Event().wait()
"""
"""A CUDA process on the sandbox's one GPU (ordinal 0) with ``argv[2]`` bytes; writes the
result of taking its context to ``argv[3]`` (the probe's stdout is its protocol's) and waits."""

HOLDER: Final = """
import os, pathlib, sys, threading
fd = os.open(sys.argv[1], os.O_PATH)
pathlib.Path(sys.argv[2]).write_text("0")
threading.Event().wait()
"""
"""A process that holds GPU node ``argv[1]`` (``O_PATH``: no driver answers a simulated node)
without any CUDA context; says so in ``argv[2]``."""


@dataclass
class Node:
    """The agent and the fake driver the test and the sandboxes share."""

    agent: AgentProcess
    library: Path
    sockets: Path
    config: Path
    tmp: Path

    @property
    def api(self) -> ApiClient:
        assert self.agent.tcp is not None
        return self.agent.tcp

    @property
    def cuda(self) -> CudaCheckpoint:
        return CudaCheckpoint(str(self.library))


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sim.ensure_fake_cuda(tmp_path_factory.mktemp("cuda")) / sim.CUDA_LIBRARY_NAME


@pytest.fixture
def node(tmp_path: Path, library: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    # A short directory: a unix socket's path has room for 107 bytes.
    sockets = Path(tempfile.mkdtemp(prefix="ckpt-"))
    sockets.chmod(0o777)
    monkeypatch.setenv(CHECKPOINT_DIR_ENV, str(sockets))  # for this test's own driver calls
    simulation = tmp_path / "simulation"
    agent = AgentProcess(
        tmp_path / "state",
        simulate=GPUS,
        extra_args=["--reconcile-interval=0", f"--simulation-dir={simulation}"],
        env={CHECKPOINT_DIR_ENV: str(sockets)},
    )
    try:
        yield Node(agent, library, sockets, simulation / CONFIG_NAME, tmp_path)
    finally:
        agent.kill9()
        shutil.rmtree(sockets)


def start(node: Node, **env: str) -> None:
    node.agent.start(env={FAIL_ENV: "", "GPU_HOTPLUG_TEST_PAUSE_AT": "", **env})


def attach(node: Node, probe: SandboxProbe, **body: Any) -> Response:
    return node.api.post("/v1/attachments", {"count": 1, "target": {"pid": probe.pid}, **body})


def suspend(node: Node, probe: SandboxProbe) -> Response:
    return node.api.delete(f"/v1/attachments?pid={probe.pid}&keep=true")


def listed(node: Node, probe: SandboxProbe) -> dict[str, Any]:
    answer = node.api.get(f"/v1/attachments?pid={probe.pid}")
    assert answer.status == 200, answer.body
    body: dict[str, Any] = answer.json()
    return body


def cuda_process(node: Node, probe: SandboxProbe) -> int:
    """Start the CUDA process in ``probe``'s sandbox; its pid as the agent numbers it."""
    return spawned(
        node,
        probe,
        [f"{CHECKPOINT_DIR_ENV}={node.sockets}", f"{sim.CONFIG_ENV}={node.config}"],
        [TARGET, str(node.library), str(MEMORY_BYTES)],
    )


def spawned(node: Node, probe: SandboxProbe, env: list[str], script: list[str]) -> int:
    """Run ``script`` (python ``-c`` and its arguments) in the sandbox with ``env``, until it
    writes "0" to the file named by its last argument; its pid as the agent numbers it."""
    ready = node.tmp / f"ready-{probe.pid}-{len(list(node.tmp.glob('ready-*')))}"
    pid = probe.spawn(["/usr/bin/env", *env, sys.executable, "-c", *script, str(ready)])
    deadline = time.monotonic() + REPLY_TIMEOUT
    while not ready.exists() or not ready.read_text():
        assert time.monotonic() < deadline, f"the process in the sandbox never got ready: {script}"
        time.sleep(0.02)
    assert ready.read_text() == "0", f"{script[0]}: {ready.read_text()}"
    return pid


def held(pid: int) -> set[int]:
    """The minors of the GPU nodes (char 195:N) ``pid`` has an fd on: what it uses."""
    minors = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            info = os.stat(fd_dir / fd)
        except FileNotFoundError:
            continue
        if stat.S_ISCHR(info.st_mode) and os.major(info.st_rdev) == NVIDIA_MAJOR:
            minors.add(os.minor(info.st_rdev))
    return minors


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@dataclass
class Kernel:
    """A sandbox with one GPU attached and a CUDA process using it."""

    probe: SandboxProbe
    uuid: str
    minor: int
    pid: int


def kernel(node: Node, probe: SandboxProbe) -> Kernel:
    """Attach a GPU to ``probe``'s sandbox and start a CUDA process on it; returned once NVML
    lists the process on the GPU (the simulation's next pass), as it does a real one."""
    attached = attach(node, probe)
    assert attached.status == 201, attached.body
    (attachment,) = attached.json()["attachments"]
    pid = cuda_process(node, probe)
    assert held(pid) == {attachment["minor"]}
    assert node.cuda.state(pid) is ProcessState.RUNNING
    deadline = time.monotonic() + REPLY_TIMEOUT
    while nvml_lists(node, pid) != {attachment["uuid"]}:
        assert time.monotonic() < deadline, f"NVML never listed {pid}:\n{node.agent.log()}"
        time.sleep(0.05)
    return Kernel(probe, attachment["uuid"], attachment["minor"], pid)


def nvml_lists(node: Node, pid: int) -> set[str]:
    """The GPUs the simulated NVML lists ``pid`` on (its config is what NVML answers)."""
    config = sim.read_config(node.config)
    return {gpu.uuid for gpu in config.gpus if any(p.pid == pid for p in gpu.processes)}


def assert_running_as_before(node: Node, k: Kernel) -> None:
    """The kernel as it was before a suspend that did not happen: its process alive and
    running on its GPU, which is still attached and openable."""
    assert alive(k.pid)
    assert node.cuda.state(k.pid) is ProcessState.RUNNING
    assert held(k.pid) == {k.minor}
    assert opens(k.probe, k.minor) == "ENXIO"
    body = listed(node, k.probe)
    assert [a["uuid"] for a in body["attachments"]] == [k.uuid]
    assert "suspended" not in body


def assert_suspended(node: Node, k: Kernel, gpu: str = "free") -> None:
    """Checkpointed, alive, holding no GPU and listed by NVML on none, its GPU taken away
    (``gpu``: the state the node shows for it then), the state shown."""
    assert alive(k.pid)
    assert node.cuda.state(k.pid) is ProcessState.CHECKPOINTED
    assert held(k.pid) == set()
    assert nvml_lists(node, k.pid) == set()
    assert opens(k.probe, k.minor) == "EPERM"
    body = listed(node, k.probe)
    assert body["attachments"] == []
    assert body["suspended"]["state"] == "suspended"
    assert body["suspended"]["uuids"] == [k.uuid]
    assert body["suspended"]["pids"] == [k.pid]
    assert body["suspended"]["host_memory"] == MEMORY_BYTES
    gpus = {g["uuid"]: g for g in node.api.get("/v1/gpus").json()["gpus"]}
    assert gpus[k.uuid]["state"] == gpu


def resumed_on(node: Node, k: Kernel) -> int:
    """Attach again (the resume); the minor it runs on, checked from every side."""
    answer = attach(node, k.probe)
    assert answer.status == 201, answer.body
    (attachment,) = answer.json()["attachments"]
    minor = attachment["minor"]
    assert alive(k.pid)
    assert node.cuda.state(k.pid) is ProcessState.RUNNING
    assert held(k.pid) == {minor}
    assert opens(k.probe, minor) == "ENXIO"
    assert "suspended" not in listed(node, k.probe)
    return int(minor)


# --- the story -----------------------------------------------------------------------------------


def test_suspend_hand_the_gpu_to_another_then_resume_on_another_gpu(
    node: Node, sandbox_factory: SandboxFactory
) -> None:
    start(node)
    k = kernel(node, sandbox_factory())

    assert suspend(node, k.probe).status == 204
    assert_suspended(node, k)

    other = sandbox_factory()
    taken = attach(node, other, gpus=[k.uuid])
    assert taken.status == 201, taken.body
    assert opens(other, k.minor) == "ENXIO"

    minor = resumed_on(node, k)
    assert minor != k.minor, "its GPU is taken: resumed on the other GPU of the same model"
    assert opens(other, k.minor) == "ENXIO"


def test_suspend_then_resume_on_the_same_gpu(node: Node, sandbox: SandboxProbe) -> None:
    start(node)
    k = kernel(node, sandbox)

    assert suspend(node, k.probe).status == 204
    assert_suspended(node, k)

    assert resumed_on(node, k) == k.minor


def start_with_idle_release(node: Node, *policy: str) -> None:
    """Start the agent with the idle ``policy`` (default a 5 s idle period), looked at (and the
    simulation moved) 5 times a second."""
    node.agent.extra_args = [
        *node.agent.extra_args,
        *(policy or ("--idle-release=5", "--idle-warning=2")),
        "--AgentApp.idle_check_interval=0.2",
        "--AgentApp.simulation_interval=0.2",
    ]
    start(node)


def suspended_by_idleness(node: Node, k: Kernel) -> None:
    """Wait until the idle policy has suspended ``k``."""
    poll(
        lambda: listed(node, k.probe).get("suspended", {}).get("state") == "suspended",
        "the idle kernel suspended",
        node.agent,
    )


def test_an_idle_kernel_is_suspended_by_the_idle_policy_and_its_next_attach_resumes_it(
    node: Node, sandbox: SandboxProbe
) -> None:
    """A kernel whose CUDA context sits idle (NVML: its memory, 0 %) for the idle period is
    suspended, not left holding the GPU nor ended: the GPU goes back free, the release is
    recorded as idle, and the next attach resumes the kernel on it."""
    start_with_idle_release(node)
    k = kernel(node, sandbox)
    gpu = sim.read_config(node.config).gpu(k.uuid)
    assert [(p.pid, p.used_memory, p.sm_util) for p in gpu.processes] == [(k.pid, MEMORY_BYTES, 0)]

    suspended_by_idleness(node, k)
    assert_suspended(node, k)
    (record,) = node.api.get(f"/v1/idle-releases?pid={k.probe.pid}").json()["releases"]
    assert (record["uuid"], record["reason"]) == (k.uuid, "idle")
    assert "suspended" in node.agent.log()
    assert resumed_on(node, k) == k.minor


def handed_over(node: Node, sandbox_factory: SandboxFactory) -> tuple[Kernel, SandboxProbe]:
    """Every GPU taken — one by an idle kernel, one by a working one — and a request waits in
    the queue: the idle kernel is suspended and its GPU goes to the waiter (returned)."""
    idle = kernel(node, sandbox_factory())
    working = sandbox_factory()
    (busy,) = attach(node, working).json()["attachments"]
    spawned(node, working, [], [HOLDER, busy["device"]])  # makes its GPU work (simulation)
    waiter = sandbox_factory()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(attach, node, waiter, wait_seconds=120)
        suspended_by_idleness(node, idle)
        served = waiting.result(timeout=REPLY_TIMEOUT)
    assert served.status == 201, served.body
    assert_suspended(node, idle, gpu="attached")
    (handed,) = served.json()["attachments"]
    assert handed["uuid"] == idle.uuid
    assert opens(waiter, idle.minor) == "ENXIO"
    assert [a["uuid"] for a in listed(node, working)["attachments"]] == [busy["uuid"]]
    return idle, waiter


def test_an_idle_kernels_suspend_hands_its_gpu_to_a_waiting_request_and_it_resumes_later(
    node: Node, sandbox_factory: SandboxFactory
) -> None:
    """The idle kernel is suspended, not ended, and its GPU goes to the waiter. Its own attach
    is then refused (no GPU of its model free) with its state kept, and resumes it once one
    is."""
    start_with_idle_release(node)
    idle, waiter = handed_over(node, sandbox_factory)

    refused = attach(node, idle.probe)
    assert refused.status == 409, refused.body
    assert node.cuda.state(idle.pid) is ProcessState.CHECKPOINTED
    assert listed(node, idle.probe)["suspended"]["state"] == "suspended"

    assert node.api.delete(f"/v1/attachments?pid={waiter.pid}").status == 204
    assert resumed_on(node, idle) == idle.minor


def test_a_waiting_request_has_an_idle_kernel_suspended_after_the_handover_period(
    node: Node, sandbox_factory: SandboxFactory
) -> None:
    """An idle period of an hour and a hand-over period of 2 s: a request that waits gets the
    idle kernel's GPU within seconds, not an hour, and the kernel is suspended, its state
    kept."""
    start_with_idle_release(node, "--idle-release=3600", "--idle-handover=2", "--idle-warning=1")
    idle, _ = handed_over(node, sandbox_factory)
    assert "while a request of another kernel waited for GPUs" in node.agent.log()
    assert node.cuda.state(idle.pid) is ProcessState.CHECKPOINTED


MAGIC: Final = """
import pathlib, sys
from jupyter_gpu_hotplug.kernel.magic import run_line
shown = pathlib.Path(sys.argv[2])
sys.stdout = shown.open("w")
try:
    run_line(sys.argv[1])
except Exception as error:
    result = f"{type(error).__name__}: {getattr(error, 'message', error)}"
else:
    result = "0"
sys.stdout.close()
pathlib.Path(sys.argv[3]).write_text(result)
"""
"""``%gpu <argv[1]>`` run in the sandbox as its kernel runs it (the agent sees the caller's
own container); what it printed goes to ``argv[2]``, then "0" (or its error) to ``argv[3]``."""


def magic(node: Node, probe: SandboxProbe, line: str) -> str:
    """What ``%gpu line`` prints in ``probe``'s sandbox, reaching the agent on its socket."""
    shown = node.tmp / f"magic-{len(list(node.tmp.glob('magic-*')))}"
    env = [f"GPU_HOTPLUG_AGENT_URL=unix:{node.agent.socket_path}", f"PYTHONPATH={ROOT}"]
    spawned(node, probe, env, [MAGIC, line, str(shown)])
    return shown.read_text()


def test_the_user_side_release_keep_status_and_attach(
    node: Node, sandbox: SandboxProbe, capsys: pytest.CaptureFixture[str]
) -> None:
    """``%gpu release --keep`` in the kernel's sandbox suspends it and says so, the command
    line's ``status`` shows it, and ``%gpu attach`` resumes it; ``--keep --force`` sends
    nothing (the kernel still runs on its GPU)."""
    start(node)
    k = kernel(node, sandbox)
    tcp = node.api.address
    assert isinstance(tcp, TcpAddress)
    cli = ["--agent-url", f"http://{tcp.host}:{tcp.port}", "--pid", str(k.probe.pid)]
    cli += ["--token-file", str(node.agent.state_dir / "token")]

    with pytest.raises(UsageError, match="force and keep exclude each other"):
        run_line("release --keep --force")
    assert_running_as_before(node, k)

    released = magic(node, k.probe, "release --keep")

    assert released == (
        f"Released GPU {k.minor} (1 GPU). This kernel is suspended (state kept, 5.0 MiB in host "
        "memory); '%gpu attach' resumes it on 1 free NVIDIA H100 80GB HBM3 (simulated) GPU (the "
        "same one when free).\n"
    )
    assert_suspended(node, k)
    capsys.readouterr()
    assert main(["status", *cli]) == 0
    assert (
        "suspended here: suspended (state kept, 5.0 MiB in host memory)" in capsys.readouterr().out
    )

    attached = magic(node, k.probe, "attach")

    assert attached.startswith(
        "Resumed this kernel on 1 GPU: the agent restored its CUDA state from host memory"
    )
    assert node.cuda.state(k.pid) is ProcessState.RUNNING
    assert held(k.pid) == {k.minor}
    assert "suspended" not in listed(node, k.probe)


def test_a_detach_with_keep_and_force_is_refused(node: Node, sandbox: SandboxProbe) -> None:
    start(node)
    k = kernel(node, sandbox)

    answer = node.api.delete(f"/v1/attachments?pid={sandbox.pid}&keep=true&force=true")

    assert answer.status == 400
    assert answer.json()["field"] == "keep"
    assert_running_as_before(node, k)


# --- failures roll back -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "status", "words"),
    [
        ("lock_timeout", 503, "did not finish its GPU work in time"),
        ("unsupported", 422, "cannot be checkpointed"),
        ("checkpoint", 422, "CUDA_ERROR_OUT_OF_MEMORY"),
    ],
)
def test_an_injected_suspend_failure_leaves_the_kernel_as_it_was(
    node: Node, sandbox: SandboxProbe, failure: str, status: int, words: str
) -> None:
    start(node, **{FAIL_ENV: failure})
    k = kernel(node, sandbox)

    answer = suspend(node, k.probe)

    assert answer.status == status, answer.body
    assert words in answer.json()["message"]
    assert_running_as_before(node, k)


def test_a_process_without_a_cuda_context_is_refused_and_keeps_its_gpu(
    node: Node, sandbox: SandboxProbe
) -> None:
    """A process holding the GPU that is no CUDA process the driver can checkpoint."""
    start(node)
    attached = attach(node, sandbox).json()["attachments"][0]
    device = attached["device"]
    pid = spawned(node, sandbox, [], [HOLDER, device])
    assert held(pid) == {attached["minor"]}

    answer = suspend(node, sandbox)

    assert answer.status == 422, answer.body
    assert "cannot be checkpointed" in answer.json()["message"]
    assert [a["uuid"] for a in listed(node, sandbox)["attachments"]] == [attached["uuid"]]
    assert "suspended" not in listed(node, sandbox)
    assert alive(pid)
    assert held(pid) == {attached["minor"]}
    assert sandbox.open(device) == "ENXIO"


def test_a_suspend_past_one_kernels_budget_is_refused_and_the_kernel_runs_on(
    node: Node, sandbox: SandboxProbe
) -> None:
    """The host-memory budget: one kernel may keep at most ``--keep-memory-per-target``."""
    node.agent.extra_args = [*node.agent.extra_args, "--keep-memory-per-target=4Mi"]
    start(node)
    k = kernel(node, sandbox)

    answer = suspend(node, k.probe)

    assert answer.status == 422, answer.body
    assert "takes 5 MiB, more than the 4 MiB one kernel may keep" in answer.json()["message"]
    assert answer.json()["retryable"] is False
    assert_running_as_before(node, k)


def test_an_injected_restore_failure_keeps_the_state_suspended(
    node: Node, sandbox: SandboxProbe
) -> None:
    start(node, **{FAIL_ENV: "restore_other_chip"})
    k = kernel(node, sandbox)
    assert suspend(node, k.probe).status == 204

    answer = attach(node, k.probe)

    assert answer.status == 422, answer.body
    assert "CUDA_ERROR_INVALID_VALUE" in answer.json()["message"]
    assert_suspended(node, k)


# --- crash safety -------------------------------------------------------------------------------

# After a kill -9 at each step of a suspend and a restart: is the kernel suspended?
SUSPENDED_AFTER_CRASH = {
    "after_suspend_intent": False,  # recorded, nothing locked yet: rolled back
    "after_checkpoint": False,  # checkpointed, GPU still granted: rolled back
    "after_suspend_revoke": True,  # the GPU released: the suspend is finished
}
assert set(SUSPENDED_AFTER_CRASH) == set(SUSPEND_STEPS)


@pytest.mark.parametrize("step", SUSPEND_STEPS)
def test_kill_9_mid_suspend_recovers_consistently(
    node: Node, sandbox: SandboxProbe, step: str
) -> None:
    start(node, GPU_HOTPLUG_TEST_PAUSE_AT=step)
    k = kernel(node, sandbox)
    request = threading.Thread(target=_ignore_errors, args=(suspend, node, k.probe))
    request.start()
    marker = marker_path(node.agent.state_dir, step)
    deadline = time.monotonic() + REPLY_TIMEOUT
    while not marker.exists():
        assert time.monotonic() < deadline, f"never paused at {step}:\n{node.agent.log()}"
        time.sleep(0.02)

    node.agent.kill9()
    request.join(timeout=60)
    marker.unlink()
    start(node)

    if SUSPENDED_AFTER_CRASH[step]:
        assert_suspended(node, k)
        assert resumed_on(node, k) == k.minor
    else:
        assert_running_as_before(node, k)
    node.agent.kill9()
    with Ledger.open(node.agent.state_dir) as ledger:
        assert ledger.pending() == []
        assert ledger.suspensions() == []


def test_kill_9_after_a_suspend_keeps_it_for_the_restarted_agent(
    node: Node, sandbox: SandboxProbe
) -> None:
    start(node)
    k = kernel(node, sandbox)
    assert suspend(node, k.probe).status == 204

    node.agent.kill9()
    start(node)

    assert_suspended(node, k)
    assert resumed_on(node, k) == k.minor


def test_a_suspended_kernel_that_exits_is_forgotten_and_its_share_of_the_budget_comes_back(
    node: Node, sandbox_factory: SandboxFactory
) -> None:
    """A node budget that keeps one kernel's state, not two: the second kernel's suspend is
    refused while the first is suspended; the first is shut down (its sandbox ends, its CUDA
    process with it), the next reconciliation pass forgets it, and the second's suspend fits."""
    fits_one = 8 * 2**20 / node_memory(Path("/proc/meminfo"))
    node.agent.extra_args = [*node.agent.extra_args, f"--keep-memory-fraction={fits_one}"]
    start(node)
    first = kernel(node, sandbox_factory())
    assert suspend(node, first.probe).status == 204
    second = kernel(node, sandbox_factory())
    refused = suspend(node, second.probe)
    assert (refused.status, refused.json()["retryable"]) == (422, True), refused.body
    assert_running_as_before(node, second)

    first.probe.sandbox.stop()
    os.kill(node.agent.pid, signal.SIGHUP)  # a pass now: the fixture turns timed ones off

    poll(
        lambda: "is gone: its suspension is forgotten" in node.agent.log(), "forgotten", node.agent
    )
    assert suspend(node, second.probe).status == 204
    assert_suspended(node, second)


def _ignore_errors(function: Any, *args: Any) -> None:
    """The request dies with the agent; its outcome is judged after the restart."""
    try:
        function(*args)
    except (ConnectionError, OSError):
        return
