"""The sandbox kernel provisioner: each kernel of a real Jupyter server in a sandbox of its own.

The root tests start ipykernel kernels through jupyter_server's REST API and ask them, with
code run over a kernel client, what they see; GPUs are real NVIDIA numbers without a GPU
(opening ``c 195:0`` gives ENXIO where the cgroup allows it, EPERM where it denies it) and
the kernels' ``pynvml`` loads the fake NVML, which shows a GPU only where its node exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.kernelspec import KernelSpec
from jupyter_client.manager import KernelManager
from jupyter_client.provisioning.factory import KernelProvisionerFactory
from jupyter_client.provisioning.local_provisioner import LocalProvisioner
from jupyter_server.serverapp import ServerApp
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR, SANDBOX_PID_ENV
from jupyter_gpu_hotplug.linux import cgroups
from jupyter_gpu_hotplug.linux.bpf import syscall
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode
from jupyter_gpu_hotplug.linux.devrules import CharDevice
from jupyter_gpu_hotplug.linux.engine import HotplugEngine
from jupyter_gpu_hotplug.linux.sandbox.runtime import Sandbox
from jupyter_gpu_hotplug.nvml.sim import CONFIG_ENV, DEVICE_FILTER_ENV
from jupyter_gpu_hotplug.sandboxes.events import (
    KERNEL_SANDBOX_EVENTS,
    SandboxEvent,
    SandboxEventKind,
)
from jupyter_gpu_hotplug.sandboxes.provisioner import (
    PROVISIONER_NAME,
    KernelSandboxStartError,
    SandboxedKernelProvisioner,
    sandboxed_kernels_config,
    sandboxed_kernelspec,
    write_sandboxed_kernelspec,
)
from tests.fixtures.host_state import (
    bpf_program_loaded,
    mount_namespaces_in_use,
    process_running,
    process_start_time,
    ticks_now,
)
from tests.fixtures.nvml import FakeNvmlNode
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import NAME_PREFIX, SandboxSession
from tests.fixtures.waiting import eventually

DEADLINE_S = 180.0
"""Upper bound for a kernel to start or answer, or the server to answer a request, on a loaded
shared machine (CI runs the real-node lane's VM beside this one); never asserted."""

BASIC_DEV = {
    "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty",
    "urandom", "zero",
}  # fmt: skip

GPU0 = DeviceNode("nvidia0", CharDevice(NVIDIA_MAJOR, 0))

#: Defined in every test kernel: what the code under test is asked about, answered as JSON.
KERNEL_HELPERS = """
import errno as _errno, json as _json, os as _os

def _open_result(path):
    try:
        _os.close(_os.open(path, _os.O_RDONLY | _os.O_NONBLOCK))
    except OSError as e:
        return _errno.errorcode[e.errno]
    return "OK"

def _mknod_result(path, major, minor):
    try:
        _os.mknod(path, 0o20666, _os.makedev(major, minor))
    except OSError as e:
        return _errno.errorcode[e.errno]
    return "OK"

def _gpu_count():
    import pynvml
    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
"""


# ---- pure parts (no root) ----------------------------------------------------------------


def test_kernelspec_names_the_provisioner_and_carries_its_config() -> None:
    spec = sandboxed_kernelspec(config={"extra_env": {"A": "1"}})

    assert spec["argv"] == [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    assert spec["metadata"]["kernel_provisioner"] == {
        "provisioner_name": PROVISIONER_NAME,
        "config": {"extra_env": {"A": "1"}},
    }
    assert spec["interrupt_mode"] == "signal"


def test_written_kernelspec_loads_as_jupyter_reads_it(tmp_path: Path) -> None:
    document = sandboxed_kernelspec(display_name="Boxed", env={"B": "2"})
    directory = write_sandboxed_kernelspec(tmp_path, "boxed", spec=document)

    spec = KernelSpec.from_resource_dir(str(directory))

    assert (directory.name, spec.display_name, spec.env) == ("boxed", "Boxed", {"B": "2"})
    assert spec.metadata["kernel_provisioner"]["provisioner_name"] == PROVISIONER_NAME


@pytest.fixture
def provisioner_factory() -> Iterator[type[KernelProvisionerFactory]]:
    """A fresh factory singleton: it reads its config only when first created."""
    KernelProvisionerFactory.clear_instance()
    yield KernelProvisionerFactory
    KernelProvisionerFactory.clear_instance()


def _plain_spec(**metadata: Any) -> KernelSpec:
    return KernelSpec(argv=["true"], display_name="plain", language="python", metadata=metadata)


def test_entry_point_and_default_config_select_the_provisioner(
    provisioner_factory: type[KernelProvisionerFactory],
) -> None:
    factory = provisioner_factory.instance(config=sandboxed_kernels_config())

    provisioner = factory.create_provisioner_instance("kid", _plain_spec(), parent=None)

    assert factory.get_provisioner_entries()[PROVISIONER_NAME] == (
        "jupyter_gpu_hotplug.sandboxes.provisioner:SandboxedKernelProvisioner"
    )
    assert isinstance(provisioner, SandboxedKernelProvisioner)


def test_kernelspec_config_overrides_server_config(
    provisioner_factory: type[KernelProvisionerFactory],
) -> None:
    config = sandboxed_kernels_config(extra_env={"X": "server"}, name_prefix="server")
    manager = KernelManager(config=config)
    stanza = {"provisioner_name": PROVISIONER_NAME, "config": {"name_prefix": "spec"}}
    spec = _plain_spec(kernel_provisioner=stanza)

    provisioner = provisioner_factory.instance().create_provisioner_instance(
        "kid", spec, parent=manager
    )

    assert isinstance(provisioner, SandboxedKernelProvisioner)
    assert (provisioner.name_prefix, provisioner.extra_env) == ("spec", {"X": "server"})


@pytest.mark.parametrize(
    ("trait", "value"),
    [("name_prefix", "has space"), ("name_prefix", ""), ("cgroup_parent", "/absolute")],
)
def test_invalid_placement_is_refused_at_configuration(trait: str, value: str) -> None:
    with pytest.raises(TraitError):
        SandboxedKernelProvisioner(**{trait: value})


async def test_unsupported_launch_options_fail_before_anything_starts() -> None:
    provisioner = SandboxedKernelProvisioner(kernel_id="k")

    with pytest.raises(KernelSandboxStartError, match="close_fds"):
        await provisioner.launch_kernel(["true"], close_fds=False)

    assert provisioner.sandbox is None
    assert not provisioner.has_process


# ---- real kernels in a real server (root) ------------------------------------------------


@dataclass
class Kernel:
    """A kernel of the test server, with a client connected to it."""

    kernel_id: str
    server: ServerApp
    client: AsyncKernelClient

    @property
    def provisioner(self) -> SandboxedKernelProvisioner:
        provisioner = self.server.kernel_manager.get_kernel(self.kernel_id).provisioner
        assert isinstance(provisioner, SandboxedKernelProvisioner)
        return provisioner

    @property
    def sandbox(self) -> Sandbox:
        sandbox = self.provisioner.sandbox
        assert sandbox is not None
        return sandbox

    async def run(self, code: str, *, aborted_tries: int = 0) -> str:
        """Execute ``code``; its stdout, or a failed test with the kernel's traceback.
        ``aborted_tries``: how many times to ask again when the kernel answers "aborted"
        (ipykernel aborts the requests that reach it before it is done with an error)."""
        out: list[str] = []

        def on_output(message: dict[str, Any]) -> None:
            if message["msg_type"] == "stream" and message["content"]["name"] == "stdout":
                out.append(message["content"]["text"])

        reply = await self.client.execute_interactive(
            code, timeout=DEADLINE_S, output_hook=on_output
        )
        content = reply["content"]
        if content["status"] == "aborted" and aborted_tries > 0:
            return await self.run(code, aborted_tries=aborted_tries - 1)
        if content["status"] != "ok":
            pytest.fail(
                f"kernel {content['status']}: {content.get('ename')}: {content.get('evalue')}"
            )
        return "".join(out)

    async def eval(self, expression: str) -> Any:
        return json.loads(await self.run(f"print(_json.dumps({expression}))"))


def _sleeping(sandbox: Sandbox) -> bool:
    """Whether a process of ``sandbox`` sleeps in ``time.sleep`` (``clock_nanosleep``): the
    kernel's main thread in the user's code, since the sandbox's own processes wait for
    signals and ipykernel's idle threads poll."""
    for pid in sandbox.processes():
        with contextlib.suppress(OSError):  # gone since the listing
            if Path(f"/proc/{pid}/task/{pid}/wchan").read_text() == "hrtimer_nanosleep":
                return True
    return False


def _fake_nvml_extra_env(node: FakeNvmlNode) -> dict[str, str]:
    """Only the variables that point a kernel's pynvml at the fake, in its container view."""
    environ = node.environ(device_filter=Path("/dev"))
    return {name: environ[name] for name in ("LD_LIBRARY_PATH", CONFIG_ENV, DEVICE_FILTER_ENV)}


@pytest.fixture
def server_defaults_to_sandbox() -> bool:
    """Whether the test server sandboxes kernels by default (else only by kernelspec)."""
    return True


@pytest.fixture
def jp_server_config(
    sandbox_session: SandboxSession,
    fake_nvml_node: FakeNvmlNode,
    server_defaults_to_sandbox: bool,
    provisioner_factory: type[KernelProvisionerFactory],
) -> Config:
    """The suite's server config, plus sandboxed kernels placed below this run's cgroup
    parent (so the session's leftover check covers them) and seeing the fake NVML."""
    config = Config(
        {
            "ServerApp": {
                "jpserver_extensions": {"jupyter_server_terminals": False},
                "allow_unauthenticated_access": False,
            }
        }
    )
    if server_defaults_to_sandbox:
        config.merge(
            sandboxed_kernels_config(
                extra_env=_fake_nvml_extra_env(fake_nvml_node),
                name_prefix=NAME_PREFIX,
                cgroup_parent=sandbox_session.cgroup_parent,
            )
        )
    return config


@pytest.fixture
def sandbox_events() -> Iterator[list[SandboxEvent]]:
    """Every sandbox event announced during the test."""
    seen: list[SandboxEvent] = []
    unsubscribe = KERNEL_SANDBOX_EVENTS.subscribe(seen.append)
    yield seen
    unsubscribe()


StartKernel = Callable[..., Awaitable[Kernel]]


@pytest.fixture
async def start_kernel(
    jp_serverapp: ServerApp, jp_fetch: Callable[..., Awaitable[Any]]
) -> AsyncIterator[StartKernel]:
    """Start kernels through the REST API; every one is shut down at the end."""
    kernels: list[Kernel] = []

    async def start(name: str = "python3", **body: Any) -> Kernel:
        response = await jp_fetch(
            "api",
            "kernels",
            method="POST",
            body=json.dumps({"name": name, **body}),
            request_timeout=DEADLINE_S,
        )
        kernel_id = json.loads(response.body)["id"]
        kernel_manager = jp_serverapp.kernel_manager.get_kernel(kernel_id)
        # The manager's client asks the provisioner whether the kernel lives; a bare client
        # would judge by a first heartbeat within 1 s, which a loaded machine can miss.
        client = AsyncKernelClient(
            parent=kernel_manager, **kernel_manager.get_connection_info(session=True)
        )
        kernel = Kernel(kernel_id, jp_serverapp, client)
        kernels.append(kernel)
        client.start_channels()
        await client.wait_for_ready(timeout=DEADLINE_S)
        await kernel.run(KERNEL_HELPERS)
        return kernel

    try:
        yield start
    finally:
        manager = jp_serverapp.kernel_manager
        for kernel in kernels:
            kernel.client.stop_channels()
            if kernel.kernel_id in manager:
                await manager.shutdown_kernel(  # type: ignore[no-untyped-call]
                    kernel.kernel_id, now=True
                )


def _cgroup_paths(text: str) -> dict[str, str]:
    """``/proc/PID/cgroup`` as controller list → path (``""`` is cgroup2)."""
    return {
        line.split(":", 2)[1]: line.split(":", 2)[2] for line in text.splitlines() if line.strip()
    }


def _expected_cgroups(sandbox: Sandbox) -> dict[str, str]:
    found = cgroups.discover()
    expected = {}
    if sandbox.cgroups.v1 is not None and found.devices_v1 is not None:
        expected["devices"] = "/" + str(
            sandbox.cgroups.v1.relative_to(found.devices_v1.mount_point)
        )
    if sandbox.cgroups.v2 is not None and found.unified is not None:
        expected[""] = f"/{sandbox.cgroups.v2.relative_to(found.unified.mount_point)}"
    return expected


@dataclass(frozen=True)
class Remains:
    """What a sandbox could leave behind, recorded while it runs."""

    name: str
    dirs: tuple[Path, ...]
    program: syscall.ProgId | None
    mount_ns: int
    processes: tuple[tuple[int, int], ...]
    recorded_at: int
    """When (:func:`ticks_now`): only a process that ran by then can be in this namespace
    (one made later may have its inode number)."""

    @classmethod
    def of(cls, sandbox: Sandbox) -> Remains:
        processes = []
        for pid in sandbox.processes():
            start = process_start_time(pid)
            if start is not None:
                processes.append((pid, start))
        return cls(
            name=sandbox.name,
            dirs=sandbox.cgroups.dirs(),
            program=sandbox.cgroups.v2_program,
            mount_ns=sandbox.mount_ns,
            processes=tuple(processes),
            recorded_at=ticks_now(),
        )

    async def assert_gone(self, *, live: tuple[Sandbox, ...] = ()) -> None:
        """Fail unless everything is gone; ``live`` are sandboxes still running."""
        assert [d for d in self.dirs if d.exists()] == []
        # A killed process leaves its cgroup before it has finished exiting.
        await eventually(
            lambda: not any(process_running(pid, start) for pid, start in self.processes),
            "every process of the sandbox has exited",
        )
        # The kernel frees a cgroup's programs and a namespace asynchronously.
        if self.program is not None:
            program = self.program
            await eventually(
                lambda: not bpf_program_loaded(program), f"BPF program {program} is freed"
            )
        if self.mount_ns not in {sandbox.mount_ns for sandbox in live}:
            # A namespace's inode number is reused once it is freed: a live sandbox having
            # it proves the old one is gone.
            await eventually(
                lambda: self.mount_ns not in mount_namespaces_in_use(started_by=self.recorded_at),
                "the mount namespace is gone",
            )


@needs_root
@pytest.mark.slow
class TestSandboxedKernels:
    async def test_each_kernel_runs_in_a_sandbox_of_its_own(
        self, start_kernel: StartKernel, jp_root_dir: Path, sandbox_events: list[SandboxEvent]
    ) -> None:
        (jp_root_dir / "work").mkdir()
        first = await start_kernel(path="work")
        second = await start_kernel()

        for kernel in (first, second):
            # Its own pid namespace: the kernel is pid 2 there, and knows the pid it is named by.
            assert await kernel.eval("_os.getpid()") == 2
            pid = await kernel.eval(f"int(_os.environ[{SANDBOX_PID_ENV!r}])")
            assert pid == kernel.provisioner.sandbox_pid
            cgroup_text = await kernel.eval("open('/proc/self/cgroup').read()")
            seen = _cgroup_paths(cgroup_text)
            expected = _expected_cgroups(kernel.sandbox)
            assert expected and {k: seen[k] for k in expected} == expected
            mount_ns = await kernel.eval("_os.readlink('/proc/self/ns/mnt')")
            assert mount_ns == f"mnt:[{kernel.sandbox.mount_ns}]"
            assert mount_ns != os.readlink("/proc/self/ns/mnt")
            assert set(await kernel.eval("_os.listdir('/dev')")) == BASIC_DEV
            assert await kernel.eval(f"_os.environ[{DEVICE_FILTER_ENV!r}]") == "/dev"
        assert first.sandbox.name != second.sandbox.name
        assert first.sandbox.mount_ns != second.sandbox.mount_ns
        assert await first.eval("_os.getcwd()") == str(jp_root_dir / "work")
        assert [(e.kind, e.pid, e.restart) for e in sandbox_events] == [
            (SandboxEventKind.STARTED, first.provisioner.sandbox_pid, False),
            (SandboxEventKind.STARTED, second.provisioner.sandbox_pid, False),
        ]

    async def test_a_gpu_granted_to_one_kernel_is_seen_by_it_alone(
        self, start_kernel: StartKernel
    ) -> None:
        first, second = await start_kernel(), await start_kernel()
        assert [await k.eval("_gpu_count()") for k in (first, second)] == [0, 0]

        assert first.provisioner.sandbox_pid is not None
        HotplugEngine(control_nodes=()).grant(first.provisioner.sandbox_pid, [GPU0])

        assert await first.eval("_open_result('/dev/nvidia0')") == "ENXIO"  # allowed, no driver
        assert await first.eval("_gpu_count()") == 1
        assert await second.eval("_open_result('/dev/nvidia0')") == "ENOENT"
        assert await second.eval("_gpu_count()") == 0
        assert await second.eval(f"_mknod_result('/dev/nvidia0', {NVIDIA_MAJOR}, 0)") == "OK"
        assert await second.eval("_open_result('/dev/nvidia0')") == "EPERM"  # denied

    async def test_restart_gives_a_new_sandbox_without_the_gpu(
        self,
        start_kernel: StartKernel,
        jp_fetch: Callable[..., Awaitable[Any]],
        sandbox_events: list[SandboxEvent],
    ) -> None:
        kernel = await start_kernel()
        old_pid = kernel.provisioner.sandbox_pid
        assert old_pid is not None
        HotplugEngine(control_nodes=()).grant(old_pid, [GPU0])
        assert await kernel.eval("_gpu_count()") == 1
        old = Remains.of(kernel.sandbox)

        await jp_fetch(
            "api",
            "kernels",
            kernel.kernel_id,
            "restart",
            method="POST",
            body="",
            request_timeout=DEADLINE_S,
        )
        await kernel.client.wait_for_ready(timeout=DEADLINE_S)
        await kernel.run(KERNEL_HELPERS)

        new_pid = kernel.provisioner.sandbox_pid
        assert new_pid is not None and new_pid != old_pid
        assert await kernel.eval(f"int(_os.environ[{SANDBOX_PID_ENV!r}])") == new_pid
        assert kernel.sandbox.name != old.name
        await old.assert_gone(live=(kernel.sandbox,))
        assert await kernel.eval("_open_result('/dev/nvidia0')") == "ENOENT"
        assert await kernel.eval("_gpu_count()") == 0
        assert [(e.kind, e.pid, e.restart) for e in sandbox_events[1:]] == [
            (SandboxEventKind.STOPPED, old_pid, True),
            (SandboxEventKind.STARTED, new_pid, True),
        ]

    async def test_a_crashed_kernel_is_restarted_in_a_new_sandbox(
        self, start_kernel: StartKernel, sandbox_events: list[SandboxEvent]
    ) -> None:
        kernel = await start_kernel()
        old_pid = kernel.provisioner.sandbox_pid
        assert old_pid is not None
        old = Remains.of(kernel.sandbox)

        os.kill(old_pid, signal.SIGKILL)  # The restarter notices and restarts the kernel.
        await eventually(
            lambda: kernel.provisioner.sandbox_pid not in (None, old_pid),
            "the kernel runs again",
        )
        await kernel.client.wait_for_ready(timeout=DEADLINE_S)

        await old.assert_gone(live=(kernel.sandbox,))
        assert await kernel.run("print(6 * 7)") == "42\n"
        assert (SandboxEventKind.STOPPED, old_pid, True) in [
            (e.kind, e.pid, e.restart) for e in sandbox_events
        ]

    async def test_shutdown_and_kill_leave_nothing_behind(
        self,
        start_kernel: StartKernel,
        jp_serverapp: ServerApp,
        jp_fetch: Callable[..., Awaitable[Any]],
        sandbox_session: SandboxSession,
        sandbox_events: list[SandboxEvent],
    ) -> None:
        graceful, killed = await start_kernel(), await start_kernel()
        remains = []
        for kernel in (graceful, killed):
            assert kernel.provisioner.sandbox_pid is not None
            HotplugEngine(control_nodes=()).grant(kernel.provisioner.sandbox_pid, [GPU0])
            # A child that left the kernel's session and process group: only the sandbox
            # knows it belongs to the kernel.
            await kernel.run(
                "import subprocess\n"
                "_child = subprocess.Popen(['sleep', '600'], start_new_session=True)"
            )
            remains.append(Remains.of(kernel.sandbox))
            # The sandbox's outer process and init, the kernel and its child.
            assert len(remains[-1].processes) == 4

        await jp_fetch(
            "api", "kernels", graceful.kernel_id, method="DELETE", request_timeout=DEADLINE_S
        )
        await jp_serverapp.kernel_manager.shutdown_kernel(  # type: ignore[no-untyped-call]
            killed.kernel_id, now=True
        )

        for left in remains:
            await left.assert_gone()
        assert sandbox_session.leftover_cgroups() == []
        stopped = [(e.kind, e.sandbox, e.restart) for e in sandbox_events[2:]]
        assert stopped == [(SandboxEventKind.STOPPED, r.name, False) for r in remains]

    async def test_server_shutdown_stops_every_sandbox(
        self,
        start_kernel: StartKernel,
        jp_serverapp: ServerApp,
        sandbox_session: SandboxSession,
    ) -> None:
        kernels = [await start_kernel(), await start_kernel()]
        remains = [Remains.of(kernel.sandbox) for kernel in kernels]

        await jp_serverapp.cleanup_kernels()  # What the server does when it exits.

        for left in remains:
            await left.assert_gone()
        assert sandbox_session.leftover_cgroups() == []

    async def test_interrupt_reaches_the_kernel(
        self, start_kernel: StartKernel, jp_fetch: Callable[..., Awaitable[Any]]
    ) -> None:
        kernel = await start_kernel()
        msg_id = kernel.client.execute(
            "print('sleeping', flush=True); import time; time.sleep(600)"
        )
        while True:  # Interrupt only once the code runs, or there is nothing to interrupt.
            message = await kernel.client.get_iopub_msg(timeout=DEADLINE_S)
            if message["parent_header"].get("msg_id") == msg_id and (
                message["msg_type"] == "stream" and "sleeping" in message["content"]["text"]
            ):
                break
        # The stream message leaves before ``print`` returns: a SIGINT then may land in
        # ipykernel's own flush instead of the user's code this test interrupts (a CI run's
        # next cell failed after one). Wait until the kernel sleeps in ``time.sleep``.
        await eventually(lambda: _sleeping(kernel.sandbox), "the kernel sleeps")

        await jp_fetch(
            "api",
            "kernels",
            kernel.kernel_id,
            "interrupt",
            method="POST",
            body="",
            request_timeout=DEADLINE_S,
        )

        reply = await kernel.client.get_shell_msg(timeout=DEADLINE_S)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert (reply["content"]["status"], reply["content"]["ename"]) == (
            "error",
            "KeyboardInterrupt",
        )
        # The interrupt ends the cell with an error, and ipykernel aborts the requests that reach
        # it before it is done with that error: its own "stop aborting" message races this
        # request, and under load this one can come first (a CI run's did). Aborted is not dead.
        assert await kernel.run("print('alive')", aborted_tries=2) == "alive\n"


@needs_root
@pytest.mark.slow
class TestSelectedByKernelspec:
    @pytest.fixture
    def server_defaults_to_sandbox(self) -> bool:
        return False

    async def test_only_kernels_of_the_sandboxed_kernelspec_get_a_sandbox(
        self,
        start_kernel: StartKernel,
        jp_kernel_dir: Path,
        sandbox_session: SandboxSession,
        fake_nvml_node: FakeNvmlNode,
    ) -> None:
        config = {
            "name_prefix": NAME_PREFIX,
            "cgroup_parent": sandbox_session.cgroup_parent,
            "extra_env": _fake_nvml_extra_env(fake_nvml_node),
        }
        write_sandboxed_kernelspec(jp_kernel_dir, "boxed", spec=sandboxed_kernelspec(config=config))

        boxed = await start_kernel("boxed")
        plain = await start_kernel("python3")

        assert set(await boxed.eval("_os.listdir('/dev')")) == BASIC_DEV
        assert await boxed.eval("_os.readlink('/proc/self/ns/mnt')") != os.readlink(
            "/proc/self/ns/mnt"
        )
        plain_provisioner = plain.server.kernel_manager.get_kernel(plain.kernel_id).provisioner
        assert type(plain_provisioner) is LocalProvisioner
        assert await plain.eval("_os.readlink('/proc/self/ns/mnt')") == os.readlink(
            "/proc/self/ns/mnt"
        )


# ---- the provisioner alone: failures and cancellation (root) -----------------------------


@pytest.fixture
def bare_provisioner(sandbox_session: SandboxSession) -> Iterator[SandboxedKernelProvisioner]:
    """A provisioner without a kernel manager, placed below this run's cgroup parent."""
    provisioner = SandboxedKernelProvisioner(
        kernel_id="bare", name_prefix=NAME_PREFIX, cgroup_parent=sandbox_session.cgroup_parent
    )
    yield provisioner
    if provisioner.sandbox is not None:
        provisioner.sandbox.stop()


@needs_root
async def test_sandbox_pid_names_the_running_kernel_only(
    bare_provisioner: SandboxedKernelProvisioner,
    sandbox_session: SandboxSession,
    sandbox_events: list[SandboxEvent],
) -> None:
    await bare_provisioner.launch_kernel(["sleep", "600"], env={})
    sandbox = bare_provisioner.sandbox
    assert sandbox is not None and bare_provisioner.sandbox_pid == sandbox.pid
    assert await bare_provisioner.poll() is None

    os.kill(sandbox.pid, signal.SIGKILL)  # The kernel dies on its own.
    assert await bare_provisioner.wait() == -signal.SIGKILL

    assert bare_provisioner.sandbox_pid is None  # Nothing to attach a GPU to...
    assert not bare_provisioner.has_process
    await bare_provisioner.send_signal(signal.SIGINT)  # ...nor to signal.
    assert bare_provisioner.sandbox is sandbox  # Its cgroups stay until the clean-up.
    await bare_provisioner.cleanup()

    assert bare_provisioner.sandbox is None
    assert sandbox_session.leftover_cgroups() == []
    assert [(e.kind, e.pid, e.restart) for e in sandbox_events] == [
        (SandboxEventKind.STARTED, sandbox.pid, False),
        (SandboxEventKind.STOPPED, sandbox.pid, False),
    ]


@needs_root
async def test_a_failed_launch_leaves_nothing_behind(
    bare_provisioner: SandboxedKernelProvisioner, sandbox_session: SandboxSession
) -> None:
    with pytest.raises(KernelSandboxStartError, match="exec") as failure:
        await bare_provisioner.launch_kernel(["/nonexistent/kernel"], env={"PATH": "/usr/bin"})

    assert failure.value.__cause__ is not None
    assert bare_provisioner.sandbox is None
    assert sandbox_session.leftover_cgroups() == []


@needs_root
async def test_a_cancelled_launch_leaves_nothing_behind(
    bare_provisioner: SandboxedKernelProvisioner, sandbox_session: SandboxSession
) -> None:
    launch = asyncio.ensure_future(bare_provisioner.launch_kernel(["sleep", "600"], env={}))
    await asyncio.sleep(0)  # Into the worker thread: the start cannot be interrupted there.
    launch.cancel()

    with pytest.raises(asyncio.CancelledError):
        await launch

    assert bare_provisioner.sandbox is None
    assert sandbox_session.leftover_cgroups() == []


#: Run by a child "server" that starts a sandbox and dies without stopping it.
_CRASHING_OWNER = """
import os, subprocess, sys
from jupyter_gpu_hotplug.linux.sandbox.runtime import Sandbox, SandboxSpec
spec = SandboxSpec(("sleep", "600"), name_prefix=sys.argv[1], cgroup_parent=sys.argv[2])
quiet = subprocess.DEVNULL
sandbox = Sandbox.start(spec, stdin=quiet, stdout=quiet, stderr=quiet)
print(sandbox.name, sandbox.pid, flush=True)
os._exit(0)
"""


@needs_root
async def test_a_launch_removes_the_sandboxes_of_a_dead_server(
    bare_provisioner: SandboxedKernelProvisioner, sandbox_session: SandboxSession
) -> None:
    crashed = subprocess.run(
        [sys.executable, "-c", _CRASHING_OWNER, NAME_PREFIX, sandbox_session.cgroup_parent],
        check=True,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    name, pid_text = crashed.stdout.split()
    orphan = int(pid_text)
    sandbox_session.track(orphan)
    orphan_start = process_start_time(orphan)
    assert orphan_start is not None
    assert {d.name for d in sandbox_session.leftover_cgroups()} == {name}

    await bare_provisioner.launch_kernel(["sleep", "600"], env={})

    assert bare_provisioner.sandbox is not None
    assert {d.name for d in sandbox_session.leftover_cgroups()} == {bare_provisioner.sandbox.name}
    assert not process_running(orphan, orphan_start)
