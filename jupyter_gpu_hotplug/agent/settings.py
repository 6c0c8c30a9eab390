"""The agent's resolved settings: one typed, frozen value that every component is built from.

Why it exists: configuration arrives through traitlets (``AgentApp``: command line, then config
file), but nothing below the application should know about traitlets, environment variables or
files. ``app.py`` resolves the traits once into an ``AgentSettings`` and logs it; the server, the
service and the reconciler receive only the parts they need. Parsing of the one structured
option (``--listen``) lives here too, so it is tested without starting anything.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TypeAlias

from .._structs import DEFAULT_MAX_GPUS_PER_TARGET, NVIDIA_MAJOR
from ..linux.cdi_spec import DEFAULT_KIND, DEFAULT_SPEC_DIRS
from .core.driver_files import DriverFilesMode
from .core.lost import LostPolicy

DEFAULT_STATE_DIR: Final = Path("/var/lib/gpu-hotplug")
TOKEN_FILE: Final = "token"

# A unix socket path must fit sockaddr_un.sun_path (108 bytes with the NUL).
_SUN_PATH_MAX: Final = 107
_HOST_PORT = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^:\[\]]*)):(?P<port>[0-9]{1,5})")


class SettingsError(ValueError):
    """A setting's value cannot work; the message names the setting and what it accepts."""


class Backend(enum.StrEnum):
    """Where GPU ownership is kept and how targets are named.

    ``local``: a SQLite ledger and ``{"pid": N}`` targets. ``kubernetes``: holder pods and
    ``{"pod": {...}}`` targets, callers authenticated by their pods' bound tokens.
    """

    LOCAL = "local"
    KUBERNETES = "kubernetes"


DEFAULT_POD_RESOURCES_SOCKET: Final = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
DEFAULT_CRI_ENDPOINT: Final = "unix:///run/containerd/containerd.sock"
DEFAULT_HOLDER_IMAGE: Final = "registry.k8s.io/pause:3.9"
DEFAULT_HOLDER_PRIORITY_CLASS: Final = "gpu-hotplug-holder"
"""The PriorityClass of holder pods (shipped with the agent's manifests and chart)."""
DEFAULT_HOLDER_CPU: Final = "100m"
DEFAULT_HOLDER_MEMORY: Final = "24Mi"
"""A holder's requests and limits (Guaranteed QoS): the memory floor measured for runc's init and
the pause process plus a margin (``benchmarks/bench_holder_floor.py``, docs/performance.md);
the CPU limit is the pod's CFS quota, which runc's init starts under: at 10m a holder took 6-8
s to start on the real node, at 100m 0.7 s (``benchmarks/bench_realnode.py --cpu``)."""
PULL_POLICIES: Final = ("Always", "IfNotPresent", "Never")
STRAY_POLICIES: Final = ("report", "revoke")
RBAC_SCOPES: Final = ("cluster", "namespaces")
"""Where the agent's RBAC lets it read and write pods: every namespace (a ClusterRoleBinding),
or only the ``allowed_namespaces`` it names (RoleBindings there; the chart's
``rbac.namespaced``)."""
DEFAULT_RESOURCE_NAME: Final = "nvidia.com/gpu"
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|k|M|G)?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_RESOURCE_NAME = re.compile(
    r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)


DEFAULT_MAX_GPUS: Final = 1
"""The GPU limit of a pod without the ``max-gpus`` annotation (``--default-max-gpus``)."""
NOTEBOOKS_LABEL: Final = "gpu-hotplug.jupyter.org/notebooks"
DEFAULT_NAMESPACE_SELECTOR: Final = f"{NOTEBOOKS_LABEL}=true"
"""Namespaces that may get GPUs unless configured otherwise: those an operator labelled as
notebook namespaces — the label the agent's NetworkPolicy already admits to its API port (a
Namespace's labels need cluster-scoped rights to change, which no tenant has)."""
ALL_NAMESPACES: Final = "*"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_SELECTOR_TERM = re.compile(r"(?P<not>!)?(?P<key>[^!=\s]+)(?:(?P<op>==|!=|=)(?P<value>[^!=\s]*))?")


class Match(enum.StrEnum):
    """How one requirement of a ``LabelSelector`` tests a label (Kubernetes' equality-based
    and existence requirements)."""

    EQUALS = "="
    NOT_EQUALS = "!="
    EXISTS = ""
    NOT_EXISTS = "!"


@dataclass(frozen=True)
class LabelRequirement:
    key: str
    match: Match
    value: str = ""

    def holds(self, labels: Mapping[str, str]) -> bool:
        if self.match is Match.EXISTS:
            return self.key in labels
        if self.match is Match.NOT_EXISTS:
            return self.key not in labels
        if self.match is Match.EQUALS:
            return labels.get(self.key) == self.value
        return labels.get(self.key) != self.value

    def __str__(self) -> str:
        if self.match is Match.NOT_EXISTS:
            return f"!{self.key}"
        return f"{self.key}{self.match}{self.value}" if self.match is not Match.EXISTS else self.key


@dataclass(frozen=True)
class LabelSelector:
    """A label selector in ``kubectl``'s text form, as ``--allowed-namespace-selector`` takes
    it: requirements joined by commas, all of which must hold (``key=value``, ``key==value``,
    ``key!=value``, ``key``, ``!key``). Unlike Kubernetes, the **empty selector matches
    nothing**: it means "no namespace by label", so leaving the setting empty can never open
    every namespace by accident (to allow them all, name ``*`` in ``allowed_namespaces``)."""

    requirements: tuple[LabelRequirement, ...] = ()

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        """The selector ``text`` writes; ``SettingsError`` names the term it cannot read."""
        requirements = []
        for term in text.split(",") if text else ():
            found = _SELECTOR_TERM.fullmatch(term)
            if found is None or (found["not"] and found["op"]):
                raise SettingsError(
                    f"allowed_namespace_selector: cannot read {term!r}; give key=value, "
                    "key!=value, key or !key, joined by commas (set-based terms such as "
                    "'key in (a,b)' are not supported)"
                )
            key, value = found["key"], found["value"] or ""
            _check_label(key, value, term)
            if found["not"]:
                match = Match.NOT_EXISTS
            elif found["op"] is None:
                match = Match.EXISTS
            else:
                match = Match.NOT_EQUALS if found["op"] == "!=" else Match.EQUALS
            requirements.append(LabelRequirement(key, match, value))
        return cls(tuple(requirements))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return bool(self.requirements) and all(r.holds(labels) for r in self.requirements)

    def __str__(self) -> str:
        return ",".join(map(str, self.requirements))


def _check_label(key: str, value: str, term: str) -> None:
    prefix, slash, name = key.rpartition("/")
    if (
        (slash and (len(prefix) > 253 or _DNS_SUBDOMAIN.fullmatch(prefix) is None))
        or len(name) > 63
        or _LABEL_NAME.fullmatch(name) is None
        or len(value) > 63
        or (value and _LABEL_NAME.fullmatch(value) is None)
    ):
        raise SettingsError(
            f"allowed_namespace_selector: {term!r} is not a label requirement (a label key is "
            "[prefix/]name, a value at most 63 letters, digits, '-', '_' or '.')"
        )


@dataclass(frozen=True)
class KubernetesSettings:
    """Kubernetes mode's own settings (``--backend kubernetes``)."""

    node_name: str
    """This node's name: holder pods are pinned to it, targets must run on it."""
    kubeconfig: Path | None = None
    """A kubeconfig file; ``None``: the pod's service account (in-cluster)."""
    pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET
    """The kubelet's PodResources socket."""
    cri_endpoint: str = DEFAULT_CRI_ENDPOINT
    """The container runtime's CRI socket (containerd, CRI-O): ``unix:///path`` or ``/path``."""
    holder_image: str = DEFAULT_HOLDER_IMAGE
    """The image of holder pods (a pause image that is on every node)."""
    resource_name: str = DEFAULT_RESOURCE_NAME
    """The extended resource a holder requests: ``nvidia.com/gpu`` or a MIG profile."""
    holder_priority_class: str = DEFAULT_HOLDER_PRIORITY_CLASS
    """The PriorityClass of holder pods (above notebooks: preemption of a holder is rare);
    empty: each holder takes its target pod's own priority class."""
    holder_image_pull_policy: str = "IfNotPresent"
    holder_image_pull_secrets: tuple[str, ...] = ()
    """Secrets (in each target's namespace) to pull the holder image with."""
    holder_cpu: str = DEFAULT_HOLDER_CPU
    holder_memory: str = DEFAULT_HOLDER_MEMORY
    stray_policy: str = "report"
    """What the stray sweep does with GPU access nobody granted: ``report`` (Event, metric,
    log) or ``revoke`` (and take it away)."""
    default_max_gpus: int = DEFAULT_MAX_GPUS
    """The most GPUs a pod without the ``max-gpus`` annotation may hold (0: none; the
    annotation is then required). Fail closed: a pod nobody gave a limit gets one GPU, not
    the node."""
    allowed_namespaces: tuple[str, ...] = ()
    """Namespaces whose pods may get GPUs, by name (``*``: every namespace); with
    ``allowed_namespace_selector``, a namespace either one admits is allowed."""
    allowed_namespace_selector: LabelSelector = field(
        default_factory=lambda: LabelSelector.parse(DEFAULT_NAMESPACE_SELECTOR)
    )
    """Namespaces whose labels match may get GPUs (empty: none by label)."""
    rbac_scope: str = "cluster"
    """``namespaces``: the agent may read pods only in ``allowed_namespaces`` (RoleBindings),
    so it lists and watches each of them instead of every namespace — which needs the
    allowlist to be names alone (no ``*``, no selector: a namespace admitted by label could
    hold a notebook the agent may not read)."""

    def __post_init__(self) -> None:
        if not self.node_name:
            raise SettingsError(
                "node_name: give --node-name or set $NODE_NAME (the DaemonSet sets it from "
                "spec.nodeName)"
            )
        if _RESOURCE_NAME.fullmatch(self.resource_name) is None:
            raise SettingsError(
                f"resource_name {self.resource_name!r} is not an extended resource name "
                "(like nvidia.com/gpu or nvidia.com/mig-1g.10gb)"
            )
        if not self.holder_image:
            raise SettingsError("holder_image must name an image")
        if self.holder_image_pull_policy not in PULL_POLICIES:
            raise SettingsError(
                f"holder_image_pull_policy {self.holder_image_pull_policy!r} is not one of "
                f"{', '.join(PULL_POLICIES)}"
            )
        for name in (self.holder_priority_class, *self.holder_image_pull_secrets):
            if name and (len(name) > 253 or _DNS_SUBDOMAIN.fullmatch(name) is None):
                raise SettingsError(f"{name!r} is not a Kubernetes object name")
        for setting in ("holder_cpu", "holder_memory"):
            if _QUANTITY.fullmatch(getattr(self, setting)) is None:
                raise SettingsError(
                    f"{setting} {getattr(self, setting)!r} is not a quantity (like 10m or 24Mi)"
                )
        if self.stray_policy not in STRAY_POLICIES:
            raise SettingsError(
                f"stray_policy {self.stray_policy!r} is not one of {', '.join(STRAY_POLICIES)}"
            )
        if not 0 <= self.default_max_gpus <= 255:
            raise SettingsError(
                f"default_max_gpus must be from 0 to 255, got {self.default_max_gpus}"
            )
        for name in self.allowed_namespaces:
            if name != ALL_NAMESPACES and (len(name) > 63 or _DNS_LABEL.fullmatch(name) is None):
                raise SettingsError(
                    f"allowed_namespaces: {name!r} is not a namespace name (or {ALL_NAMESPACES!r})"
                )
        if self.rbac_scope not in RBAC_SCOPES:
            raise SettingsError(
                f"rbac_scope {self.rbac_scope!r} is not one of {', '.join(RBAC_SCOPES)}"
            )
        if self.rbac_scope == "namespaces" and (
            not self.allowed_namespaces
            or ALL_NAMESPACES in self.allowed_namespaces
            or self.allowed_namespace_selector.requirements
        ):
            raise SettingsError(
                "rbac_scope 'namespaces' reads pods only in the namespaces allowed by name: give "
                "--allowed-namespaces (not '*') and an empty --allowed-namespace-selector"
            )

    @property
    def watched_namespaces(self) -> tuple[str, ...] | None:
        """The namespaces whose pods the agent lists and watches; ``None``: every one."""
        return self.allowed_namespaces if self.rbac_scope == "namespaces" else None

    @property
    def mig_profile(self) -> str | None:
        """The MIG profile that ``resource_name`` hands out (``nvidia.com/mig-1g.10gb`` →
        ``1g.10gb``, as the NVIDIA device plugin's mixed strategy names them); ``None`` for
        whole GPUs."""
        name = self.resource_name.partition("/")[2]
        return name.removeprefix("mig-") if name.startswith("mig-") else None

    def describe(self) -> dict[str, object]:
        return {
            "node_name": self.node_name,
            "kubeconfig": None if self.kubeconfig is None else str(self.kubeconfig),
            "pod_resources_socket": str(self.pod_resources_socket),
            "cri_endpoint": self.cri_endpoint,
            "holder_image": self.holder_image,
            "resource_name": self.resource_name,
            "holder_priority_class": self.holder_priority_class,
            "holder_image_pull_policy": self.holder_image_pull_policy,
            "holder_image_pull_secrets": list(self.holder_image_pull_secrets),
            "holder_cpu": self.holder_cpu,
            "holder_memory": self.holder_memory,
            "stray_policy": self.stray_policy,
            "default_max_gpus": self.default_max_gpus,
            "allowed_namespaces": list(self.allowed_namespaces),
            "allowed_namespace_selector": str(self.allowed_namespace_selector),
            "rbac_scope": self.rbac_scope,
        }


class LogStyle(enum.StrEnum):
    TEXT = "text"
    JSON = "json"


@dataclass(frozen=True)
class TcpAddress:
    """``HOST:PORT``; an empty host listens on every interface, port 0 picks a free port."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class UnixAddress:
    """``unix:/path``: a unix socket, where callers are identified by their credentials."""

    path: Path

    def __str__(self) -> str:
        return f"unix:{self.path}"


ListenAddress: TypeAlias = TcpAddress | UnixAddress


def parse_listen(text: str) -> ListenAddress:
    """``HOST:PORT``, ``[V6]:PORT``, ``:PORT`` (all interfaces) or ``unix:/absolute/path``."""
    if text.startswith("unix:"):
        path = Path(text.removeprefix("unix:"))
        if not path.is_absolute():
            raise SettingsError(f"listen address {text!r}: a unix socket path must be absolute")
        if len(str(path).encode()) > _SUN_PATH_MAX:
            raise SettingsError(
                f"listen address {text!r}: unix socket paths are limited to {_SUN_PATH_MAX} bytes"
            )
        return UnixAddress(path)
    match = _HOST_PORT.fullmatch(text)
    if match is None:
        raise SettingsError(
            f"listen address {text!r}: expected HOST:PORT, [IPV6]:PORT, :PORT or unix:/path"
        )
    port = int(match["port"])
    if port > 65535:
        raise SettingsError(f"listen address {text!r}: port {port} is above 65535")
    return TcpAddress(match["v6"] if match["v6"] is not None else match["host"], port)


@dataclass(frozen=True)
class TestHooks:
    """Hooks for the crash-safety tests; both unset in production."""

    __test__ = False  # not a pytest test class, despite the name

    pause_at: str | None = None
    """The named step (``after_reserve``, ``after_grant``, ...) at which an operation stops:
    the agent writes ``<state_dir>/paused-at-<step>`` and the operation never continues, so a
    test can ``kill -9`` the agent exactly there."""


@dataclass(frozen=True)
class AgentSettings:
    """Everything the agent needs to run, resolved and checked (see ``AgentApp`` for help)."""

    listen: tuple[ListenAddress, ...]
    """Where the API is served; at least one address."""
    state_dir: Path
    """Ledger, token, lock and simulation files live here (created 0700)."""
    metrics_listen: tuple[ListenAddress, ...] = ()
    """Where ``/metrics`` (and ``/healthz``) are served on their own; when given, the API's
    addresses no longer serve ``/metrics``, so a NetworkPolicy can open the API to notebooks
    and the metrics port to the monitoring namespace only."""
    backend: Backend = Backend.LOCAL
    host_proc: Path = Path("/proc")
    """The procfs in which target pids are given (the host's)."""
    cgroup_root: Path | None = None
    """Where the host's ``/`` is seen, for cgroup mount points (``None``: our own root)."""
    max_gpus_per_target: int = DEFAULT_MAX_GPUS_PER_TARGET
    """The most GPUs one target may hold, and one request may ask for."""
    device_major: int = NVIDIA_MAJOR
    """Character-device major of GPU nodes (NVIDIA's is 195)."""
    socket_mode: int = 0o660
    """Permission bits of unix sockets (who may connect at all)."""
    socket_group: int | None = None
    """Group id given to unix sockets (``None``: the agent's group)."""
    simulate: int = 0
    """Number of simulated GPUs (0: read the real driver)."""
    simulation_dir: Path | None = None
    """Where the simulated node's library and config live (``None``: ``<state_dir>/simulation``);
    world-readable, because sandboxed kernels of other users load them too."""
    simulate_mig: tuple[str, ...] = ()
    """MIG profiles of simulated GPU 0 (``1g.10gb``...): it is in MIG mode with one slice each."""
    simulate_nvlink: int = 0
    """How many simulated GPUs, from GPU 0, have NVLinks (and NVLink traffic when used)."""
    simulation_interval: float = 2.0
    """Seconds between two moves of simulated utilisation, temperature and power."""
    reconcile_interval: float = 10.0
    """Seconds between two reconciliations of the ledger with the host (0: start-up only)."""
    force_grace: float = 5.0
    """Seconds a process gets after SIGTERM before SIGKILL, on a forced detach."""
    idle_release_seconds: float = 0.0
    """Release a GPU unused (no open fd in its target, no NVML utilisation) this long; 0: off.
    Off by default: taking a GPU from a running kernel is the platform's decision to make."""
    idle_warning_seconds: float = 60.0
    """Announce an idle release this long before it happens."""
    max_lease_seconds: float = 0.0
    """Release an unused GPU once attached this long; 0: no maximum."""
    idle_check_interval: float = 5.0
    """Seconds between two passes of the idle policy."""
    lost_grace_seconds: float = 30.0
    """How long a user is warned before the GPU of a lost reservation (holder pod preempted,
    evicted, deleted) or an orphaned grant is revoked."""
    lost_policy: LostPolicy = LostPolicy.REVOKE
    """After the grace period: ``revoke`` (the access goes, processes keep open descriptors)
    or ``force`` (processes holding the GPU open are ended)."""
    driver_files: DriverFilesMode | None = None
    """How a target gets the driver's libraries (``core/driver_files.py``); ``None``: ``off``
    with ``simulate`` (the simulation's kernels load its own library), else ``cdi``."""
    cdi_spec_dirs: tuple[Path, ...] = DEFAULT_SPEC_DIRS
    """Where the node's CDI specs are, as the agent sees them (later directories win)."""
    cdi_kind: str = DEFAULT_KIND
    """The CDI kind of the node's GPUs."""
    host_root: Path = Path("/")
    """Where the agent sees the host's root filesystem: the CDI spec's host paths (the driver's
    libraries) are below it (``/`` on a server; the chart mounts the host's at ``/host/root``)."""
    hooks: TestHooks = field(default_factory=TestHooks)
    kubernetes: KubernetesSettings | None = None
    """Kubernetes mode's settings; given exactly when ``backend`` is ``kubernetes``."""

    def __post_init__(self) -> None:
        if (self.backend is Backend.KUBERNETES) != (self.kubernetes is not None):
            raise SettingsError("the kubernetes settings go with --backend kubernetes only")
        if not self.listen:
            raise SettingsError("listen: give at least one address to serve the API on")
        if len(set(self.listen)) != len(self.listen):
            raise SettingsError("listen: the same address is given twice")
        for address in self.metrics_listen:
            if not isinstance(address, TcpAddress):
                raise SettingsError(f"metrics_listen {address}: give HOST:PORT or :PORT")
            if address.port != 0 and address in self.listen:
                raise SettingsError(f"metrics_listen {address}: the API is served there already")
        if not self.host_root.is_absolute():
            raise SettingsError(f"host_root {self.host_root} must be an absolute path")
        if not all(d.is_absolute() for d in self.cdi_spec_dirs):
            raise SettingsError("cdi_spec_dirs: give absolute paths")
        if not self.state_dir.is_absolute():
            raise SettingsError(f"state_dir {self.state_dir} must be an absolute path")
        if not 1 <= self.max_gpus_per_target <= 255:
            raise SettingsError(
                f"max_gpus_per_target must be from 1 to 255, got {self.max_gpus_per_target}"
            )
        if not 0 < self.device_major < 2**12:
            raise SettingsError(f"device_major {self.device_major} is not a device major number")
        if not 0 <= self.socket_mode <= 0o777:
            raise SettingsError(f"socket_mode {self.socket_mode:#o} is not a permission mode")
        if not 0 <= self.simulate <= 64:
            raise SettingsError(f"simulate must be from 0 to 64 GPUs, got {self.simulate}")
        if not 0 <= self.simulate_nvlink <= self.simulate:
            raise SettingsError(
                f"simulate_nvlink must be from 0 to simulate ({self.simulate}) GPUs, "
                f"got {self.simulate_nvlink}"
            )
        if self.idle_check_interval <= 0:
            raise SettingsError("idle_check_interval must be more than 0 seconds")
        for name in (
            "simulation_interval",
            "reconcile_interval",
            "force_grace",
            "idle_release_seconds",
            "idle_warning_seconds",
            "max_lease_seconds",
            "lost_grace_seconds",
        ):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must not be negative")

    @property
    def token_path(self) -> Path:
        return self.state_dir / TOKEN_FILE

    @property
    def simulated(self) -> bool:
        return self.simulate > 0

    @property
    def driver_files_mode(self) -> DriverFilesMode:
        if self.driver_files is not None:
            return self.driver_files
        return DriverFilesMode.OFF if self.simulated else DriverFilesMode.CDI

    def describe(self) -> dict[str, object]:
        """The settings as plain values, for the start-up log line (no secrets in here)."""
        return {
            "listen": [str(address) for address in self.listen],
            "metrics_listen": [str(address) for address in self.metrics_listen],
            "backend": str(self.backend),
            "state_dir": str(self.state_dir),
            "host_proc": str(self.host_proc),
            "cgroup_root": None if self.cgroup_root is None else str(self.cgroup_root),
            "max_gpus_per_target": self.max_gpus_per_target,
            "device_major": self.device_major,
            "socket_mode": f"{self.socket_mode:#o}",
            "socket_group": self.socket_group,
            "simulate": self.simulate,
            "simulation_dir": None if self.simulation_dir is None else str(self.simulation_dir),
            "simulate_mig": list(self.simulate_mig),
            "simulate_nvlink": self.simulate_nvlink,
            "simulation_interval": self.simulation_interval,
            "reconcile_interval": self.reconcile_interval,
            "force_grace": self.force_grace,
            "idle_release_seconds": self.idle_release_seconds,
            "idle_warning_seconds": self.idle_warning_seconds,
            "max_lease_seconds": self.max_lease_seconds,
            "idle_check_interval": self.idle_check_interval,
            "lost_grace_seconds": self.lost_grace_seconds,
            "lost_policy": str(self.lost_policy),
            "driver_files": str(self.driver_files_mode),
            "cdi_spec_dirs": [str(d) for d in self.cdi_spec_dirs],
            "cdi_kind": self.cdi_kind,
            "host_root": str(self.host_root),
            "test_pause_at": self.hooks.pause_at,
            "kubernetes": None if self.kubernetes is None else self.kubernetes.describe(),
        }
