"""Local mode's kernel provisioner: every Jupyter kernel in a container-like sandbox of its own.

Boundary: the ``jupyter_client`` kernel life cycle (launch, poll, signal, kill, clean up,
restart) mapped onto :class:`~jupyter_gpu_hotplug.linux.sandbox.runtime.Sandbox`. It knows nothing
of the agent or of GPUs: it gives each kernel a private mount namespace with its own
``/dev`` and device cgroups that deny every GPU, and it says which process a kernel is.

Why it exists: in local mode "attach a GPU to this notebook" must mean what it means for a
Kubernetes container — allow the device in the target's cgroups and create its node in the
target's ``/dev`` — so that one kernel gets the GPU and its neighbours do not. A plain local
kernel shares the server's ``/dev`` and cgroups with every other kernel; a sandboxed one is
a separate target the agent resolves by pid (``resolver=pid``).

Selecting it (the entry point name is :data:`PROVISIONER_NAME`):

* per kernel: a kernelspec whose ``metadata.kernel_provisioner.provisioner_name`` is
  ``gpu-hotplug-sandbox-provisioner`` (:func:`sandboxed_kernelspec` makes one and
  :func:`write_sandboxed_kernelspec` installs it; its ``config`` sets this class's traits
  for that kernelspec's kernels);
* for every kernel without a ``kernel_provisioner`` stanza:
  ``c.KernelProvisionerFactory.default_provisioner_name = "gpu-hotplug-sandbox-provisioner"``
  (:func:`sandboxed_kernels_config` returns that, plus the traits, as a ``Config``).

Traits are set with ``c.SandboxedKernelProvisioner.<name>``; a kernelspec's provisioner
``config`` overrides them for its kernels.

The server extension finds a kernel's target with
``kernel_manager.get_kernel(kernel_id).provisioner.sandbox_pid``.

Restarts and GPUs: a restart is a shutdown (the old sandbox is stopped: processes, cgroups
and its device program gone) followed by a launch in a *new* sandbox with a new pid. By
default nothing carries GPUs over: the agent's reconciler sees that the old target pid is
gone and releases its GPUs, and the new kernel starts with none. Code that wants another
policy (re-attach to the new pid, release at once) subscribes to
:data:`~.events.KERNEL_SANDBOX_EVENTS`, which announces ``started`` and ``stopped``
for every sandbox, each with the kernel id, the pid and whether it is part of a restart.

Leftovers: the server's normal shutdown shuts every kernel down, which stops its sandbox.
Sandboxes of a server that crashed are removed by the next launch with the same name prefix
and cgroup parent (:func:`~jupyter_gpu_hotplug.linux.sandbox.runtime.cleanup_stale`: only those
whose owning server process is gone, so two servers sharing a prefix never touch each other's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, ClassVar, Final

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.local_provisioner import LocalProvisioner
from traitlets import Bool, Dict, Enum, Float, List, TraitError, Unicode, validate
from traitlets.config import Config

from ..linux.sandbox.runtime import (
    DEFAULT_CGROUP_PARENT,
    DEFAULT_HIDDEN,
    Backend,
    Sandbox,
    SandboxError,
    SandboxSpec,
    SandboxStopError,
    cleanup_stale,
)
from .events import KERNEL_SANDBOX_EVENTS, SandboxEvent, SandboxEventKind, SandboxEvents

__all__ = [
    "DEFAULT_KERNELSPEC_NAME",
    "PROVISIONER_NAME",
    "KernelSandboxError",
    "KernelSandboxStartError",
    "KernelSandboxStopError",
    "SandboxedKernelProvisioner",
    "sandboxed_kernels_config",
    "sandboxed_kernelspec",
    "write_sandboxed_kernelspec",
]

log = logging.getLogger(__name__)

PROVISIONER_NAME: Final = "gpu-hotplug-sandbox-provisioner"
"""Our name in the ``jupyter_client.kernel_provisioners`` entry point group."""

DEFAULT_KERNELSPEC_NAME: Final = "python3-gpu-sandbox"
"""Directory name :func:`write_sandboxed_kernelspec` uses unless told otherwise."""

DEFAULT_NAME_PREFIX: Final = "jupyter-kernel"
DEFAULT_KERNEL_CGROUP_PARENT: Final = f"{DEFAULT_CGROUP_PARENT}/jupyter-kernels"

#: How often :meth:`SandboxedKernelProvisioner.wait` looks at the kernel (LocalProvisioner's).
_WAIT_INTERVAL: Final = 0.1

#: Serialises the stale-sandbox sweep: kernels launched together must not both kill and
#: remove the same leftover cgroups.
_SWEEP_LOCK: Final = threading.Lock()

_STDIO: Final = ("stdin", "stdout", "stderr")
#: What ``jupyter_client`` may pass to ``launch_kernel``: used here, or (``kernel_id``,
#: ``extra_arguments``, already part of the command) not needed. Anything else is a
#: ``Popen`` option that a sandbox cannot honour, and is refused rather than dropped.
_LAUNCH_ARGS: Final = frozenset(
    {"env", "cwd", "independent", *_STDIO, "kernel_id", "extra_arguments"}
)


class KernelSandboxError(RuntimeError):
    """Base of this module's errors; the sandbox module's error is chained."""


class KernelSandboxStartError(KernelSandboxError):
    """The kernel's sandbox could not be created; nothing of it is left behind."""


class KernelSandboxStopError(KernelSandboxError):
    """The kernel's sandbox could not be removed (processes survived SIGKILL, a cgroup stuck)."""


class SandboxedKernelProvisioner(LocalProvisioner):
    """Starts each kernel in its own sandbox; see the module docstring for how to select it.

    The kernel process is the sandbox's first process (the bootstrap ``exec``s it), so
    :attr:`sandbox_pid` is both the kernel's pid and the agent's target. Signals go to the
    kernel's process group, as with ``LocalProvisioner``; :meth:`kill` ends *every* process
    in the sandbox; :meth:`cleanup` removes the sandbox.
    """

    events: ClassVar[SandboxEvents] = KERNEL_SANDBOX_EVENTS
    """Where this class's kernels announce their sandboxes (see :mod:`.events`)."""

    extra_env = Dict(
        key_trait=Unicode(),
        value_trait=Unicode(),
        help="""Environment variables added to every sandboxed kernel's environment.

        Applied last, over the server's environment and the kernelspec's ``env``. The
        simulated-GPU demo passes the fake NVML here (``LD_LIBRARY_PATH``,
        ``FAKE_NVML_CONFIG``, ``FAKE_NVML_DEVICE_FILTER=/dev``).""",
    ).tag(config=True)

    name_prefix = Unicode(
        DEFAULT_NAME_PREFIX,
        help="""First part of each sandbox's cgroup name (letters, digits, ``_``, ``-``).

        Leftovers of a crashed server are found by this prefix and the cgroup parent.""",
    ).tag(config=True)

    cgroup_parent = Unicode(
        DEFAULT_KERNEL_CGROUP_PARENT,
        help="""Relative path, below each cgroup hierarchy's mount point, of the cgroup that
        holds the kernel sandboxes.""",
    ).tag(config=True)

    backends = List(
        Enum([b.value for b in Backend]),
        help="""Device-cgroup mechanisms to confine kernels with: ``v1`` (the ``devices``
        controller) and/or ``v2`` (an eBPF device program). Empty: every one this host has,
        as runc does; naming one the host lacks makes kernel launches fail.""",
    ).tag(config=True)

    nvidia_control_nodes = Bool(
        True,
        help="""Give each sandbox the host's NVIDIA control nodes (``nvidiactl``,
        ``nvidia-uvm``...) if the host has them, like a container with
        ``NVIDIA_VISIBLE_DEVICES=none``. GPUs themselves are never given at launch.""",
    ).tag(config=True)

    hidden_paths = List(
        Unicode(),
        default_value=list(DEFAULT_HIDDEN),
        help="""Host paths a kernel never sees: each is covered by an empty read-only tmpfs (a
        file by an empty file) in the sandbox. The default hides the agent's default state
        directory; a server beside an agent with another ``--state-dir`` must name that one too,
        or its kernels (root, with Docker's default capabilities, which include
        ``CAP_DAC_OVERRIDE``) can read the agent's token and ledger.""",
    ).tag(config=True)

    start_timeout = Float(
        30.0,
        help="Seconds the sandbox may take to be set up before the launch fails.",
    ).tag(config=True)

    stop_timeout = Float(
        5.0,
        help="""Seconds the processes left in a stopped kernel's sandbox get after SIGTERM
        before they are killed.""",
    ).tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sandbox: Sandbox | None = None
        self._reaped = False
        self._launched = 0

    @validate("name_prefix", "cgroup_parent")
    def _validate_placement(self, proposal: dict[str, Any]) -> str:
        value = proposal["value"]
        try:  # The sandbox module owns the rules; ask it rather than repeat them.
            SandboxSpec(("kernel",), **{proposal["trait"].name: value})
        except ValueError as e:
            raise TraitError(str(e)) from e
        return str(value)

    # ---- what the server extension reads -------------------------------------------------

    @property
    def sandbox(self) -> Sandbox | None:
        """The kernel's sandbox until :meth:`cleanup` removes it."""
        return self._sandbox

    @property
    def sandbox_pid(self) -> int | None:
        """The kernel's pid, the GPU target, while the kernel runs; ``None`` before the
        launch, once the kernel has exited (a crash, a shutdown) and during a restart."""
        sandbox = self._sandbox
        return None if sandbox is None or sandbox.poll() is not None else sandbox.pid

    # ---- launching -----------------------------------------------------------------------

    def _finalize_env(self, env: dict[str, str]) -> None:
        env.update(self.extra_env)
        super()._finalize_env(env)

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Start ``cmd`` in a new sandbox, in ``kwargs["cwd"]`` with ``kwargs["env"]``."""
        spec = self._spec(cmd, kwargs)
        stdio = {name: kwargs.get(name) for name in _STDIO}
        stdio["stdin"] = subprocess.DEVNULL if stdio["stdin"] is None else stdio["stdin"]
        sandbox = await _owned_result(
            asyncio.to_thread(self._start_sandbox, spec, stdio), release=_discard
        )
        restart = self._launched > 0
        self._sandbox, self._reaped = sandbox, False
        self._launched += 1
        self.pid = self.pgid = sandbox.pid  # A session leader: its own process group.
        self.cwd = spec.cwd or os.getcwd()
        self.log.info(
            "kernel %s runs in sandbox %s (pid %d)", self.kernel_id, sandbox.name, sandbox.pid
        )
        await self.events.emit(self._event(SandboxEventKind.STARTED, sandbox, restart=restart))
        return self.connection_info

    def _spec(self, cmd: Sequence[str], kwargs: Mapping[str, Any]) -> SandboxSpec:
        unsupported = set(kwargs) - _LAUNCH_ARGS
        if unsupported:
            raise KernelSandboxStartError(
                f"launch options {sorted(unsupported)} are not supported in a kernel sandbox"
            )
        env = dict(kwargs.get("env") or os.environ)
        # ipykernel's own parent poller cannot work in a sandbox (its parent there is the
        # sandbox's init, pid 1, which it takes for "orphaned"): the sandbox itself ends with
        # this process instead, unless the kernel is to be independent of it.
        env.pop("JPY_PARENT_PID", None)
        cwd = kwargs.get("cwd")
        return SandboxSpec(
            tuple(os.path.expanduser(arg) for arg in cmd),
            env=env,
            cwd=None if cwd is None else os.fspath(cwd),
            backends=frozenset(Backend(b) for b in self.backends) or None,
            nvidia_control_nodes=self.nvidia_control_nodes,
            name_prefix=self.name_prefix,
            cgroup_parent=self.cgroup_parent,
            hidden=tuple(self.hidden_paths),
            end_with_owner=not kwargs.get("independent", False),
        )

    def _start_sandbox(self, spec: SandboxSpec, stdio: Mapping[str, Any]) -> Sandbox:
        """Runs in a worker thread: both steps can block for seconds."""
        self._sweep_stale()
        try:
            return Sandbox.start(spec, timeout=self.start_timeout, **stdio)
        except SandboxError as e:
            raise KernelSandboxStartError(
                f"cannot start kernel {self.kernel_id} in a sandbox: {e}"
            ) from e

    def _sweep_stale(self) -> None:
        """Remove sandboxes a crashed server left under our prefix and parent. A failure
        is logged and the launch goes on: leftovers must not keep new kernels from running."""
        with _SWEEP_LOCK:
            try:
                removed = cleanup_stale(self.name_prefix, cgroup_parent=self.cgroup_parent)
            except SandboxError:
                self.log.exception("could not remove the kernel sandboxes of a dead server")
                return
        if removed:
            self.log.warning("removed kernel sandboxes left by a dead server: %s", removed)

    # ---- the process -----------------------------------------------------------------------

    @property
    def has_process(self) -> bool:
        return self._sandbox is not None and not self._reaped

    async def poll(self) -> int | None:
        return 0 if self._sandbox is None else self._sandbox.poll()

    async def wait(self) -> int | None:
        """Wait for the kernel process to exit (the caller bounds this with a timeout).

        Other processes of the sandbox may live on; :meth:`cleanup` ends them.
        """
        sandbox = self._sandbox
        if sandbox is None:
            return 0
        while (status := sandbox.poll()) is None:
            await asyncio.sleep(_WAIT_INTERVAL)
        self._reaped = True
        return status

    async def send_signal(self, signum: int) -> None:
        """Signal the kernel's process group (the kernel and the children it did not move
        to a group of their own), as ``LocalProvisioner`` does; a no-op once it exited."""
        sandbox = self._sandbox
        # Only while the leader is unreaped: its pid, and so the group id, cannot be reused.
        if sandbox is None or sandbox.poll() is not None:
            return
        try:
            os.killpg(sandbox.pid, signum)
        except ProcessLookupError:
            return  # Exited since the poll.

    async def terminate(self, restart: bool = False) -> None:
        await self.send_signal(signal.SIGTERM)

    async def kill(self, restart: bool = False) -> None:
        """Kill every process in the sandbox, the kernel's whole process tree included
        (also children that started a session of their own), and remove its cgroups."""
        sandbox = self._sandbox
        if sandbox is None:
            return
        try:
            await asyncio.to_thread(sandbox.stop, 0.0)
        except SandboxStopError as e:
            raise KernelSandboxStopError(f"cannot kill kernel {self.kernel_id}: {e}") from e

    async def cleanup(self, restart: bool = False) -> None:
        """Stop the sandbox: SIGTERM to what is left, SIGKILL after :attr:`stop_timeout`,
        cgroups (and with them the device program) removed; then announce ``stopped``."""
        sandbox = self._sandbox
        try:
            if sandbox is not None:
                try:
                    await asyncio.to_thread(sandbox.stop, self.stop_timeout)
                except SandboxStopError as e:
                    raise KernelSandboxStopError(
                        f"cannot remove the sandbox of kernel {self.kernel_id}: {e}"
                    ) from e
                _close_pipes(sandbox)
                self._sandbox = None
                self.log.info("kernel %s: sandbox %s removed", self.kernel_id, sandbox.name)
                await self.events.emit(
                    self._event(SandboxEventKind.STOPPED, sandbox, restart=restart)
                )
        finally:
            await super().cleanup(restart=restart)

    def _event(self, kind: SandboxEventKind, sandbox: Sandbox, *, restart: bool) -> SandboxEvent:
        return SandboxEvent(
            kind=kind,
            kernel_id=self.kernel_id,
            pid=sandbox.pid,
            sandbox=str(sandbox.name),
            restart=restart,
        )


async def _owned_result(
    work: Awaitable[Sandbox], *, release: Callable[[Sandbox], Awaitable[None]]
) -> Sandbox:
    """``await work``, but if the caller is cancelled meanwhile, let the work finish and
    ``release`` what it made: a thread cannot be cancelled, and a sandbox nobody holds
    would outlive the kernel."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            made = await task
        except Exception as e:  # It failed on its own and removed what it had made.
            log.warning("a cancelled sandbox start failed as well: %s", e)
        else:
            try:
                await release(made)
            except Exception:
                log.exception("could not stop sandbox %s after its launch was cancelled", made.name)
        raise


async def _discard(sandbox: Sandbox) -> None:
    try:
        await asyncio.to_thread(sandbox.stop, 0.0)
    finally:
        _close_pipes(sandbox)


def _close_pipes(sandbox: Sandbox) -> None:
    pipes: tuple[IO[bytes] | None, ...] = (sandbox.stdin, sandbox.stdout, sandbox.stderr)
    for pipe in pipes:
        if pipe is not None:
            pipe.close()


# ---- selecting the provisioner ---------------------------------------------------------------


def sandboxed_kernelspec(
    *,
    display_name: str = "Python 3 (GPU sandbox)",
    argv: Sequence[str] | None = None,
    language: str = "python",
    env: Mapping[str, str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``kernel.json`` document for a kernel that runs in a sandbox.

    ``argv`` defaults to ipykernel in this interpreter; ``config`` sets
    :class:`SandboxedKernelProvisioner` traits for this kernelspec's kernels only
    (``{"extra_env": {...}}``).
    """
    command = (
        [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        if argv is None
        else list(argv)
    )
    return {
        "argv": command,
        "display_name": display_name,
        "language": language,
        "interrupt_mode": "signal",
        "env": dict(env or {}),
        "metadata": {
            "kernel_provisioner": {
                "provisioner_name": PROVISIONER_NAME,
                "config": dict(config or {}),
            }
        },
    }


def write_sandboxed_kernelspec(
    kernels_dir: Path,
    name: str = DEFAULT_KERNELSPEC_NAME,
    *,
    spec: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``spec`` (default: :func:`sandboxed_kernelspec`) as
    ``kernels_dir/<name>/kernel.json`` and return that kernelspec directory.

    ``kernels_dir`` is a ``kernels`` directory on Jupyter's data path, e.g.
    ``<sys.prefix>/share/jupyter/kernels`` or ``jupyter_core.paths.jupyter_data_dir()``'s.
    """
    directory = kernels_dir / name
    directory.mkdir(parents=True, exist_ok=True)
    document = sandboxed_kernelspec() if spec is None else dict(spec)
    (directory / "kernel.json").write_text(json.dumps(document, indent=1))
    return directory


def sandboxed_kernels_config(
    *,
    extra_env: Mapping[str, str] | None = None,
    name_prefix: str | None = None,
    cgroup_parent: str | None = None,
    also_hidden: Sequence[str] = (),
) -> Config:
    """Server configuration that sandboxes every kernel whose kernelspec names no
    provisioner of its own; merge it into the server's ``Config``. ``also_hidden``: host
    paths kernels must not see besides the default ones (an agent's state directory)."""
    config = Config()
    config.KernelProvisionerFactory.default_provisioner_name = PROVISIONER_NAME
    traits: dict[str, Any] = {
        "extra_env": None if extra_env is None else dict(extra_env),
        "name_prefix": name_prefix,
        "cgroup_parent": cgroup_parent,
        "hidden_paths": [*DEFAULT_HIDDEN, *also_hidden] if also_hidden else None,
    }
    for trait, value in traits.items():
        if value is not None:
            config.SandboxedKernelProvisioner[trait] = value
    return config
