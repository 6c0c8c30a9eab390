"""The agent's resolved settings: one typed, frozen value that every component is built from.

Why it exists: configuration arrives through traitlets (``AgentApp``: command line, then config
file), but nothing below the application should know about traitlets, environment variables or
files. ``app.py`` resolves the traits once into an ``AgentSettings`` and logs it; the server, the
service and the reconciler receive only the parts they need. Parsing of the one structured
option (``--listen``) lives here too, so it is tested without starting anything.

Each setting is declared once, as a field of ``AgentSettings`` or ``KubernetesSettings``: its
type and default, and in ``setting(...)`` its help text, its command-line flag and how its text
form (what a flag or ``c.AgentApp.<field>`` gives) becomes the field's value. ``AgentApp``'s
traits, its flags, the resolution and ``describe()`` are all derived from these fields.
"""

from __future__ import annotations

import enum
import grp
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePath
from typing import Any, Final, TypeAlias, TypeVar

from .._structs import (
    DEFAULT_MAX_GPUS_PER_TARGET,
    DEFAULT_SOCKET,
    NODE_NAME_ENV,
    NVIDIA_MAJOR,
    WireFormatError,
    parse_memory_text,
)
from ..linux.cdi_spec import DEFAULT_KIND, DEFAULT_SPEC_DIRS
from .core.driver_files import DriverFilesMode
from .core.lost import LostPolicy

TOKEN_FILE: Final = "token"

# A unix socket path must fit sockaddr_un.sun_path (108 bytes with the NUL).
_SUN_PATH_MAX: Final = 107
_HOST_PORT = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^:\[\]]*)):(?P<port>[0-9]{1,5})")


class SettingsError(ValueError):
    """A setting's value cannot work; the message names the setting and what it accepts."""


def _plain(value: object) -> object:
    """A field's value as JSON: paths, addresses, selectors and enums as their text, tuples as
    lists, numbers and ``None`` as they are."""
    if value is None or isinstance(value, int | float):
        return value
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return str(value)


def _text(value: object) -> object:
    """A field's value in its text form (a flag's, a trait's): as ``_plain``, with "unset"
    (``None``) written as empty text."""
    return "" if value is None else _plain(value)


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Option:
    """How one setting is given (a field's ``metadata[OPTION]``, written by ``setting``):
    everything about it but its name, type and default, which the field itself declares."""

    help: str
    """What ``--help-all`` says about it."""
    flag: str | None = None
    """Its short command-line flag (``idle-release`` for ``--idle-release``), if it has one;
    every setting is also ``--AgentApp.<field>`` and ``c.AgentApp.<field>``."""
    choices: tuple[str, ...] = ()
    """The texts it accepts, when they are few (an ``Enum`` trait); empty: any."""
    env: str | None = None
    """An environment variable whose value, when set, is its default (``$NODE_NAME``)."""
    parse: Callable[[Any], Any] = _same
    """Its text form (text, a number, or a list of texts for a repeatable flag) → the field's
    value; raises ``SettingsError`` naming the setting."""
    text: Callable[[Any], Any] = _text
    """The field's value → its text form: what the default looks like to a flag, and its
    inverse is ``parse`` (a test holds them to that)."""
    show: Callable[[Any], object] = _plain
    """The value → what ``describe()`` logs."""
    shown: str | None = None
    """The attribute ``describe()`` logs instead of the field (a value resolved from it)."""


OPTION: Final = "option"
"""The key of a setting's ``Option`` in its field's metadata."""

_T = TypeVar("_T")


def setting(
    default: _T,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[str, ...] = (),
    env: str | None = None,
    parse: Callable[[Any], Any] | None = None,
    text: Callable[[Any], Any] = _text,
    show: Callable[[Any], object] = _plain,
    shown: str | None = None,
) -> _T:
    """A settings field with its default and its ``Option``: the one place a setting is
    declared. A path's or an enum's text is read as its default's type, and an enum's members
    are its choices, unless told otherwise."""
    if parse is None:
        parse = type(default) if isinstance(default, PurePath | enum.Enum) else _same
    if not choices and isinstance(default, enum.Enum):
        choices = tuple(type(default))
    option = Option(help, flag, tuple(map(str, choices)), env, parse, text, show, shown)
    return field(default=default, metadata={OPTION: option})


def options(settings: type[Any]) -> Iterator[tuple[str, Option, object]]:
    """The settings a settings class declares: name, ``Option`` and default (as a value)."""
    for declared in fields(settings):
        if OPTION in declared.metadata:
            yield declared.name, declared.metadata[OPTION], declared.default


def parsed(settings: type[Any], text: Mapping[str, Any]) -> dict[str, Any]:
    """The values of ``settings``' fields whose text forms, by name, are in ``text``."""
    return {name: option.parse(text[name]) for name, option, _ in options(settings)}


def described(settings: object) -> dict[str, object]:
    """``settings``' declared fields as plain values, by name (``describe()``)."""
    return {
        name: option.show(getattr(settings, option.shown or name))
        for name, option, _ in options(type(settings))
    }


def _optional_path(text: str) -> Path | None:
    return Path(text) if text else None


def _addresses(texts: list[str]) -> tuple[ListenAddress, ...]:
    return tuple(parse_listen(text) for text in texts)


def _octal_mode(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError as e:
        raise SettingsError(f"socket_mode {text!r} is not an octal mode") from e


def _group_id(text: str) -> int | None:
    if not text:
        return None
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError as e:
        raise SettingsError(f"socket_group {text!r}: no such group") from e


def _optional_memory(text: str) -> int | None:
    if not text:
        return None
    try:
        return parse_memory_text(text)
    except WireFormatError as e:
        raise SettingsError(
            f"keep_memory_per_target {text!r} is not a size such as 512M, 32Gi or 1024"
        ) from e


def _comma_separated(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


AUTO: Final = "auto"
"""``--driver-files``' choice of the mode by ``--simulate`` (``driver_files_mode``)."""


class Backend(enum.StrEnum):
    """Where GPU ownership is kept and how targets are named.

    ``local``: a SQLite ledger and ``{"pid": N}`` targets. ``kubernetes``: holder pods and
    ``{"pod": {...}}`` targets, callers authenticated by their pods' bound tokens.
    """

    LOCAL = "local"
    KUBERNETES = "kubernetes"


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
IDLE_HELD_POLICIES: Final = ("suspend", "leave")
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
    """Kubernetes mode's own settings (``--backend kubernetes``); each declared once, as
    ``AgentSettings``' are."""

    node_name: str = setting(
        "",
        f"""Kubernetes mode: this node's name (holder pods are pinned to it; targets must
        run on it). Default: ${NODE_NAME_ENV}, which the DaemonSet sets from spec.nodeName.""",
        flag="node-name",
        env=NODE_NAME_ENV,
    )
    kubeconfig: Path | None = setting(
        None,
        """Kubernetes mode: a kubeconfig file to reach the API server; empty: the pod's
        service account (in-cluster configuration).""",
        flag="kubeconfig",
        parse=_optional_path,
    )
    pod_resources_socket: Path = setting(
        Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
        "Kubernetes mode: the kubelet's PodResources socket (which GPU a holder got).",
        flag="pod-resources-socket",
    )
    cri_endpoint: str = setting(
        "unix:///run/containerd/containerd.sock",
        """Kubernetes mode: the container runtime's CRI socket, unix:///path or /path
        (containerd: /run/containerd/containerd.sock; CRI-O: /var/run/crio/crio.sock).""",
        flag="cri-endpoint",
    )
    holder_image: str = setting(
        DEFAULT_HOLDER_IMAGE,
        "Kubernetes mode: the image of holder pods (a pause image present on every node).",
        flag="holder-image",
    )
    resource_name: str = setting(
        DEFAULT_RESOURCE_NAME,
        """Kubernetes mode: the extended resource a holder pod requests, one per GPU:
        nvidia.com/gpu, or a MIG profile such as nvidia.com/mig-1g.10gb.""",
        flag="resource-name",
    )
    holder_priority_class: str = setting(
        DEFAULT_HOLDER_PRIORITY_CLASS,
        """Kubernetes mode: the PriorityClass of holder pods, above the notebooks' so that a
        holder is rarely preempted (the chart and k8s/ ship it); empty: each holder takes its
        notebook pod's priority class.""",
        flag="holder-priority-class",
    )
    holder_image_pull_policy: str = setting(
        "IfNotPresent",
        "Kubernetes mode: the imagePullPolicy of holder pods.",
        flag="holder-image-pull-policy",
        choices=PULL_POLICIES,
    )
    holder_image_pull_secrets: tuple[str, ...] = setting(
        (),
        """Kubernetes mode: imagePullSecrets of holder pods (names of Secrets, which must
        exist in every notebook namespace); repeat for several.""",
        flag="holder-image-pull-secret",
        parse=tuple,
    )
    holder_cpu: str = setting(
        DEFAULT_HOLDER_CPU,
        "Kubernetes mode: CPU request and limit of a holder pod (Guaranteed QoS).",
        flag="holder-cpu",
    )
    holder_memory: str = setting(
        DEFAULT_HOLDER_MEMORY,
        """Kubernetes mode: memory request and limit of a holder pod (Guaranteed QoS).
        runc's init runs inside the holder's memory cgroup before the pause process: below
        the measured floor (docs/performance.md) the holder is OOM-killed at start.""",
        flag="holder-memory",
    )
    default_max_gpus: int = setting(
        DEFAULT_MAX_GPUS,
        """Kubernetes mode: the most GPUs a pod may hold when it has no
        gpu-hotplug.jupyter.org/max-gpus annotation (0: none, the annotation is required).
        The spawner sets the annotation; a pod nobody gave a limit gets this many.""",
        flag="default-max-gpus",
    )
    """Fail closed: a pod nobody gave a limit gets one GPU, not the node."""
    allowed_namespaces: tuple[str, ...] = setting(
        (),
        """Kubernetes mode: namespaces whose pods may get GPUs, by name; repeat for
        several ('*': every namespace). A namespace this or --allowed-namespace-selector admits
        is allowed; the agent refuses any other with 403.""",
        flag="allowed-namespaces",
        parse=tuple,
    )
    allowed_namespace_selector: LabelSelector = setting(
        LabelSelector.parse(DEFAULT_NAMESPACE_SELECTOR),
        """Kubernetes mode: namespaces whose labels match this selector may get GPUs
        (key=value, key!=value, key, !key, joined by commas; empty: none by label). Label a
        notebook namespace: kubectl label namespace NS gpu-hotplug.jupyter.org/notebooks=true""",
        flag="allowed-namespace-selector",
        parse=LabelSelector.parse,
    )
    rbac_scope: str = setting(
        "cluster",
        """Kubernetes mode: where the agent's RBAC lets it read and write pods.
        'cluster' (a ClusterRoleBinding): every namespace. 'namespaces' (RoleBindings in the
        namespaces of --allowed-namespaces, the chart's rbac.namespaced): the agent then lists
        and watches only those, and needs the allowlist to be names alone.""",
        flag="rbac-scope",
        choices=RBAC_SCOPES,
    )
    """``namespaces`` needs the allowlist to be names alone (no ``*``, no selector): a
    namespace admitted by label could hold a notebook the agent may not read."""

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
        return described(self)


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
    """Everything the agent needs to run, resolved and checked. Each setting is declared once,
    here: its type, its default, and (``setting``) its help, flag and text form, from which
    ``AgentApp`` makes its traits and flags (docs/architecture.md, "Settings")."""

    listen: tuple[ListenAddress, ...] = setting(
        (UnixAddress(Path(DEFAULT_SOCKET)),),
        """Where to serve the API; repeat for several. HOST:PORT, [IPV6]:PORT, :PORT (all
        interfaces) or unix:/absolute/path. Callers on a unix socket are identified by their
        process credentials; over TCP they need the token from <state-dir>/token.""",
        flag="listen",
        parse=_addresses,
    )
    metrics_listen: tuple[ListenAddress, ...] = setting(
        (),
        """Serve /metrics (and /healthz) on this TCP address of its own, HOST:PORT or :PORT;
        repeat for several. Then the API addresses no longer serve /metrics, and a
        NetworkPolicy can admit notebooks to the API and only the monitoring namespace here.
        Default: /metrics is served with the API, without authentication.""",
        flag="metrics-listen",
        parse=_addresses,
    )
    backend: Backend = setting(
        Backend.LOCAL,
        """Where GPU ownership is kept: 'local' (a SQLite ledger in the state dir; targets
        are processes, {"pid": N}) or 'kubernetes' (holder pods; targets are pods' containers,
        {"pod": {...}}; callers authenticate with their pods' bound service-account tokens).""",
        flag="backend",
    )
    state_dir: Path = setting(
        Path("/var/lib/gpu-hotplug"),
        """Directory of the ledger, the token and the lock (created with mode 0700). An
        existing one must be the agent user's and not writable by group or others (nor a
        symlink): never point it into a shared temporary directory.""",
        flag="state-dir",
    )
    host_proc: Path = setting(
        Path("/proc"),
        "The procfs in which target pids are given (the host's).",
        flag="host-proc",
    )
    cgroup_root: Path | None = setting(
        None,
        """Where the host's / is seen, when cgroup mount points must be rebased (e.g.
        /host when the host's /sys is mounted at /host/sys): the hierarchies are then read
        from the host's init (pid 1 of --host-proc, so the agent needs the host's pid
        namespace) and found under this root. Empty: our own mounts, at our own /.""",
        flag="cgroup-root",
        parse=_optional_path,
    )
    max_gpus_per_target: int = setting(
        DEFAULT_MAX_GPUS_PER_TARGET,
        "The most GPUs one container may hold, whichever of its processes a request "
        "names (and one request may ask for).",
        flag="max-gpus-per-target",
    )
    device_major: int = setting(
        NVIDIA_MAJOR,
        "Character-device major number of GPU nodes (NVIDIA: 195).",
        flag="device-major",
    )
    socket_mode: int = setting(
        0o660,
        "Permission bits of unix sockets, in octal: who may connect at all.",
        flag="socket-mode",
        parse=_octal_mode,
        text=lambda mode: f"{mode:04o}",
        show=lambda mode: f"{mode:#o}",
    )
    socket_group: int | None = setting(
        None,
        "Group (name or id) of unix sockets; empty: the agent's own group.",
        flag="socket-group",
        parse=_group_id,
    )
    simulate: int = setting(
        0,
        """Serve this many SIMULATED GPUs (through the fake NVML library) instead of the
        real driver's; 0: real GPUs.""",
        flag="simulate",
    )
    simulate_mig: tuple[str, ...] = setting(
        (),
        "With --simulate: comma-separated MIG profiles (e.g. 1g.10gb,1g.10gb) that put "
        "simulated GPU 0 in MIG mode with one slice each.",
        flag="simulate-mig",
        parse=_comma_separated,
        text=",".join,
    )
    simulate_nvlink: int = setting(
        0,
        "With --simulate: how many simulated GPUs, from GPU 0, have NVLinks (18 each, "
        "as an H100 SXM); the others are PCIe-only.",
        flag="simulate-nvlink",
    )
    simulation_dir: Path | None = setting(
        None,
        """Where the simulated node's library and config are kept (world-readable);
        empty: <state-dir>/simulation.""",
        flag="simulation-dir",
        parse=_optional_path,
    )
    """World-readable, because sandboxed kernels of other users load them too."""
    simulation_interval: float = setting(
        2.0, "Seconds between two moves of the simulated readings (0: never move)."
    )
    reconcile_interval: float = setting(
        10.0,
        "Seconds between two reconciliations of the ledger with the host (0: start-up only).",
        flag="reconcile-interval",
    )
    force_grace: float = setting(
        5.0, "Seconds a process gets after SIGTERM before SIGKILL, on a forced detach."
    )
    idle_release_seconds: float = setting(
        0.0,
        "Release an attached GPU that no process of its target held open and NVML saw "
        "unused for this many seconds (0: off). A request may ask for a shorter period, never "
        "a longer one; a GPU in use is never released.",
        flag="idle-release",
    )
    """Off by default: taking a GPU from a running kernel is the platform's decision to make."""
    idle_held: str = setting(
        "suspend",
        """What the idle policy does with a GPU that a process of its target holds but NVML
        sees unused for the whole period (an idle CUDA context, as a PyTorch kernel keeps):
        'suspend' the target, keeping its CUDA state in host memory for its next attach,
        where this agent can (local mode, a driver with the checkpoint API); 'leave' it
        attached.""",
        flag="idle-held",
        choices=IDLE_HELD_POLICIES,
    )
    """Suspend by default: without it an idle release never frees a GPU that CUDA used."""
    idle_handover_seconds: float = setting(
        300.0,
        """While a request of another kernel waits for GPUs, suspend a kernel whose GPU it
        held idle (a CUDA context NVML sees at 0 %) for this many seconds, instead of after
        the whole idle period, and hand its GPU on; where the idle policy is on and the kernel
        can be suspended (--idle-held=suspend). 0: never earlier than the idle period.""",
        flag="idle-handover",
    )
    """On by default: a suspend keeps the kernel's state, so it costs its owner a resume, while
    the waiting user would otherwise wait out the whole idle period."""
    idle_warning_seconds: float = setting(
        60.0, "Announce an idle release this many seconds before it happens.", flag="idle-warning"
    )
    max_lease_seconds: float = setting(
        0.0,
        "Release an attached GPU this many seconds after its attach, at the first moment "
        "nothing uses it (0: no maximum).",
        flag="max-lease",
    )
    idle_check_interval: float = setting(
        5.0, "Seconds between two passes of the idle policy over the attached GPUs."
    )
    lost_grace_seconds: float = setting(
        30.0,
        """Seconds between telling the user that a GPU lost its reservation (holder pod
        preempted, evicted or deleted; a grant no holder backs) and revoking it.""",
        flag="lost-grace",
    )
    lost_policy: LostPolicy = setting(
        LostPolicy.REVOKE,
        """When a lost GPU's grace period ends: 'revoke' takes the access and leaves
        processes that hold it open alone; 'force' ends them, as a forced detach.""",
        flag="lost-policy",
    )
    keep_memory_fraction: float = setting(
        0.5,
        """The most of this node's memory (MemTotal) that the CUDA state of all suspended
        kernels together may keep in host memory (a detach with keep), from 0 to 1; a
        suspend past it is refused.""",
        flag="keep-memory-fraction",
    )
    """Half by default: the rest is the running kernels' and the node's own."""
    keep_memory_per_target: int | None = setting(
        None,
        """The most host memory one kernel's kept CUDA state may take, as 512M, 32Gi or
        bytes; empty: only the node's budget (--keep-memory-fraction) applies.""",
        flag="keep-memory-per-target",
        parse=_optional_memory,
        text=lambda size: "" if size is None else str(size),
    )
    stray_policy: str = setting(
        "report",
        """A running container that can open a GPU that neither its runtime or device plugin
        assigned to it nor the agent granted (the node sweep, every mode): 'report' it (a log
        line, gpu_hotplug_stray_gpu_access; in Kubernetes mode an Event on its pod) or also
        'revoke' the access.""",
        flag="stray-policy",
        choices=STRAY_POLICIES,
    )
    sweep_cgroup: str = setting(
        "/",
        """Local mode: the node sweep judges the containers below this cgroup path (in each
        device hierarchy in use); '/': every container of the host. Narrow it only where
        several agents share one host (each would take the others' grants for orphans).""",
        flag="sweep-cgroup",
    )
    driver_files: DriverFilesMode | None = setting(
        None,
        """How a notebook gets the driver's libraries (libcuda.so.1, nvidia-smi) with its
        GPU. 'cdi': the agent applies the node's CDI spec (NVIDIA's toolkit in CDI mode, the
        GPU Operator's default since v25.10) to the running container, and refuses (422) a
        container that could load no libcuda.so.1 even so. 'check': nothing is applied, the
        container must load it already (the toolkit's legacy mode). 'off': neither. 'auto':
        'off' with --simulate, else 'cdi'.""",
        flag="driver-files",
        choices=(AUTO, *DriverFilesMode),
        parse=lambda text: None if text == AUTO else DriverFilesMode(text),
        text=lambda mode: AUTO if mode is None else str(mode),
        shown="driver_files_mode",
    )
    """``None`` (``auto``): see ``driver_files_mode``."""
    cdi_spec_dirs: tuple[Path, ...] = setting(
        DEFAULT_SPEC_DIRS,
        """Where the node's CDI specs are, as the agent sees them; repeat for several
        (later ones win, as in CDI). The chart mounts the host's /etc/cdi and /var/run/cdi.""",
        flag="cdi-spec-dir",
        parse=lambda dirs: tuple(map(Path, dirs)),
    )
    cdi_kind: str = setting(DEFAULT_KIND, "The CDI kind of the node's GPUs.", flag="cdi-kind")
    host_root: Path = setting(
        Path("/"),
        """Where the agent sees the host's root filesystem (read-only is enough): the CDI
        spec's host paths, the driver's libraries, are read below it. '/' for an agent on the
        host; the chart mounts the host's root at /host/root.""",
        flag="host-root",
    )
    hooks: TestHooks = field(default_factory=TestHooks)
    """Read from the environment by ``AgentApp`` (a test hook, never a flag)."""
    kubernetes: KubernetesSettings | None = None
    """Kubernetes mode's settings; given exactly when ``backend`` is ``kubernetes``."""

    @classmethod
    def from_text(cls, text: Mapping[str, Any], hooks: TestHooks | None = None) -> AgentSettings:
        """The settings whose text forms (``AgentApp``'s traits, by field name) are ``text``;
        ``SettingsError`` says which one is wrong."""
        values = parsed(cls, text)
        kubernetes = None
        if values["backend"] is Backend.KUBERNETES:
            kubernetes = KubernetesSettings(**parsed(KubernetesSettings, text))
        return cls(**values, hooks=hooks or TestHooks(), kubernetes=kubernetes)

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
        if not self.sweep_cgroup.startswith("/"):
            raise SettingsError(f"sweep_cgroup {self.sweep_cgroup!r} must be an absolute path")
        if self.idle_held not in IDLE_HELD_POLICIES:
            raise SettingsError(
                f"idle_held {self.idle_held!r} is not one of {', '.join(IDLE_HELD_POLICIES)}"
            )
        if self.stray_policy not in STRAY_POLICIES:
            raise SettingsError(
                f"stray_policy {self.stray_policy!r} is not one of {', '.join(STRAY_POLICIES)}"
            )
        if not 0 <= self.keep_memory_fraction <= 1:
            raise SettingsError(
                f"keep_memory_fraction must be from 0 to 1, got {self.keep_memory_fraction}"
            )
        if self.idle_check_interval <= 0:
            raise SettingsError("idle_check_interval must be more than 0 seconds")
        for name in (
            "simulation_interval",
            "reconcile_interval",
            "force_grace",
            "idle_release_seconds",
            "idle_warning_seconds",
            "idle_handover_seconds",
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
            **described(self),
            "test_pause_at": self.hooks.pause_at,
            "kubernetes": None if self.kubernetes is None else self.kubernetes.describe(),
        }
