"""``jupyter gpu-hotplug agent``: the node agent's configuration and process life.

Why traitlets: the agent is configured like every Jupyter program — a config file
(``--config=/etc/gpu-hotplug/agent_config.py``, ``c.AgentApp.max_gpus_per_target = 2``) and
command-line flags (``--listen``, ``--simulate 4``...). Precedence: command line, then config
file, then defaults. The traits are resolved once into the typed ``AgentSettings`` that the
rest of the agent uses, and the resolved configuration is logged at start.

Two settings are read from the environment: ``$NODE_NAME`` is the default of ``--node-name``
(Kubernetes mode; the DaemonSet sets it from the downward API), and a test hook,
``GPU_HOTPLUG_TEST_PAUSE_AT``, names a step at which attach or detach stops for good (see
``checkpoints``), so crash tests can kill the agent exactly there. It is logged loudly when set.

Process life: ``start`` runs the agent on a fresh event loop until SIGTERM or SIGINT (graceful
stop: running operations finish); SIGHUP runs a reconciliation pass at once (for example after
``systemctl daemon-reload`` re-applied a unit's device list).
"""

from __future__ import annotations

import asyncio
import copy
import grp
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from traitlets import Bool, Enum, Float, Int, List, Unicode, default, observe
from traitlets.config import Application

from .._structs import DEFAULT_MAX_GPUS_PER_TARGET, DEFAULT_SOCKET, NODE_NAME_ENV, NVIDIA_MAJOR
from .._version import __version__
from ..linux.cdi_spec import DEFAULT_KIND, DEFAULT_SPEC_DIRS
from .core.checkpoints import STEPS
from .core.driver_files import DriverFilesMode
from .core.lost import LostPolicy
from .logs import logging_config
from .settings import (
    DEFAULT_CRI_ENDPOINT,
    DEFAULT_HOLDER_CPU,
    DEFAULT_HOLDER_IMAGE,
    DEFAULT_HOLDER_MEMORY,
    DEFAULT_HOLDER_PRIORITY_CLASS,
    DEFAULT_MAX_GPUS,
    DEFAULT_NAMESPACE_SELECTOR,
    DEFAULT_POD_RESOURCES_SOCKET,
    DEFAULT_RESOURCE_NAME,
    DEFAULT_STATE_DIR,
    PULL_POLICIES,
    RBAC_SCOPES,
    STRAY_POLICIES,
    AgentSettings,
    Backend,
    KubernetesSettings,
    LabelSelector,
    LogStyle,
    SettingsError,
    TestHooks,
    parse_listen,
)

__all__ = ["PAUSE_ENV", "AgentApp", "main"]

PAUSE_ENV: Final = "GPU_HOTPLUG_TEST_PAUSE_AT"

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1


class AgentApp(Application):
    """The node agent (see the module docstring)."""

    name = "jupyter-gpu-hotplug-agent"
    version = __version__
    description = (
        "The jupyter-gpu-hotplug node agent: attaches GPUs to running containers and processes "
        "on this node. Runs as root."
    )
    examples = """
jupyter gpu-hotplug agent --simulate=4 --state-dir=/var/lib/gpu-hotplug-sim --listen=127.0.0.1:8477
jupyter gpu-hotplug agent --listen=unix:/run/gpu-hotplug/agent.sock --listen=:8477
"""

    # traitlets reads these class attributes; they are never mutated.
    aliases: dict[str, Any] = {  # noqa: RUF012
        "listen": "AgentApp.listen",
        "metrics-listen": "AgentApp.metrics_listen",
        "backend": "AgentApp.backend",
        "state-dir": "AgentApp.state_dir",
        "host-proc": "AgentApp.host_proc",
        "cgroup-root": "AgentApp.cgroup_root",
        "max-gpus-per-target": "AgentApp.max_gpus_per_target",
        "device-major": "AgentApp.device_major",
        "socket-mode": "AgentApp.socket_mode",
        "socket-group": "AgentApp.socket_group",
        "simulate": "AgentApp.simulate",
        "simulate-mig": "AgentApp.simulate_mig",
        "simulate-nvlink": "AgentApp.simulate_nvlink",
        "simulation-dir": "AgentApp.simulation_dir",
        "reconcile-interval": "AgentApp.reconcile_interval",
        "idle-release": "AgentApp.idle_release_seconds",
        "idle-warning": "AgentApp.idle_warning_seconds",
        "max-lease": "AgentApp.max_lease_seconds",
        "log-level": "AgentApp.log_level",
        "log-format": "AgentApp.log_style",
        "config": "AgentApp.config_file",
        "node-name": "AgentApp.node_name",
        "kubeconfig": "AgentApp.kubeconfig",
        "pod-resources-socket": "AgentApp.pod_resources_socket",
        "cri-endpoint": "AgentApp.cri_endpoint",
        "holder-image": "AgentApp.holder_image",
        "resource-name": "AgentApp.resource_name",
        "holder-priority-class": "AgentApp.holder_priority_class",
        "holder-image-pull-policy": "AgentApp.holder_image_pull_policy",
        "holder-image-pull-secret": "AgentApp.holder_image_pull_secrets",
        "holder-cpu": "AgentApp.holder_cpu",
        "holder-memory": "AgentApp.holder_memory",
        "stray-policy": "AgentApp.stray_policy",
        "default-max-gpus": "AgentApp.default_max_gpus",
        "allowed-namespaces": "AgentApp.allowed_namespaces",
        "allowed-namespace-selector": "AgentApp.allowed_namespace_selector",
        "rbac-scope": "AgentApp.rbac_scope",
        "lost-grace": "AgentApp.lost_grace_seconds",
        "lost-policy": "AgentApp.lost_policy",
        "driver-files": "AgentApp.driver_files",
        "cdi-spec-dir": "AgentApp.cdi_spec_dirs",
        "cdi-kind": "AgentApp.cdi_kind",
        "host-root": "AgentApp.host_root",
    }
    flags: dict[str, Any] = {  # noqa: RUF012
        "show-config-json": (
            {"AgentApp": {"show_resolved_config": True}},
            "Print the resolved settings as JSON and exit.",
        ),
    }

    listen = List(
        Unicode(),
        default_value=[f"unix:{DEFAULT_SOCKET}"],
        help="""Where to serve the API; repeat for several. HOST:PORT, [IPV6]:PORT, :PORT (all
        interfaces) or unix:/absolute/path. Callers on a unix socket are identified by their
        process credentials; over TCP they need the token from <state-dir>/token.""",
    ).tag(config=True)
    metrics_listen = List(
        Unicode(),
        default_value=[],
        help="""Serve /metrics (and /healthz) on this TCP address of its own, HOST:PORT or :PORT;
        repeat for several. Then the API addresses no longer serve /metrics, and a
        NetworkPolicy can admit notebooks to the API and only the monitoring namespace here.
        Default: /metrics is served with the API, without authentication.""",
    ).tag(config=True)
    backend = Enum(
        [backend.value for backend in Backend],
        default_value=Backend.LOCAL.value,
        help="""Where GPU ownership is kept: 'local' (a SQLite ledger in the state dir; targets
        are processes, {"pid": N}) or 'kubernetes' (holder pods; targets are pods' containers,
        {"pod": {...}}; callers authenticate with their pods' bound service-account tokens).""",
    ).tag(config=True)
    node_name = Unicode(
        help=f"""Kubernetes mode: this node's name (holder pods are pinned to it; targets must
        run on it). Default: ${NODE_NAME_ENV}, which the DaemonSet sets from spec.nodeName.""",
    ).tag(config=True)
    kubeconfig = Unicode(
        "",
        help="""Kubernetes mode: a kubeconfig file to reach the API server; empty: the pod's
        service account (in-cluster configuration).""",
    ).tag(config=True)
    pod_resources_socket = Unicode(
        str(DEFAULT_POD_RESOURCES_SOCKET),
        help="Kubernetes mode: the kubelet's PodResources socket (which GPU a holder got).",
    ).tag(config=True)
    cri_endpoint = Unicode(
        DEFAULT_CRI_ENDPOINT,
        help="""Kubernetes mode: the container runtime's CRI socket, unix:///path or /path
        (containerd: /run/containerd/containerd.sock; CRI-O: /var/run/crio/crio.sock).""",
    ).tag(config=True)
    holder_image = Unicode(
        DEFAULT_HOLDER_IMAGE,
        help="Kubernetes mode: the image of holder pods (a pause image present on every node).",
    ).tag(config=True)
    resource_name = Unicode(
        DEFAULT_RESOURCE_NAME,
        help="""Kubernetes mode: the extended resource a holder pod requests, one per GPU:
        nvidia.com/gpu, or a MIG profile such as nvidia.com/mig-1g.10gb.""",
    ).tag(config=True)
    holder_priority_class = Unicode(
        DEFAULT_HOLDER_PRIORITY_CLASS,
        help="""Kubernetes mode: the PriorityClass of holder pods, above the notebooks' so that a
        holder is rarely preempted (the chart and k8s/ ship it); empty: each holder takes its
        notebook pod's priority class.""",
    ).tag(config=True)
    holder_image_pull_policy = Enum(
        list(PULL_POLICIES),
        default_value="IfNotPresent",
        help="Kubernetes mode: the imagePullPolicy of holder pods.",
    ).tag(config=True)
    holder_image_pull_secrets = List(
        Unicode(),
        default_value=[],
        help="""Kubernetes mode: imagePullSecrets of holder pods (names of Secrets, which must
        exist in every notebook namespace); repeat for several.""",
    ).tag(config=True)
    holder_cpu = Unicode(
        DEFAULT_HOLDER_CPU,
        help="Kubernetes mode: CPU request and limit of a holder pod (Guaranteed QoS).",
    ).tag(config=True)
    holder_memory = Unicode(
        DEFAULT_HOLDER_MEMORY,
        help="""Kubernetes mode: memory request and limit of a holder pod (Guaranteed QoS).
        runc's init runs inside the holder's memory cgroup before the pause process: below
        the measured floor (docs/performance.md) the holder is OOM-killed at start.""",
    ).tag(config=True)
    stray_policy = Enum(
        list(STRAY_POLICIES),
        default_value="report",
        help="""Kubernetes mode: a running container that can open a GPU that neither the
        device plugin assigned to it nor the agent granted: 'report' it (Event on its pod,
        gpu_hotplug_stray_gpu_access, a log line) or also 'revoke' the access.""",
    ).tag(config=True)
    default_max_gpus = Int(
        DEFAULT_MAX_GPUS,
        help="""Kubernetes mode: the most GPUs a pod may hold when it has no
        gpu-hotplug.jupyter.org/max-gpus annotation (0: none, the annotation is required).
        The spawner sets the annotation; a pod nobody gave a limit gets this many.""",
    ).tag(config=True)
    allowed_namespaces = List(
        Unicode(),
        default_value=[],
        help="""Kubernetes mode: namespaces whose pods may get GPUs, by name; repeat for
        several ('*': every namespace). A namespace this or --allowed-namespace-selector admits
        is allowed; the agent refuses any other with 403.""",
    ).tag(config=True)
    allowed_namespace_selector = Unicode(
        DEFAULT_NAMESPACE_SELECTOR,
        help="""Kubernetes mode: namespaces whose labels match this selector may get GPUs
        (key=value, key!=value, key, !key, joined by commas; empty: none by label). Label a
        notebook namespace: kubectl label namespace NS gpu-hotplug.jupyter.org/notebooks=true""",
    ).tag(config=True)
    rbac_scope = Enum(
        list(RBAC_SCOPES),
        default_value="cluster",
        help="""Kubernetes mode: where the agent's RBAC lets it read and write pods.
        'cluster' (a ClusterRoleBinding): every namespace. 'namespaces' (RoleBindings in the
        namespaces of --allowed-namespaces, the chart's rbac.namespaced): the agent then lists
        and watches only those, and needs the allowlist to be names alone.""",
    ).tag(config=True)
    lost_grace_seconds = Float(
        30.0,
        help="""Seconds between telling the user that a GPU lost its reservation (holder pod
        preempted, evicted or deleted; a grant no holder backs) and revoking it.""",
    ).tag(config=True)
    lost_policy = Enum(
        [policy.value for policy in LostPolicy],
        default_value=LostPolicy.REVOKE.value,
        help="""When a lost GPU's grace period ends: 'revoke' takes the access and leaves
        processes that hold it open alone; 'force' ends them, as a forced detach.""",
    ).tag(config=True)
    driver_files = Enum(
        ["auto", *(mode.value for mode in DriverFilesMode)],
        default_value="auto",
        help="""How a notebook gets the driver's libraries (libcuda.so.1, nvidia-smi) with its
        GPU. 'cdi': the agent applies the node's CDI spec (NVIDIA's toolkit in CDI mode, the
        GPU Operator's default since v25.10) to the running container, and refuses (422) a
        container that could load no libcuda.so.1 even so. 'check': nothing is applied, the
        container must load it already (the toolkit's legacy mode). 'off': neither. 'auto':
        'off' with --simulate, else 'cdi'.""",
    ).tag(config=True)
    cdi_spec_dirs = List(
        Unicode(),
        default_value=[str(d) for d in DEFAULT_SPEC_DIRS],
        help="""Where the node's CDI specs are, as the agent sees them; repeat for several
        (later ones win, as in CDI). The chart mounts the host's /etc/cdi and /var/run/cdi.""",
    ).tag(config=True)
    cdi_kind = Unicode(DEFAULT_KIND, help="The CDI kind of the node's GPUs.").tag(config=True)
    host_root = Unicode(
        "/",
        help="""Where the agent sees the host's root filesystem (read-only is enough): the CDI
        spec's host paths, the driver's libraries, are read below it. '/' for an agent on the
        host; the chart mounts the host's root at /host/root.""",
    ).tag(config=True)
    state_dir = Unicode(
        str(DEFAULT_STATE_DIR),
        help="""Directory of the ledger, the token and the lock (created with mode 0700). An
        existing one must be the agent user's and not writable by group or others (nor a
        symlink): never point it into a shared temporary directory.""",
    ).tag(config=True)
    host_proc = Unicode(
        "/proc", help="The procfs in which target pids are given (the host's)."
    ).tag(config=True)
    cgroup_root = Unicode(
        "",
        help="""Where the host's / is seen, when cgroup mount points must be rebased (e.g.
        /host when the host's /sys is mounted at /host/sys): the hierarchies are then read
        from the host's init (pid 1 of --host-proc, so the agent needs the host's pid
        namespace) and found under this root. Empty: our own mounts, at our own /.""",
    ).tag(config=True)
    max_gpus_per_target = Int(
        DEFAULT_MAX_GPUS_PER_TARGET,
        help="The most GPUs one container may hold, whichever of its processes a request "
        "names (and one request may ask for).",
    ).tag(config=True)
    device_major = Int(
        NVIDIA_MAJOR, help="Character-device major number of GPU nodes (NVIDIA: 195)."
    ).tag(config=True)
    socket_mode = Unicode(
        "0660", help="Permission bits of unix sockets, in octal: who may connect at all."
    ).tag(config=True)
    socket_group = Unicode(
        "", help="Group (name or id) of unix sockets; empty: the agent's own group."
    ).tag(config=True)
    simulate = Int(
        0,
        help="""Serve this many SIMULATED GPUs (through the fake NVML library) instead of the
        real driver's; 0: real GPUs.""",
    ).tag(config=True)
    simulation_dir = Unicode(
        "",
        help="""Where the simulated node's library and config are kept (world-readable);
        empty: <state-dir>/simulation.""",
    ).tag(config=True)
    simulate_mig = Unicode(
        "",
        help="With --simulate: comma-separated MIG profiles (e.g. 1g.10gb,1g.10gb) that put "
        "simulated GPU 0 in MIG mode with one slice each.",
    ).tag(config=True)
    simulate_nvlink = Int(
        0,
        help="With --simulate: how many simulated GPUs, from GPU 0, have NVLinks (18 each, "
        "as an H100 SXM); the others are PCIe-only.",
    ).tag(config=True)
    simulation_interval = Float(
        2.0, help="Seconds between two moves of the simulated readings (0: never move)."
    ).tag(config=True)
    reconcile_interval = Float(
        10.0,
        help="Seconds between two reconciliations of the ledger with the host (0: start-up only).",
    ).tag(config=True)
    force_grace = Float(
        5.0, help="Seconds a process gets after SIGTERM before SIGKILL, on a forced detach."
    ).tag(config=True)
    idle_release_seconds = Float(
        0.0,
        help="Release an attached GPU that no process of its target held open and NVML saw "
        "unused for this many seconds (0: off). A request may ask for a shorter period, never "
        "a longer one; a GPU in use is never released.",
    ).tag(config=True)
    idle_warning_seconds = Float(
        60.0, help="Announce an idle release this many seconds before it happens."
    ).tag(config=True)
    max_lease_seconds = Float(
        0.0,
        help="Release an attached GPU this many seconds after its attach, at the first moment "
        "nothing uses it (0: no maximum).",
    ).tag(config=True)
    idle_check_interval = Float(
        5.0, help="Seconds between two passes of the idle policy over the attached GPUs."
    ).tag(config=True)
    log_style = Enum(
        [style.value for style in LogStyle],
        default_value=LogStyle.TEXT.value,
        help="Log output: 'text' for people, 'json' (one object per line) for log shippers.",
    ).tag(config=True)
    config_file = Unicode(
        "", help="A Python config file (c.AgentApp.<setting> = ...); the command line wins."
    ).tag(config=True)
    show_resolved_config = Bool(False, help="Print the resolved settings as JSON and exit.").tag(
        config=True
    )

    @default("node_name")
    def _default_node_name(self) -> str:
        return os.environ.get(NODE_NAME_ENV, "")

    @default("log_level")
    def _default_log_level(self) -> int:
        return logging.INFO

    def get_default_logging_config(self) -> dict[str, Any]:
        level = self.log_level
        if not isinstance(level, int | str):
            raise TypeError(f"log_level {level!r} is neither a number nor a name")
        return logging_config(level=level, style=LogStyle(self.log_style))

    @observe("log_style")
    def _log_style_changed(self, change: Any) -> None:
        self._configure_logging()

    def initialize(self, argv: Sequence[str] | None = None) -> None:
        self.parse_command_line(list(argv) if argv is not None else None)
        if self.config_file:
            command_line = copy.deepcopy(self.config)
            path = Path(self.config_file)
            self.load_config_file(path.name, path=str(path.parent))
            self.update_config(command_line)

    def resolved_settings(self) -> AgentSettings:
        """The traits as ``AgentSettings``; ``SettingsError`` says which one is wrong."""
        try:
            mode = int(self.socket_mode, 8)
        except ValueError as e:
            raise SettingsError(f"socket_mode {self.socket_mode!r} is not an octal mode") from e
        pause_at = os.environ.get(PAUSE_ENV) or None
        if pause_at is not None and pause_at not in STEPS:
            raise SettingsError(f"{PAUSE_ENV}={pause_at!r}: the steps are {', '.join(STEPS)}")
        return AgentSettings(
            listen=tuple(parse_listen(text) for text in self.listen),
            metrics_listen=tuple(parse_listen(text) for text in self.metrics_listen),
            state_dir=Path(self.state_dir),
            backend=Backend(self.backend),
            host_proc=Path(self.host_proc),
            cgroup_root=Path(self.cgroup_root) if self.cgroup_root else None,
            max_gpus_per_target=self.max_gpus_per_target,
            device_major=self.device_major,
            socket_mode=mode,
            socket_group=_group_id(self.socket_group) if self.socket_group else None,
            simulate=self.simulate,
            simulate_mig=tuple(p.strip() for p in self.simulate_mig.split(",") if p.strip()),
            simulate_nvlink=self.simulate_nvlink,
            simulation_dir=Path(self.simulation_dir) if self.simulation_dir else None,
            simulation_interval=self.simulation_interval,
            reconcile_interval=self.reconcile_interval,
            force_grace=self.force_grace,
            idle_release_seconds=self.idle_release_seconds,
            idle_warning_seconds=self.idle_warning_seconds,
            max_lease_seconds=self.max_lease_seconds,
            idle_check_interval=self.idle_check_interval,
            lost_grace_seconds=self.lost_grace_seconds,
            lost_policy=LostPolicy(self.lost_policy),
            driver_files=None
            if self.driver_files == "auto"
            else DriverFilesMode(self.driver_files),
            cdi_spec_dirs=tuple(Path(d) for d in self.cdi_spec_dirs),
            cdi_kind=self.cdi_kind,
            host_root=Path(self.host_root),
            hooks=TestHooks(pause_at=pause_at),
            kubernetes=self._kubernetes_settings(),
        )

    def _kubernetes_settings(self) -> KubernetesSettings | None:
        if Backend(self.backend) is not Backend.KUBERNETES:
            return None
        return KubernetesSettings(
            node_name=self.node_name,
            kubeconfig=Path(self.kubeconfig) if self.kubeconfig else None,
            pod_resources_socket=Path(self.pod_resources_socket),
            cri_endpoint=self.cri_endpoint,
            holder_image=self.holder_image,
            resource_name=self.resource_name,
            holder_priority_class=self.holder_priority_class,
            holder_image_pull_policy=self.holder_image_pull_policy,
            holder_image_pull_secrets=tuple(self.holder_image_pull_secrets),
            holder_cpu=self.holder_cpu,
            holder_memory=self.holder_memory,
            stray_policy=self.stray_policy,
            default_max_gpus=self.default_max_gpus,
            allowed_namespaces=tuple(self.allowed_namespaces),
            allowed_namespace_selector=LabelSelector.parse(self.allowed_namespace_selector),
            rbac_scope=self.rbac_scope,
        )

    def start(self) -> None:
        try:
            settings = self.resolved_settings()
        except SettingsError as e:
            self.log.critical("invalid configuration: %s", e)
            raise SystemExit(EXIT_FAILED) from e
        if self.show_resolved_config:
            print(json.dumps(settings.describe(), indent=2, sort_keys=True))
            return
        code = asyncio.run(_serve(settings, self.log))
        if code != EXIT_OK:
            raise SystemExit(code)


def _group_id(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError as e:
        raise SettingsError(f"socket_group {text!r}: no such group") from e


async def _serve(settings: AgentSettings, log: logging.Logger | logging.LoggerAdapter[Any]) -> int:
    """Run the agent until SIGTERM/SIGINT; the exit code."""
    from .api.server import ListenError
    from .runtime import Agent

    log.info("resolved configuration: %s", json.dumps(settings.describe(), sort_keys=True))
    if settings.hooks.pause_at is not None:
        log.warning(
            "TEST HOOK %s=%s is set: operations stop there", PAUSE_ENV, settings.hooks.pause_at
        )
    try:
        agent = await asyncio.to_thread(Agent.create, settings)
    except Exception as e:
        # Anything from a locked state dir to a missing compiler for --simulate: say what.
        log.critical("cannot start: %s", e, exc_info=log.isEnabledFor(logging.DEBUG))
        return EXIT_FAILED
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(agent.reconcile_now()))
    try:
        await agent.start()
    except ListenError as e:
        log.critical("cannot start: %s", e)
        await agent.stop()
        return EXIT_FAILED
    log.info(
        "agent ready (pid %d)%s", os.getpid(), " with SIMULATED GPUs" if settings.simulated else ""
    )
    await stop.wait()
    await agent.stop()
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the agent with ``argv`` (default ``sys.argv[1:]``); the exit code."""
    app = AgentApp()
    try:
        app.initialize(argv)
        app.start()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_FAILED
    finally:
        # A later AgentApp in this process (tests) must configure logging afresh.
        app.close_handlers()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
