"""A real single-node Kubernetes on this machine: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, a kubelet on a private containerd 2 with runc, and NVIDIA's own device plugin
reading the project's simulated NVML: four whole GPUs and a fifth in MIG mode with two
``1g.10gb`` slices (the plugin's ``mixed`` strategy serves ``nvidia.com/gpu`` and
``nvidia.com/mig-1g.10gb``).

Why: Kubernetes mode must be proven against the components a cluster really runs — the real
scheduler places holder pods, the real kubelet's device manager admits them through NVIDIA's
allocation code, PodResources, TokenReview, RBAC, PodSecurity, quota and garbage collection are
the real ones. Only the GPU is simulated (the fake ``libnvidia-ml.so.1``).

Everything lives in one short directory under ``/tmp`` (unix socket paths stay under 107
bytes), every process in its own session, every port chosen free on 127.0.0.1; pods get a
bridge of their own (``jghnode0``, 10.244.77.0/24, no masquerade, nothing routed off the
machine). What cannot be private is recorded and given back at ``stop()``: the kubelet's fixed
``/var/lib/kubelet/device-plugins`` (one such kubelet per machine, so ``start()`` refuses when
another owns it), the host sysctls the kubelet and the bridge change, the cgroup root of the
pods in every hierarchy, network namespaces and the bridge. ``stop()`` returns what it had to
remove by force; the fixture fails the session if that is not empty.

The MIG driver tables NVIDIA's plugin and the agent read are at fixed host paths
(``/proc/driver/nvidia-caps/mig-minors``, the ``nvidia-caps`` major in ``/proc/devices``):
both run in a mount namespace of their own where the node's tables are bound over those
(``in_driver_namespace``), so the host's ``/proc`` is never touched and nothing outlives them.

The node comes in two modes (``NodeMode``). ``plain`` (the default): NVIDIA's plugin passes
GPUs to containers as ``NVIDIA_VISIBLE_DEVICES`` and no NVIDIA runtime is installed, so pods get
no device nodes or driver files. ``cdi``: set up as the GPU Operator >= 25.10 sets a node up —
a CDI spec that ``nvidia-ctk cdi generate`` wrote for the simulated driver root
(``jupyter_gpu_hotplug.nvml.sim.driver_root``) in the node's spec directory, containerd's CRI
reading that directory, NVIDIA's runtime registered as the ``nvidia`` handler in ``cdi`` mode
but not the default, the ``nvidia`` and ``nvidia-legacy`` RuntimeClasses, and the plugin with
``DEVICE_LIST_STRATEGY=cdi-annotations,cdi-cri``: a pod under plain runc gets its
``/dev/nvidia<N>`` and the driver's files through CDI. The plugin writes its own spec to the
fixed ``/var/run/cdi``; in its private mount namespace that is the node's spec directory.

Used by ``tests/realnode/fixtures.py`` and by hand: ``python -m tests.realnode up [--cdi]`` /
``down`` / ``status`` (see ``__main__.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, get_args

from jupyter_gpu_hotplug.agent.local.simulate import write_caps_tables
from jupyter_gpu_hotplug.nvml.sim import (
    FakeNvmlConfig,
    default_gpus,
    ensure_fake_nvml,
    fake_nvml_environ,
    with_mig_devices,
    write_config,
)
from jupyter_gpu_hotplug.nvml.sim.driver_root import ensure_driver_root

from ..k8s.containerd import (
    cgroup_mount_points,
    mounts_under,
    pids_mentioning,
    remove_cgroup_tree,
    spawn_logged,
    terminate_group,
)
from ..k8s.cri import CriClient
from ..k8s.image import write_oci_archive
from ..manifests.support import kubectl as kubectl_binary
from .cdi import GeneratedSpec, generate_spec, make_dev_root
from .components import Components, find_components
from .node_config import (
    BRIDGE,
    TAP,
    NodeRuntime,
    cni_config,
    containerd_config,
    kubelet_config,
    runtime_handler,
)
from .pki import Pki, make_pki, write_kubeconfig

STATE_FILE: Final = Path("/run/jupyter-gpu-hotplug-node.json")
"""Where a running node records itself, so that ``down`` (another process) can stop it, and a
node whose owner was killed can be cleaned up."""
LOCK_FILE: Final = Path("/run/jupyter-gpu-hotplug-node.lock")
"""Held (``flock``) by the process that owns the node for the node's whole life: a second
node on this machine is refused while it is held, and the kernel releases it when the owner
dies, so a stale ``STATE_FILE`` is told from a live one without trusting pids."""
DEVICE_PLUGIN_DIR: Final = Path("/var/lib/kubelet/device-plugins")
"""Fixed in the kubelet (``pluginapi.DevicePluginPath``) whatever ``--root-dir`` says."""
NODE_AGENTS: Final = ("nvidia-device-plugin", "kube-proxy", "kubelet")
"""Stopped before the pods are removed, in this order."""
POD_SUBNET: Final = "10.244.77.0/24"
SERVICE_SUBNET: Final = "10.96.0.0/24"
GPU_RESOURCE: Final = "nvidia.com/gpu"
PLUGIN_REGISTERED: Final = "Registered device plugin"
"""What NVIDIA's plugin logs each time the kubelet accepts its registration."""
DEFAULT_GPUS: Final = 4
"""Whole GPUs (``nvidia.com/gpu``); the MIG GPU comes after them."""
MIG_PROFILES: Final = ("1g.10gb", "1g.10gb")
"""The slices of the node's MIG GPU, as ``nvidia-smi mig -cgi 19,19 -C`` would leave them."""
MIG_RESOURCE: Final = "nvidia.com/mig-1g.10gb"
"""What NVIDIA's plugin (``--mig-strategy=mixed``) names those slices."""
SYSCTLS: Final = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/bridge/bridge-nf-call-iptables",
    "net/netfilter/nf_conntrack_max",
)
"""Host settings the kubelet (``protectKernelDefaults: false``), the bridge plugin or
kube-proxy change: saved at start, restored at stop."""
STOP_TIMEOUT: Final = 60.0
"""Upper bound for the components to stop after SIGTERM before they are killed."""
TERMINATE_TIMEOUT: Final = 15.0
"""Seconds one of the node's daemons has from SIGTERM to exit before it gets SIGKILL."""
IMPORT_TIMEOUT: Final = 900.0
"""Upper bound for ``ctr images import`` of an archive: the native snapshotter copies every
layer, half a gigabyte for the notebook and hub images, on a loaded 2-core machine."""
READY_TIMEOUT: Final = 300.0
"""Upper bound for the node to become Ready on a loaded 2-core machine (never asserted on)."""


NodeMode = Literal["plain", "cdi"]
"""How the node hands GPUs to containers: see the module docstring."""
NODE_MODES: Final[tuple[NodeMode, ...]] = get_args(NodeMode)
NVIDIA_RUNTIME: Final = "nvidia"
"""The containerd runtime handler of NVIDIA's runtime (``cdi`` mode), and its RuntimeClass."""
RUNTIME_CLASSES: Final = (NVIDIA_RUNTIME, "nvidia-legacy")
"""What the GPU Operator creates. Only ``nvidia`` has a handler here: ``nvidia-legacy`` needs
``libnvidia-container``, a C library this tier does not build, so its pods fail to start."""
CDI_DEVICE_LIST_STRATEGY: Final = "cdi-annotations,cdi-cri"
"""The plugin's strategy under the GPU Operator >= 25.10 (``DEVICE_LIST_STRATEGY``)."""
CDI_ANNOTATION_PREFIX: Final = "cdi.k8s.io/"


class NodeError(RuntimeError):
    """The node could not be started; the message says which component and shows its log."""


class NodeBusy(NodeError):
    """Another node runs on this machine (another test session, or ``up`` by hand): only one
    kubelet per machine can own the device-plugin directory. Wait for it, or ``down`` it."""


def _try_lock() -> int | None:
    """The node lock's fd if this process got it, ``None`` if another process holds it."""
    fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def node_is_running() -> bool:
    """Whether a live process owns a node on this machine (it holds ``LOCK_FILE``)."""
    fd = _try_lock()
    if fd is None:
        return True
    os.close(fd)
    return False


def _describe_running() -> str:
    with contextlib.suppress(OSError, ValueError):
        state = json.loads(STATE_FILE.read_text())
        owner = state.get("owner") or ["?"]
        return f"owner pid {owner[0]}, directory {state.get('directory')}"
    return "its state file is not written yet"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_name_for_host() -> str:
    """The machine's hostname, which must resolve to a loopback address: the kubelet refuses a
    loopback ``--node-ip``, so the apiserver reaches the kubelet (exec, logs) by hostname."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError as error:
        raise NodeError(
            f"hostname {name!r} does not resolve ({error}): add it to /etc/hosts as 127.0.0.1"
        ) from error
    if not address.startswith("127."):
        raise NodeError(f"hostname {name!r} resolves to {address}, not loopback")
    return name


def host_address() -> str:
    """The machine's address on its default route (what the kubelet also reports as the
    node's InternalIP)."""
    routes = subprocess.run(
        ["ip", "-j", "route", "get", "1.1.1.1"], capture_output=True, text=True, check=False
    ).stdout
    with contextlib.suppress(ValueError, IndexError, KeyError):
        return str(json.loads(routes)[0]["prefsrc"])
    raise NodeError("no default route: the apiserver needs an address that pods can reach")


def _read_sysctl(name: str) -> str | None:
    with contextlib.suppress(OSError):
        return Path("/proc/sys", name).read_text().strip()
    return None


@dataclass
class Ports:
    etcd_client: int = field(default_factory=free_port)
    etcd_peer: int = field(default_factory=free_port)
    apiserver: int = field(default_factory=free_port)
    controller_manager: int = field(default_factory=free_port)
    scheduler: int = field(default_factory=free_port)
    kubelet: int = field(default_factory=free_port)
    kubelet_healthz: int = field(default_factory=free_port)
    proxy_metrics: int = field(default_factory=free_port)
    proxy_healthz: int = field(default_factory=free_port)


@dataclass
class RealNode:
    """One node; ``start()`` brings it up (Ready, GPUs allocatable), ``stop()`` removes it."""

    directory: Path
    components: Components
    node_name: str
    gpu_count: int = DEFAULT_GPUS
    mode: NodeMode = "plain"
    node_ip: str = field(default_factory=lambda: host_address())
    """Where the apiserver listens: the machine's own address (not loopback), so that pods
    reach it as the ``kubernetes`` Service."""
    ports: Ports = field(default_factory=Ports)
    cgroup_root: str = field(default_factory=lambda: f"/jgh-node-{secrets.token_hex(3)}")
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds from ``start()`` to each milestone (for the benchmark and the docs)."""
    pki: Pki | None = None
    nvml_config_path: Path | None = None
    nvml_library_dir: Path | None = None
    nvml_config: FakeNvmlConfig | None = None
    caps_major: int | None = None
    """The simulated ``nvidia-caps`` major (MIG access nodes)."""
    cdi_spec: GeneratedSpec | None = None
    """``cdi`` mode: what ``nvidia-ctk cdi generate`` wrote into ``cdi_spec_dir``."""
    _saved_sysctls: dict[str, str] = field(default_factory=dict)
    _made_var_lib_kubelet: bool = False
    _netns_before: set[str] = field(default_factory=set)
    by_hand: bool = False
    """Owned by ``python -m tests.realnode up`` (which ``down`` may stop), not a test session."""
    _lock_fd: int | None = None
    _owns_host: bool = False
    """Set once ``start()`` has checked that no other node runs here: only then may ``stop()``
    touch what is the machine's (the bridge, kube-proxy's rules, network namespaces)."""
    _t0: float = 0.0

    # ------------------------------------------------------------------ paths
    @property
    def apiserver_url(self) -> str:
        return f"https://{self.node_ip}:{self.ports.apiserver}"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.directory / "admin.kubeconfig"

    @property
    def containerd_dir(self) -> Path:
        return self.runtime.containerd_dir

    @property
    def cri_endpoint(self) -> str:
        return self.runtime.cri_endpoint

    @property
    def kubelet_dir(self) -> Path:
        return self.directory / "kubelet"

    @property
    def pod_resources_socket(self) -> Path:
        return self.kubelet_dir / "pod-resources" / "kubelet.sock"

    @property
    def driver_dir(self) -> Path:
        """Bound over ``/proc/driver`` in ``in_driver_namespace``: ``nvidia-caps/mig-minors``."""
        return self.directory / "driver"

    @property
    def mig_minors(self) -> Path:
        """The node's ``mig-minors`` table, ``/proc/driver/nvidia-caps/mig-minors`` there."""
        return self.driver_dir / "nvidia-caps" / "mig-minors"

    @property
    def proc_devices(self) -> Path:
        """Bound over ``/proc/devices`` in ``in_driver_namespace``: the ``nvidia-caps`` major."""
        return self.directory / "proc-devices"

    @property
    def cdi_spec_dir(self) -> Path:
        """``cdi`` mode: the node's ``/var/run/cdi`` (containerd's ``cdi_spec_dirs``)."""
        return self.directory / "cdi"

    @property
    def driver_root(self) -> Path:
        """``cdi`` mode: the node's driver root, as ``/`` is on a node whose driver is installed
        on the host: a copy of the simulated driver root (``ensure_driver_root``) with the
        driver's device nodes in its ``dev/`` (``make_dev_root``). One root for both, because
        NVIDIA's plugin looks for device nodes under the driver root it is given
        (``DRIVER_ROOT_CTR_PATH``, when that has a ``dev/``), else in ``/dev``. The spec mounts
        the driver's files from here."""
        return self.directory / "driver-root"

    @property
    def nvidia_runtime_config(self) -> Path:
        """``cdi`` mode: NVIDIA's runtime's ``config.toml`` (``NVIDIA_CTK_CONFIG_FILE_PATH``)."""
        return self.directory / "nvidia-container-runtime.toml"

    def in_driver_namespace(self, argv: list[str], *, cdi_dir: bool = False) -> list[str]:
        """``argv`` run (same pid: ``unshare`` and ``sh`` exec it) in a private mount namespace
        where the host's ``/proc/driver`` and ``/proc/devices`` are the node's simulated
        driver tables, which NVIDIA's plugin and the agent read from those fixed paths.
        ``cdi_dir``: ``/var/run/cdi`` there is the node's spec directory, on a private
        ``/run`` (the host may have no ``/run/cdi`` to mount over, and must get none)."""
        script = 'mount --bind "$1" /proc/driver && mount --bind "$2" /proc/devices && shift 2'
        if cdi_dir:
            script += (
                " && mount -t tmpfs -o mode=0755 jgh-run /run && mkdir /run/cdi"
                ' && mount --bind "$1" /run/cdi && shift'
            )
            argv = [str(self.cdi_spec_dir), *argv]
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            f'{script} && exec "$@"',
            "driver-namespace",
            str(self.driver_dir),
            str(self.proc_devices),
            *argv,
        ]

    def log_path(self, name: str) -> Path:
        return self.directory / "log" / f"{name}.log"

    def log_tail(self, name: str, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path(name).read_text(errors="replace")[-chars:]
        return ""

    def nvml_environ(self) -> dict[str, str]:
        """Environment for a process that should see the node's simulated GPUs (the agent,
        the device plugin): the same library and config, so UUIDs and minors agree."""
        assert self.nvml_library_dir is not None and self.nvml_config_path is not None
        return fake_nvml_environ(self.nvml_library_dir, self.nvml_config_path)

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Bring every component up and wait until the node is Ready with its GPUs
        allocatable; on failure, stop what was started and raise ``NodeError``."""
        self._t0 = time.monotonic()
        try:
            self._check_host()
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            (self.directory / "log").mkdir(exist_ok=True)
            self._record()
            self.pki = make_pki(self.directory / "pki", self.node_name, self.node_ip)
            self._kubeconfigs()
            self._save_host_state()
            self._simulate_gpus()
            if self.mode == "cdi":
                self._generate_cdi_spec()
            self._start_etcd()
            self._start_apiserver()
            self._start_controllers()
            self._start_containerd()
            self._start_kubelet()
            self._start_proxy()
            self._start_device_plugin()
            self._wait_node_ready()
            if self.mode == "cdi":
                self._create_runtime_classes()
        except BaseException:
            self.stop()
            raise

    def _mark(self, milestone: str) -> None:
        self.timings[milestone] = round(time.monotonic() - self._t0, 2)

    def _check_host(self) -> None:
        if os.geteuid() != 0:
            raise NodeError("the real node needs root (kubelet, containerd, cgroups)")
        self._lock_fd = _try_lock()
        if self._lock_fd is None:
            raise NodeBusy(
                f"another real node is running on this machine ({_describe_running()}): only "
                f"one kubelet per machine can own {DEVICE_PLUGIN_DIR}; wait until it is down "
                "(a test session takes its node down at its end), or `python -m tests.realnode "
                "down` if it is yours"
            )
        if STATE_FILE.exists():  # its owner died (we hold the lock): take its leftovers down
            take_down_recorded()
        sock = DEVICE_PLUGIN_DIR / "kubelet.sock"
        if sock.exists():
            with socket.socket(socket.AF_UNIX) as s, contextlib.suppress(OSError):
                s.connect(str(sock))
                raise NodeError(
                    f"another kubelet serves {sock}: only one kubelet per machine can own "
                    f"{DEVICE_PLUGIN_DIR} (stop it, or `python -m tests.realnode down`)"
                )
        self._made_var_lib_kubelet = not Path("/var/lib/kubelet").exists()
        self._netns_before = _netns_names()
        self._owns_host = True

    def _record(self) -> None:
        """Write the state file first, so that a killed run can still be taken down."""
        me = os.getpid()
        STATE_FILE.write_text(
            json.dumps(
                {
                    "directory": str(self.directory),
                    "cgroup_root": self.cgroup_root,
                    "owner": [me],
                    "by_hand": self.by_hand,
                    "made_var_lib_kubelet": self._made_var_lib_kubelet,
                    "sysctls": self._saved_sysctls,
                    "netns_before": sorted(self._netns_before),
                    "kubeconfig": str(self.admin_kubeconfig),
                    "node": self.node_name,
                }
            )
        )

    def _kubeconfigs(self) -> None:
        assert self.pki is not None
        for name, identity in (
            ("admin", self.pki.admin),
            ("controller-manager", self.pki.controller_manager),
            ("scheduler", self.pki.scheduler),
            ("kubelet", self.pki.node),
            ("proxy", self.pki.proxy),
        ):
            write_kubeconfig(
                self.directory / f"{name}.kubeconfig",
                self.apiserver_url,
                self.pki.ca.cert,
                identity,
            )

    def _save_host_state(self) -> None:
        for name in SYSCTLS:
            value = _read_sysctl(name)
            if value is not None:
                self._saved_sysctls[name] = value
        self._record()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.processes[name] = spawn_logged(argv, self.log_path(name), env)

    def _wait(self, what: str, check: Callable[[], bool], timeout: float, logs: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise NodeError(
                        f"{name} exited ({process.returncode}) while waiting for {what}:\n"
                        f"{self.log_tail(name)}"
                    )
            with contextlib.suppress(Exception):
                if check():
                    self._mark(what)
                    return
            if time.monotonic() > deadline:
                raise NodeError(f"{what}: not within {timeout:.0f} s\n{self.log_tail(logs)}")
            time.sleep(0.2)

    def _https_ok(self, url: str) -> bool:
        assert self.pki is not None
        result = subprocess.run(
            [
                "curl",
                "-sf",
                "--max-time",
                "5",
                "--cacert",
                str(self.pki.ca.cert),
                "--cert",
                str(self.pki.admin.cert),
                "--key",
                str(self.pki.admin.key),
                url,
            ],
            capture_output=True,
            check=False,
        )
        return result.returncode == 0

    def _start_etcd(self) -> None:
        p = self.ports
        self._spawn(
            "etcd",
            [
                str(self.components.etcd),
                "--name=node",
                f"--data-dir={self.directory / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{p.etcd_client}",
                f"--advertise-client-urls=http://127.0.0.1:{p.etcd_client}",
                f"--listen-peer-urls=http://127.0.0.1:{p.etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{p.etcd_peer}",
                f"--initial-cluster=node=http://127.0.0.1:{p.etcd_peer}",
                "--listen-metrics-urls=",
                "--quota-backend-bytes=1073741824",
                "--unsafe-no-fsync",  # a throwaway test store: no durability wanted
            ],
        )
        self._wait(
            "etcd healthy",
            lambda: (
                subprocess.run(
                    ["curl", "-sf", "--max-time", "3", f"http://127.0.0.1:{p.etcd_client}/health"],
                    capture_output=True,
                    check=False,
                ).returncode
                == 0
            ),
            60,
            "etcd",
        )

    def _start_apiserver(self) -> None:
        pki = self.pki
        assert pki is not None
        self._spawn(
            "kube-apiserver",
            [
                str(self.components.kube_apiserver),
                f"--etcd-servers=http://127.0.0.1:{self.ports.etcd_client}",
                # The node's own address, which pods reach through the bridge's gateway: the
                # `kubernetes` Service (in-cluster clients, the deployed agent) points at it.
                f"--bind-address={self.node_ip}",
                f"--advertise-address={self.node_ip}",
                f"--secure-port={self.ports.apiserver}",
                f"--service-cluster-ip-range={SERVICE_SUBNET}",
                f"--client-ca-file={pki.ca.cert}",
                f"--tls-cert-file={pki.apiserver.cert}",
                f"--tls-private-key-file={pki.apiserver.key}",
                f"--kubelet-client-certificate={pki.apiserver_kubelet_client.cert}",
                f"--kubelet-client-key={pki.apiserver_kubelet_client.key}",
                # Every node's kubelet listens on its InternalIP (the host's own address, the
                # VM node's link address): one rule reaches both, and the node proxy refuses
                # loopback addresses.
                "--kubelet-preferred-address-types=InternalIP",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.service_account_public}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                "--authorization-mode=Node,RBAC",
                # On by default besides: PodSecurity, ResourceQuota, ServiceAccount,
                # ValidatingAdmissionPolicy, Priority, DefaultTolerationSeconds, ...
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                "--profiling=false",
                "--event-ttl=30m",
            ],
        )
        self._wait(
            "apiserver ready",
            lambda: self._https_ok(f"{self.apiserver_url}/readyz"),
            120,
            "kube-apiserver",
        )

    def _start_controllers(self) -> None:
        pki = self.pki
        assert pki is not None
        kcm = self.directory / "controller-manager.kubeconfig"
        sched = self.directory / "scheduler.kubeconfig"
        self._spawn(
            "kube-controller-manager",
            [
                str(self.components.kube_controller_manager),
                f"--kubeconfig={kcm}",
                f"--authentication-kubeconfig={kcm}",
                f"--authorization-kubeconfig={kcm}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports.controller_manager}",
                "--leader-elect=false",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--root-ca-file={pki.ca.cert}",
                "--use-service-account-credentials=true",
                f"--cluster-signing-cert-file={pki.ca.cert}",
                f"--cluster-signing-key-file={pki.ca.key}",
                f"--service-cluster-ip-range={SERVICE_SUBNET}",
                "--controllers=*",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                str(self.components.kube_scheduler),
                f"--kubeconfig={sched}",
                f"--authentication-kubeconfig={sched}",
                f"--authorization-kubeconfig={sched}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports.scheduler}",
                "--leader-elect=false",
            ],
        )

    @property
    def runtime(self) -> NodeRuntime:
        """How this node runs pods: the host's cgroup v1 with the ``cgroupfs`` driver."""
        return NodeRuntime(self.directory, self.components, "cgroupfs", "native", POD_SUBNET)

    def _containerd_config(self) -> str:
        if self.mode == "plain":
            return containerd_config(self.runtime)
        # NVIDIA's runtime as the ``nvidia`` handler beside the default ``runc``, as the GPU
        # Operator's toolkit container configures containerd
        # (``NVIDIA_RUNTIME_SET_AS_DEFAULT=false``). CDI itself needs only ``cdi_spec_dirs``:
        # containerd 2.x has no ``enable_cdi``, CDI is always on.
        nvidia = self.components.container_toolkit.nvidia_container_runtime
        return containerd_config(
            self.runtime,
            cdi_spec_dir=self.cdi_spec_dir,
            runtimes=runtime_handler(self.runtime, NVIDIA_RUNTIME, nvidia),
        )

    def _nvidia_runtime_config_text(self) -> str:
        """NVIDIA's runtime in ``cdi`` mode (what the toolkit container writes with
        ``NVIDIA_CONTAINER_RUNTIME_MODE=cdi``): devices from the node's specs, runc below."""
        toolkit = self.components.container_toolkit
        return f"""[nvidia-container-runtime]
mode = "cdi"
runtimes = ["{self.components.runc}"]
log-level = "info"
debug = "{self.log_path("nvidia-container-runtime")}"

[nvidia-container-runtime.modes.cdi]
spec-dirs = ["{self.cdi_spec_dir}"]
default-kind = "nvidia.com/gpu"
annotation-prefixes = ["{CDI_ANNOTATION_PREFIX}"]

[nvidia-ctk]
path = "{toolkit.nvidia_ctk}"

[nvidia-container-cli]
root = "{self.driver_root}"
"""

    def crictl(self, *args: str) -> str:
        return _run_tool(
            [
                str(self.components.crictl),
                f"--runtime-endpoint={self.cri_endpoint}",
                f"--image-endpoint={self.cri_endpoint}",
                "--timeout=30s",
                *args,
            ]
        )

    def ctr(self, *args: str, timeout: float = 120) -> str:
        """containerd's own client (namespace ``k8s.io``, the CRI plugin's)."""
        ctr = self.components.containerd.parent / "ctr"
        address = str(self.containerd_dir / "containerd.sock")
        argv = [str(ctr), "--address", address, "--namespace", "k8s.io", *args]
        return _run_tool(argv, timeout)

    def _start_containerd(self) -> None:
        d = self.containerd_dir
        (d / "net.d").mkdir(parents=True)
        (d / "config.toml").write_text(self._containerd_config())
        (d / "net.d" / "10-jgh-node.conflist").write_text(cni_config(self.runtime))
        path = ":".join([*self.components.path_dirs, os.environ.get("PATH", "")])
        env = {"PATH": path}
        if self.mode == "cdi":  # the shims pass it on to NVIDIA's runtime
            self.nvidia_runtime_config.write_text(self._nvidia_runtime_config_text())
            env["NVIDIA_CTK_CONFIG_FILE_PATH"] = str(self.nvidia_runtime_config)
        self._spawn(
            "containerd",
            [str(self.components.containerd), "--config", str(d / "config.toml")],
            env=env,
        )
        self._wait("containerd ready", lambda: bool(self.crictl("info")), 60, "containerd")
        archive = d / "images.tar"
        write_oci_archive(archive)
        self.import_image(archive)
        archive.unlink()

    def import_image(self, archive: Path) -> None:
        """Import an OCI archive into the node's runtime (no registry: images are never
        pulled, and the kubelet's image GC is off so they stay)."""
        self.ctr(
            "images", "import", "--platform=linux/amd64", "--snapshotter=native", str(archive),
            timeout=IMPORT_TIMEOUT,
        )  # fmt: skip

    def _start_kubelet(self) -> None:
        for mount in cgroup_mount_points():
            path = mount / self.cgroup_root.strip("/")
            path.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):  # v1 cpuset: a child starts empty
                source = mount / name
                if source.exists() and (path / name).exists():
                    (path / name).write_text(source.read_text())
        self.kubelet_dir.mkdir()
        assert self.pki is not None
        (self.directory / "kubelet.yaml").write_text(
            kubelet_config(
                self.runtime,
                ca=self.pki.ca.cert,
                address=self.node_ip,
                port=self.ports.kubelet,
                healthz_port=self.ports.kubelet_healthz,
                cgroup_root=self.cgroup_root,
            )
        )
        self._spawn_kubelet()

    def _spawn_kubelet(self) -> None:
        config = self.directory / "kubelet.yaml"
        self._spawn(
            "kubelet",
            [
                str(self.components.kubelet),
                f"--config={config}",
                f"--kubeconfig={self.directory / 'kubelet.kubeconfig'}",
                f"--root-dir={self.kubelet_dir}",
                f"--cert-dir={self.kubelet_dir / 'pki'}",
                f"--hostname-override={self.node_name}",
                f"--node-ip={self.node_ip}",
                "--v=2",
            ],
        )

    def restart_kubelet(self) -> None:
        """Stop the kubelet (SIGTERM) and start it again with the same configuration, as a
        node's service manager does on an upgrade; pods keep running. Returns once the new
        kubelet serves its health endpoint and NVIDIA's plugin has registered with it again
        (the plugin watches for the new registration socket)."""
        registered = self.log_tail("nvidia-device-plugin", 10**7).count(PLUGIN_REGISTERED)
        terminate_group(self.processes.pop("kubelet"), TERMINATE_TIMEOUT)
        self._spawn_kubelet()
        healthz = f"http://127.0.0.1:{self.ports.kubelet_healthz}/healthz"
        self._wait(
            "kubelet healthy after restart",
            lambda: (
                subprocess.run(
                    ["curl", "-sf", "--max-time", "3", healthz], capture_output=True, check=False
                ).returncode
                == 0
            ),
            120,
            "kubelet",
        )
        self._wait(
            "device plugin registered again",
            lambda: (
                self.log_tail("nvidia-device-plugin", 10**7).count(PLUGIN_REGISTERED) > registered
            ),
            120,
            "nvidia-device-plugin",
        )

    def _start_proxy(self) -> None:
        """kube-proxy (iptables): Services reach their pods, as the node-local Service of the
        agent's DaemonSet needs. Bridged pod traffic must pass iptables for the replies of a
        Service on the same bridge to be translated back."""
        Path("/proc/sys/net/bridge/bridge-nf-call-iptables").write_text("1")
        self._spawn(
            "kube-proxy",
            [
                str(self.components.kube_proxy),
                f"--kubeconfig={self.directory / 'proxy.kubeconfig'}",
                f"--hostname-override={self.node_name}",
                f"--cluster-cidr={POD_SUBNET}",
                "--proxy-mode=iptables",
                "--conntrack-max-per-core=0",
                f"--metrics-bind-address=127.0.0.1:{self.ports.proxy_metrics}",
                f"--healthz-bind-address=127.0.0.1:{self.ports.proxy_healthz}",
            ],
        )

    def _simulate_gpus(self) -> None:
        """The simulated GPUs (whole ones, then one in MIG mode) and the driver tables beside
        them, before anything reads them."""
        self.nvml_library_dir = ensure_fake_nvml()
        config_path = self.directory / "nvml.conf"
        gpus = default_gpus(self.gpu_count + 1, node=self.node_name)
        mig_gpu = with_mig_devices(gpus[-1], MIG_PROFILES, node=self.node_name)
        config = FakeNvmlConfig(gpus=(*gpus[:-1], mig_gpu))
        write_config(config_path, config)
        self.caps_major = write_caps_tables(
            config,
            proc_devices=self.proc_devices,
            mig_minors=self.mig_minors,
            host_proc_devices=Path("/proc/devices"),
        )
        self.nvml_config_path, self.nvml_config = config_path, config

    def _generate_cdi_spec(self) -> None:
        """``cdi`` mode: the driver root, the driver's device nodes and the spec NVIDIA's
        toolkit container writes at start (``nvidia-ctk cdi generate``), before containerd
        reads the spec directory."""
        assert self.nvml_config is not None
        shutil.copytree(ensure_driver_root(), self.driver_root, symlinks=True)
        make_dev_root(self.driver_root, self.nvml_config, caps_major=self.caps_major)
        self.cdi_spec = generate_spec(
            self.components.container_toolkit,
            driver_root=self.driver_root,
            dev_root=self.driver_root,
            nvml_environ=self.nvml_environ(),
            output_dir=self.cdi_spec_dir,
            wrap=self.in_driver_namespace,
        )
        self._mark("CDI spec generated")

    def _device_plugin_settings(self) -> tuple[list[str], dict[str, str]]:
        """NVIDIA's plugin's flags and environment for this mode."""
        if self.mode == "plain":
            return ["--device-list-strategy=envvar", "--pass-device-specs=false"], {}
        hook = self.components.container_toolkit.nvidia_cdi_hook
        return [], {
            # As the GPU Operator (>= 25.10) sets it; the plugin writes its own spec
            # (k8s.device-plugin.nvidia.com/gpu) from the same driver and device roots.
            "DEVICE_LIST_STRATEGY": CDI_DEVICE_LIST_STRATEGY,
            "CDI_ANNOTATION_PREFIX": CDI_ANNOTATION_PREFIX,
            "NVIDIA_DRIVER_ROOT": str(self.driver_root),
            # The plugin runs on the host here, so it sees the driver where the host has it
            # (under the operator: the host's / mounted at /driver-root in its container).
            "DRIVER_ROOT_CTR_PATH": str(self.driver_root),
            "NVIDIA_CDI_HOOK_PATH": str(hook),
            # No GDRCopy, GPUDirect Storage or MOFED driver to describe.
            "GDRCOPY_ENABLED": "false",
            "GDS_ENABLED": "false",
            "MOFED_ENABLED": "false",
        }

    def _start_device_plugin(self) -> None:
        assert self.nvml_library_dir is not None
        self._wait(
            "kubelet registration socket",
            lambda: (DEVICE_PLUGIN_DIR / "kubelet.sock").exists(),
            120,
            "kubelet",
        )
        flags, env = self._device_plugin_settings()
        self._spawn(
            "nvidia-device-plugin",
            self.in_driver_namespace(
                [
                    str(self.components.device_plugin),
                    "--fail-on-init-error=true",
                    "--mig-strategy=mixed",
                    "--device-id-strategy=uuid",
                    *flags,
                ],
                cdi_dir=self.mode == "cdi",
            ),
            env={
                **self.nvml_environ(),
                **env,
                "LD_LIBRARY_PATH": str(self.nvml_library_dir),
                # Health checks wait on NVML events, which the simulation does not raise.
                "DP_DISABLE_HEALTHCHECKS": "all",
            },
        )

    def _create_runtime_classes(self) -> None:
        """The RuntimeClasses the GPU Operator creates (``nvidia``, ``nvidia-legacy``)."""
        classes = [
            {
                "apiVersion": "node.k8s.io/v1",
                "kind": "RuntimeClass",
                "metadata": {"name": name},
                "handler": name,
            }
            for name in RUNTIME_CLASSES
        ]
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"kind": "List", "apiVersion": "v1", "items": classes}),
        )

    def _wait_node_ready(self) -> None:
        def ready() -> bool:
            node = self.kubectl_json("get", "node", self.node_name)
            return any(
                bool(c["type"] == "Ready" and c["status"] == "True")
                for c in node["status"].get("conditions", [])
            )

        self._wait("node Ready", ready, READY_TIMEOUT, "kubelet")

        def allocatable() -> bool:
            found = self.kubectl_json("get", "node", self.node_name)["status"]["allocatable"]
            wanted = {GPU_RESOURCE: str(self.gpu_count), MIG_RESOURCE: str(len(MIG_PROFILES))}
            return all(found.get(name) == count for name, count in wanted.items())

        self._wait("GPUs allocatable", allocatable, 120, "nvidia-device-plugin")

    # ------------------------------------------------------------------ use
    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        result = subprocess.run(
            [kubectl_binary(), f"--kubeconfig={self.admin_kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        # kubectl's own words in the failure: CalledProcessError's message would hide them.
        assert not check or result.returncode == 0, (
            f"kubectl {' '.join(args)} exited {result.returncode}:\n{result.stderr}"
        )
        return result.stdout + ("" if check else result.stderr)

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def api_client(self) -> Any:
        """The official client as cluster admin."""
        from kubernetes import config

        load: Any = config.new_client_from_config
        return load(str(self.admin_kubeconfig))

    def residue(self) -> list[str]:
        """What of this node is still on the host (after ``stop()``: nothing): processes,
        mounts, cgroups, network namespaces, the bridge, kube-proxy's rules, changed sysctls,
        ``/var/lib/kubelet`` when the node made it, the state file."""
        found = [f"process {pid}" for pid in pids_mentioning(f"{self.directory}/")]
        found += [f"mount {m}" for m in mounts_under(self.directory)]
        found += [f"netns {n}" for n in sorted(_netns_names() - self._netns_before)]
        for mount in cgroup_mount_points():
            if (mount / self.cgroup_root.strip("/")).exists():
                found.append(f"cgroup {mount / self.cgroup_root.strip('/')}")
        for link in (BRIDGE, TAP):
            if subprocess.run(["ip", "link", "show", link], capture_output=True).returncode == 0:
                found.append(f"link {link}")
        found += [f"iptables {rule}" for rule in _proxy_rules()]
        for name, value in self._saved_sysctls.items():
            if _read_sysctl(name) != value:
                found.append(f"sysctl {name}={_read_sysctl(name)} (was {value})")
        if self._made_var_lib_kubelet and Path("/var/lib/kubelet").exists():
            found.append("/var/lib/kubelet")
        if self.directory.exists():
            found.append(str(self.directory))
        if STATE_FILE.exists() and str(self.directory) in STATE_FILE.read_text():
            found.append(str(STATE_FILE))
        return found

    # ------------------------------------------------------------------ stop
    def stop(self) -> list[str]:
        """Stop everything and give back what was changed on the host; returns what had to
        be removed by force (processes, mounts, cgroups, network namespaces)."""
        left: list[str] = []
        if not self._owns_host:  # refused at start: nothing of ours is on the host
            shutil.rmtree(self.directory, ignore_errors=True)
            self._release()
            return left
        # The node's own agents first (a running kubelet would restart the pods removed
        # next), then every pod through containerd (its shims, network namespaces and pod
        # cgroups go with them), then the rest.
        for name in NODE_AGENTS:
            if name in self.processes:
                terminate_group(self.processes[name], TERMINATE_TIMEOUT)
        if (self.containerd_dir / "containerd.sock").exists():
            _remove_all_pods(self.cri_endpoint)
        for name in reversed(list(self.processes)):
            terminate_group(self.processes[name], TERMINATE_TIMEOUT)
        # The kubelet leaves its mounts when it stops, by design (its root directory made a
        # shared mount, pods' volumes): unmounting them is part of stopping a node.
        for mount in mounts_under(self.kubelet_dir):
            subprocess.run(["umount", str(mount)], check=False, capture_output=True)
        left.extend(
            teardown_host(
                self.directory,
                self.cgroup_root,
                self._saved_sysctls,
                self._made_var_lib_kubelet,
                self._netns_before,
            )
        )
        with contextlib.suppress(FileNotFoundError):
            state = json.loads(STATE_FILE.read_text())
            if state.get("directory") == str(self.directory):
                STATE_FILE.unlink()
        self._release()
        return left

    def _release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _run_tool(argv: list[str], timeout: float = 120) -> str:
    """A command-line client's output; its stderr in the error when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise NodeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _remove_all_pods(endpoint: str) -> None:
    """Every pod through the node's containerd (its shims, network namespaces and pod cgroups
    go with them); best effort: containerd may be gone already."""
    with contextlib.suppress(Exception):
        cri = CriClient(endpoint)
        cri.remove_all_pods()
        cri.close()


NETNS_DIR: Final = Path("/var/run/netns")


def _netns_names() -> set[str]:
    """Network namespaces the CRI plugin made (``cni-*``), by name."""
    return {p.name for p in NETNS_DIR.glob("cni-*")} if NETNS_DIR.is_dir() else set()


def teardown_host(
    directory: Path,
    cgroup_root: str,
    sysctls: dict[str, str],
    made_var_lib_kubelet: bool,
    netns_before: set[str],
) -> list[str]:
    """Remove what a node (running or killed) left: processes naming its directory, mounts
    below it, its network namespaces, the bridge, its cgroups; restore sysctls and
    ``/var/lib/kubelet``. Returns what was found still there."""
    left: list[str] = []
    for pid in pids_mentioning(f"{directory}/"):
        left.append(f"process {pid}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if left:
        time.sleep(0.2)  # killed processes leave their mounts asynchronously
    for name in sorted(_netns_names() - netns_before):
        netns = NETNS_DIR / name
        left.append(f"netns {netns}")
        subprocess.run(["umount", "-l", str(netns)], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            netns.unlink()
    for mount in mounts_under(directory):
        left.append(f"mount {mount}")
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
    left.extend(f"cgroup {p}" for p in remove_cgroup_tree(cgroup_root))
    _remove_proxy_rules()
    for link in (BRIDGE, TAP):  # the pods' bridge, the VM node's link
        if subprocess.run(["ip", "link", "show", link], capture_output=True).returncode == 0:
            subprocess.run(["ip", "link", "delete", link], capture_output=True, check=False)
    for name, value in sysctls.items():
        with contextlib.suppress(OSError):
            if _read_sysctl(name) != value:
                Path("/proc/sys", name).write_text(value)
    if made_var_lib_kubelet:
        shutil.rmtree("/var/lib/kubelet", ignore_errors=True)
    else:
        for stale in ("kubelet.sock", "kubelet_internal_checkpoint", "nvidia-gpu.sock"):
            with contextlib.suppress(OSError):
                (DEVICE_PLUGIN_DIR / stale).unlink()
    shutil.rmtree(directory, ignore_errors=True)
    return left


PROXY_CHAIN_PREFIX: Final = "KUBE-"
IPTABLES: Final = ("iptables", "ip6tables")
"""kube-proxy and the kubelet write both families where the host has IPv6."""


def _proxy_rules() -> list[str]:
    """The iptables chains and rules of kube-proxy and the kubelet (all named ``KUBE-…``)."""
    found = []
    for family in IPTABLES:
        dump = subprocess.run(
            [f"{family}-save"], capture_output=True, text=True, check=False
        ).stdout
        found += [f"{family} {line}" for line in dump.splitlines() if PROXY_CHAIN_PREFIX in line]
    return found


def _remove_proxy_rules() -> None:
    """Take kube-proxy's and the kubelet's iptables rules away (kube-proxy's own ``--cleanup``
    first where the binary is at hand; then by name, so a node whose cache is gone is cleaned
    too): rules that jump to a ``KUBE-`` chain, then the chains."""
    if not _proxy_rules():
        return
    with contextlib.suppress(Exception):
        proxy = find_components().kube_proxy
        subprocess.run([str(proxy), "--cleanup"], capture_output=True, check=False, timeout=60)
    for family in IPTABLES:
        for table in ("filter", "nat", "mangle"):
            dump = subprocess.run(
                [f"{family}-save", "-t", table], capture_output=True, text=True, check=False
            ).stdout
            for line in dump.splitlines():
                if line.startswith("-A") and PROXY_CHAIN_PREFIX in line:
                    subprocess.run(
                        [family, "-t", table, "-D", *shlex.split(line)[1:]],
                        capture_output=True,
                        check=False,
                    )
            for line in dump.splitlines():
                if line.startswith(":" + PROXY_CHAIN_PREFIX):
                    chain = line[1:].split()[0]
                    for action in ("-F", "-X"):
                        subprocess.run(
                            [family, "-t", table, action, chain], capture_output=True, check=False
                        )


def new_node(gpu_count: int = DEFAULT_GPUS, *, mode: NodeMode = "plain") -> RealNode:
    """A node object for this machine (not started), in ``mode`` (see ``NodeMode``)."""
    directory = Path(f"/tmp/jgh-node-{secrets.token_hex(3)}")
    return RealNode(
        directory=directory,
        components=find_components(),
        node_name=node_name_for_host(),
        gpu_count=gpu_count,
        mode=mode,
    )


def take_down_recorded(*, stop_live_owner: bool = False) -> list[str]:
    """Take down the node recorded in ``STATE_FILE`` and return what had to be removed.

    A node whose owner is dead (a killed session or ``up``) is removed from what the state file
    records. A live owner is asked to stop it only with ``stop_live_owner`` (``down`` by hand:
    SIGTERM, and the owner tears its node down itself); otherwise ``NodeBusy``."""
    try:
        state = json.loads(STATE_FILE.read_text())
    except (FileNotFoundError, ValueError):
        return []
    if node_is_running():
        if not stop_live_owner or not state.get("by_hand"):
            raise NodeBusy(
                f"the recorded node is live ({_describe_running()}); a test session's node "
                "goes down at the session's end"
            )
        owner = int(state["owner"][0])
        with contextlib.suppress(ProcessLookupError):
            os.kill(owner, signal.SIGTERM)
        _poll(lambda: not node_is_running(), STOP_TIMEOUT)
        if node_is_running():
            raise NodeBusy(f"the node's owner (pid {owner}) did not stop in {STOP_TIMEOUT:.0f} s")
        if not STATE_FILE.exists():  # the owner took everything down
            return []
    directory = Path(state["directory"])
    sock = directory / "ctd" / "containerd.sock"
    if sock.exists():
        _remove_all_pods(f"unix://{sock}")
    for pid in pids_mentioning(f"{directory}/"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    _poll(lambda: not pids_mentioning(f"{directory}/"), STOP_TIMEOUT)
    left = teardown_host(
        directory,
        state["cgroup_root"],
        state.get("sysctls", {}),
        state.get("made_var_lib_kubelet", False),
        set(state.get("netns_before", [])),
    )
    STATE_FILE.unlink(missing_ok=True)
    return left


def _poll(done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)
