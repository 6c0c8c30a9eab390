"""Run the demo: agent up, JupyterLab up, wait for Ctrl-C or a child's death, take it all down.

Boundary: process orchestration and what the terminal shows. The pieces it wires are owned
elsewhere — the agent (``jupyter_gpu_hotplug.agent.app``, started as a child), the sandbox
provisioner and server extension (configured through ``labconfig``), the fake NVML
(``nvml.sim``). Nothing here touches cgroups or devices, with one exception kept on purpose:
after JupyterLab has gone, kernel sandboxes it could not remove (it was killed) are swept with
the sandbox module's own ``cleanup_stale``.

Order matters, and is the reason this module exists:

- start: refuse early (``preflight``), pick real or simulated GPUs, start the agent and wait
  until it answers, then start JupyterLab and wait until it serves;
- stop (Ctrl-C, SIGTERM, SIGHUP, or a child dying): stop JupyterLab first — it shuts its
  kernels down, which removes their sandboxes — then have the agent release the GPUs of the
  kernels that are gone (a reconciliation pass, asked for with SIGHUP, watched through the
  API until every GPU is free), and only then stop the agent. Stopping the agent earlier would
  leave attachments in its ledger.

Exit codes: 0 after a requested stop, 1 when anything failed (the message says what, and the
demo directory is kept for its logs).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import signal
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
import webbrowser
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Final, TextIO, TypeVar

from ..client import AgentClientError, AsyncAgentClient, Gpu, RetryPolicy, Timeouts
from .children import ChildProcess
from .errors import ChildDied, DemoError, DemoStartError
from .gpus import GpuMode, choose_gpu_mode, probe_real_gpus
from .labconfig import (
    SANDBOX_NAME_PREFIX,
    LabSettings,
    SimulatedNvml,
    lab_url,
    server_environment,
    write_lab_files,
)
from .layout import DemoLayout
from .options import DemoOptions
from .preflight import preflight

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "RECONCILE_INTERVAL",
    "DemoRun",
    "cli_command",
    "open_browser",
    "run",
]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1

RECONCILE_INTERVAL: Final = 2.0
"""Seconds between the demo agent's reconciliations: a restarted kernel's old GPUs come back
within about this long (the provisioner gives a restarted kernel a new sandbox and pid)."""
NVLINK_GPUS: Final = 1
"""Simulated GPUs (from GPU 0) with NVLinks: the others are PCIe-only, so the panel shows an
NVLink chart under one GPU and not under another, as on a mixed node."""
AGENT_READY_TIMEOUT: Final = 60.0
LAB_READY_TIMEOUT: Final = 120.0
LAB_STOP_TIMEOUT: Final = 60.0
"""JupyterLab stops each kernel's sandbox (SIGTERM, then SIGKILL after 5 s) before it exits."""
RELEASE_TIMEOUT: Final = 30.0
AGENT_STOP_TIMEOUT: Final = 45.0
"""The agent lets operations in flight finish for up to 30 s."""
_POLL: Final = 0.2
_PREFIX: Final = "gpu-hotplug demo:"
_RULE: Final = "=" * 78
_STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_READY_TEXT: Final = """
  JupyterLab is ready (started in {elapsed:.1f} s). Open the starter notebook:

      {url}

  Every kernel runs in a sandbox of its own, without GPUs; '%gpu attach 1' in a
  notebook hot-plugs one into the running kernel. Restarting a kernel releases
  its GPUs (the new kernel starts without).
  Notebooks are saved, and kept when the demo stops, in:
      {notebooks}
  To ask the demo's agent from another terminal (as root):
      {cli}
  Demo state and logs{removed}: {root}
  Press Ctrl-C to stop: JupyterLab, its kernels and the agent stop, and every
  GPU is released.
"""
_T = TypeVar("_T")


class _Interrupted(Exception):
    """A stop signal arrived while the demo was waiting for something."""


class DemoRun:
    """One run of the demo; :meth:`main` does it all and returns the exit code."""

    def __init__(
        self,
        options: DemoOptions,
        layout: DemoLayout,
        *,
        owns_root: bool,
        out: TextIO = sys.stdout,
        err: TextIO = sys.stderr,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.layout = layout
        self.owns_root = owns_root
        self._out = out
        self._err = err
        self._clock = clock
        self._started_at = clock()
        self._stop = asyncio.Event()
        self._stop_signal: str | None = None
        self._children: dict[str, tuple[ChildProcess, asyncio.Task[int]]] = {}
        self.agent: ChildProcess | None = None
        self.lab: ChildProcess | None = None
        self._agent_client = AsyncAgentClient(
            layout.agent_url,
            timeouts=Timeouts(connect=2.0, read=10.0),
            retry=RetryPolicy(attempts=1),
        )

    # ---- output ----------------------------------------------------------------------------

    def say(self, text: str) -> None:
        print(f"{_PREFIX} {text}", file=self._out, flush=True)

    def complain(self, text: str) -> None:
        print(f"{_PREFIX} {text}", file=self._err, flush=True)

    def show(self, text: str) -> None:
        print(text, file=self._out, flush=True)

    # ---- the whole run ---------------------------------------------------------------------

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in _STOP_SIGNALS:
            loop.add_signal_handler(signum, self._on_signal, signum)
        failed = False
        try:
            await self._start_and_serve()
        except _Interrupted:
            pass
        except DemoError as e:
            failed = True
            self.complain(str(e))
        finally:
            clean = await self._shutdown()
            for signum in _STOP_SIGNALS:
                loop.remove_signal_handler(signum)
        self._finish(clean=clean and not failed)
        return EXIT_OK if clean and not failed else EXIT_FAILED

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._stop.is_set():
            self.say(f"{name}: already stopping; waiting until every GPU is released")
            return
        self._stop_signal = name
        self._stop.set()

    async def _start_and_serve(self) -> None:
        try:
            self.layout.prepare()
        except OSError as e:
            raise DemoStartError(
                f"cannot create the demo's files in {self.layout.root}: {e}"
            ) from e
        mode = await self._race(self._gpu_mode())
        nvml = await self._race(self._kernel_nvml(mode))
        gpus = await self._start_agent(mode)
        self._show_gpus(mode, gpus)
        settings = LabSettings(
            ip=self.options.ip,
            port=self.options.port,
            token=secrets.token_hex(24),
            layout=self.layout,
            nvml=nvml,
        )
        await self._start_lab(settings)
        url = lab_url(settings)
        self._show_ready(url)
        if self.options.open_browser:
            await self._open_browser(url)
        await self._race(self._stop.wait())

    # ---- waiting, interrupted by signals and children's deaths ------------------------------

    async def _race(self, work: Awaitable[_T]) -> _T:
        """``await work``, unless a stop signal or a child's exit comes first."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stop.wait())
        exits = {watch: child for child, watch in self._children.values()}
        try:
            done, _ = await asyncio.wait({task, stop, *exits}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancelled(stop)
        if task in done:
            return task.result()
        await _cancelled(task)
        for watch in done & exits.keys():
            child = exits[watch]
            raise ChildDied(self._death_message(child))
        raise _Interrupted

    def _death_message(self, child: ChildProcess) -> str:
        tail = child.log_tail()
        shown = f"; the end of its log ({child.log_path}):\n{tail}" if tail else ""
        return f"the {child.name} {child.describe_exit()} unexpectedly{shown}"

    async def _spawn(
        self,
        name: str,
        argv: list[str],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> ChildProcess:
        try:
            child = await ChildProcess.start(name, argv, log_path=log_path, env=env, cwd=cwd)
        except OSError as e:
            raise DemoStartError(f"cannot start the {name} ({argv[0]}): {e.strerror}") from e
        self._children[name] = (child, asyncio.ensure_future(child.wait()))
        return child

    # ---- GPUs --------------------------------------------------------------------------------

    async def _gpu_mode(self) -> GpuMode:
        requested = self.options.simulate
        if requested is not None and requested > 0:
            return choose_gpu_mode(requested, None)
        self.say("looking for NVIDIA GPUs (asking NVML)...")
        return choose_gpu_mode(requested, await asyncio.to_thread(probe_real_gpus))

    async def _kernel_nvml(self, mode: GpuMode) -> SimulatedNvml | None:
        """The fake NVML the kernels load when the GPUs are simulated (built once, cached)."""
        if not mode.simulated:
            return None
        from ..nvml.sim import FakeNvmlError, ensure_fake_nvml
        from ..nvml.sim.smi import write_command

        try:
            library = await asyncio.to_thread(ensure_fake_nvml, self.layout.nvml_cache)
        except FakeNvmlError as e:
            raise DemoStartError(f"cannot build the simulated NVML library: {e}") from e
        await asyncio.to_thread(write_command, self.layout.simulation_tools)
        return SimulatedNvml(
            library_dir=library,
            config_path=self.layout.simulation_config,
            tools_dir=self.layout.simulation_tools,
        )

    # ---- the agent ---------------------------------------------------------------------------

    def _agent_argv(self, mode: GpuMode) -> list[str]:
        """The demo's agent: its node sweep judges the demo's kernel sandboxes only (the
        host's other containers are not the demo's to report or take from)."""
        from ..sandboxes.provisioner import DEFAULT_KERNEL_CGROUP_PARENT

        layout = self.layout
        argv = [
            sys.executable,
            "-m",
            "jupyter_gpu_hotplug.agent.app",
            "--backend=local",
            f"--state-dir={layout.agent_state}",
            f"--listen=unix:{layout.agent_socket}",
            f"--reconcile-interval={RECONCILE_INTERVAL:g}",
            f"--sweep-cgroup=/{DEFAULT_KERNEL_CGROUP_PARENT}",
        ]
        if mode.simulated:
            argv += [
                f"--simulate={mode.simulate}",
                f"--simulate-nvlink={min(NVLINK_GPUS, mode.simulate)}",
                f"--simulation-dir={layout.simulation_dir}",
            ]
        return argv

    async def _start_agent(self, mode: GpuMode) -> tuple[Gpu, ...]:
        what = f"{mode.simulate} SIMULATED GPUs" if mode.simulated else "the real GPUs"
        self.say(f"{mode.reason}; starting the node agent (local mode, {what})...")
        self.agent = await self._spawn(
            "node agent", self._agent_argv(mode), log_path=self.layout.agent_log
        )
        await self._race(self._wait_for_agent())
        try:
            return await self._race(self._agent_client.gpus())
        except AgentClientError as e:
            raise DemoStartError(f"the node agent does not list its GPUs: {e.message}") from e

    async def _wait_for_agent(self) -> None:
        deadline = self._clock() + AGENT_READY_TIMEOUT
        while True:
            try:
                await self._agent_client.health()
            except AgentClientError as e:
                if self._clock() > deadline:
                    raise DemoStartError(
                        f"the node agent did not answer within {AGENT_READY_TIMEOUT:.0f} s "
                        f"({e.message}); see {self.layout.agent_log}"
                    ) from e
                await asyncio.sleep(_POLL)
            else:
                return

    def _show_gpus(self, mode: GpuMode, gpus: tuple[Gpu, ...]) -> None:
        listing = [f"    {gpu.device:<14} {gpu.name}  {gpu.uuid}" for gpu in gpus]
        if mode.simulated:
            text = (
                f"SIMULATED GPUs: {mode.reason}, so the agent serves {len(gpus)} simulated "
                "GPUs. They are hot-plugged for real: each kernel's sandbox gets the device "
                "node with NVIDIA's numbers (c 195:N) and its device cgroup allows it. NVML "
                "in the kernels is a small fake library that reports the GPUs a kernel has "
                "nodes for; no CUDA program can run on them."
            )
            wrapped = textwrap.wrap(text, width=len(_RULE) - 2, break_on_hyphens=False)
            lines = [_RULE, *(f"  {line}" for line in wrapped), *listing, _RULE]
        else:
            lines = [f"{_PREFIX} the agent serves {len(gpus)} GPU(s):", *listing]
        self.show("\n".join(lines))

    async def _release_gpus(self) -> str | None:
        """Have the agent release the GPUs of kernels that are gone; what went wrong, if any.

        SIGHUP asks for a reconciliation pass at once (the periodic one would come anyway);
        the API is then watched until no GPU is attached, or the time is up.
        """
        agent = self.agent
        if agent is None or agent.returncode is not None:
            return "the node agent is not running"
        agent.send_signal(signal.SIGHUP)
        deadline = self._clock() + RELEASE_TIMEOUT
        while True:
            try:
                attached = [g for g in await self._agent_client.gpus() if g.state == "attached"]
            except AgentClientError as e:
                return f"cannot ask the agent which GPUs are still attached: {e.message}"
            if not attached:
                return None
            if self._clock() > deadline:
                return "the agent still counts these GPUs as attached: " + ", ".join(
                    f"{gpu.device} to {gpu.target}" for gpu in attached
                )
            await asyncio.sleep(_POLL)

    # ---- JupyterLab --------------------------------------------------------------------------

    async def _start_lab(self, settings: LabSettings) -> None:
        layout = self.layout
        try:
            layout.install_starter()
            write_lab_files(settings)
        except OSError as e:
            raise DemoStartError(f"cannot write JupyterLab's files in {layout.root}: {e}") from e
        self.say(
            f"starting JupyterLab on {settings.ip}:{settings.port} "
            "(every kernel in its own sandbox, with no GPU)..."
        )
        self.lab = await self._spawn(
            "JupyterLab",
            [sys.executable, "-m", "jupyterlab", f"--config={layout.lab_config}"],
            log_path=layout.lab_log,
            env=server_environment(settings),
            cwd=layout.notebooks,
        )
        await self._race(self._wait_for_lab(settings))

    async def _wait_for_lab(self, settings: LabSettings) -> None:
        url = lab_url(settings, path="api/status").partition("?")[0]
        request = urllib.request.Request(url, headers={"Authorization": f"token {settings.token}"})
        deadline = self._clock() + LAB_READY_TIMEOUT
        while not await asyncio.to_thread(_answers, request):
            if self._clock() > deadline:
                raise DemoStartError(
                    f"JupyterLab did not answer within {LAB_READY_TIMEOUT:.0f} s; "
                    f"see {self.layout.lab_log}"
                )
            await asyncio.sleep(_POLL)

    def _show_ready(self, url: str) -> None:
        elapsed = self._clock() - self._started_at
        removed = " (removed when the demo stops)" if self.owns_root else ""
        self.show(
            _READY_TEXT.format(
                elapsed=elapsed,
                url=url,
                notebooks=self.layout.notebooks,
                cli=cli_command(self.layout),
                root=self.layout.root,
                removed=removed,
            ),
        )

    async def _open_browser(self, url: str) -> None:
        problem = await asyncio.to_thread(open_browser, url)
        if problem is not None:
            self.say(problem)

    # ---- stopping ----------------------------------------------------------------------------

    async def _shutdown(self) -> bool:
        """Stop everything in order; whether everything went away and every GPU is free."""
        clean = True
        if self._stop_signal is not None:
            self.say(f"{self._stop_signal}: stopping")
        lab = self.lab
        if lab is not None:
            if lab.returncode is None:
                self.say("stopping JupyterLab and its kernels (their sandboxes go with them)...")
                code = await lab.stop(timeout=LAB_STOP_TIMEOUT)
                if code not in (0, -signal.SIGTERM):
                    self.complain(f"JupyterLab {lab.describe_exit()}; see {lab.log_path}")
            clean = await self._sweep_sandboxes() and clean
        agent = self.agent
        if agent is not None:
            if agent.returncode is None:
                self.say("releasing GPUs and stopping the node agent...")
                problem = await self._release_gpus()
                if problem is not None:
                    clean = False
                    self.complain(
                        f"{problem}; the agent's ledger in {self.layout.agent_state} keeps "
                        "them, and an agent started again on that state dir releases them"
                    )
                code = await agent.stop(timeout=AGENT_STOP_TIMEOUT)
                if code != 0:
                    clean = False
                    self.complain(f"the node agent {agent.describe_exit()}; see {agent.log_path}")
            else:
                clean = False
        for _, watch in self._children.values():
            watch.cancel()
        return clean

    async def _sweep_sandboxes(self) -> bool:
        """Remove demo kernel sandboxes that JupyterLab left (only if it was killed)."""
        from ..linux.sandbox.runtime import SandboxError, cleanup_stale
        from ..sandboxes.provisioner import DEFAULT_KERNEL_CGROUP_PARENT

        try:
            removed = await asyncio.to_thread(
                cleanup_stale, SANDBOX_NAME_PREFIX, cgroup_parent=DEFAULT_KERNEL_CGROUP_PARENT
            )
        except SandboxError as e:
            self.complain(f"could not remove kernel sandboxes JupyterLab left behind: {e}")
            return False
        if removed:
            self.complain(f"removed kernel sandboxes JupyterLab left behind: {', '.join(removed)}")
        return True

    def _finish(self, *, clean: bool) -> None:
        if clean and self.owns_root:
            self.layout.remove()
            self.say(
                "stopped; every GPU was released and the demo's files removed "
                f"(notebooks kept in {self.layout.notebooks})"
            )
        elif clean:
            self.say(f"stopped; every GPU was released (files kept in {self.layout.root})")
        else:
            self.complain(f"stopped with problems; the demo's files are kept in {self.layout.root}")


async def _cancelled(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has stopped (it may have finished already)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def cli_command(layout: DemoLayout) -> str:
    """The shell line with which ``jupyter gpu-hotplug status`` in another terminal reaches the
    demo's agent (not the default socket): this installation's ``jupyter``, by absolute path
    because ``sudo`` resets ``PATH``; ``--agent-url`` rather than the variable, which ``sudo``
    drops. ``attach`` and ``detach`` take the same option."""
    jupyter = Path(sys.executable).with_name("jupyter")
    return shlex.join([str(jupyter), "gpu-hotplug", "status", f"--agent-url={layout.agent_url}"])


def open_browser(
    url: str,
    *,
    environ: Mapping[str, str] | None = None,
    opener: Callable[[str], bool] = webbrowser.open,
) -> str | None:
    """Open ``url`` in a graphical browser; what to tell the user when that is not possible.

    Without a display, ``webbrowser`` falls back to text browsers, which would take over the
    terminal the demo prints to; so nothing is tried then.
    """
    env = os.environ if environ is None else environ
    if not (env.get("DISPLAY") or env.get("WAYLAND_DISPLAY")):
        return "no graphical display here: open the URL above in your browser"
    if not opener(url):
        return "could not open a browser: open the URL above yourself"
    return None


def _answers(request: urllib.request.Request) -> bool:
    """Whether the server answers ``request`` with 200 (blocking; run in a thread)."""
    try:
        with urllib.request.urlopen(request, timeout=5.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _default_root_estimate() -> Path:
    """Where a temporary demo directory will be (``mkdtemp`` adds 8 characters)."""
    return Path(tempfile.gettempdir()) / f"{SANDBOX_NAME_PREFIX}-XXXXXXXX"


def run(options: DemoOptions, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Check the machine, then run the demo until stopped; the exit code.

    Raises ``DemoUnavailable`` (nothing started) when the demo cannot run here.
    """
    given = None if options.state_dir is None else options.state_dir.absolute()
    notebooks = (options.notebook_dir or Path.cwd()).absolute()
    estimate = DemoLayout(given or _default_root_estimate(), notebooks)
    preflight(options, socket_path=estimate.agent_socket, notebooks=notebooks)
    if given is None:
        root, owns_root = Path(tempfile.mkdtemp(prefix=f"{SANDBOX_NAME_PREFIX}-")), True
    else:
        root, owns_root = given, False
    demo = DemoRun(options, DemoLayout(root, notebooks), owns_root=owns_root, out=out, err=err)
    return asyncio.run(demo.main())
