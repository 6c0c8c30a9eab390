"""CDI specs (the CNCF Container Device Interface): read, validated, and a device's edits.

Why this module exists: on a node set up by NVIDIA's Container Toolkit in CDI mode (the GPU
Operator's default since v25.10) the one description of what a GPU container gets — its device
nodes, the driver's libraries and binaries, the ldcache update, the environment — is the spec in
``/etc/cdi`` or ``/var/run/cdi`` (``nvidia-ctk cdi generate``). A runtime applies it when it
creates a container; the agent applies the same edits to a running one (:mod:`.driver_edits`),
so a notebook needs no runtime class and no ``NVIDIA_VISIBLE_DEVICES`` trick.

Trust: the spec directories are the node's, writable by root only (the toolkit writes them); the
agent reads them and never takes a spec, a device name or a path from a caller. Every field used
is still validated (absolute, normalised paths; the CNCF name rules), so a malformed spec is a
clear :class:`CdiSpecError` naming the file, never a mount in the wrong place.

Which device: the GPU the agent allocated is known by its device node; :meth:`CdiRegistry.edits`
finds the spec devices of the configured kind whose ``deviceNodes`` hold that node (the toolkit
names each GPU three times — index, UUID, ``all`` — with the same node; one is enough, and
``all`` is skipped, since it holds every GPU's node).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final

__all__ = [
    "DEFAULT_KIND",
    "DEFAULT_SPEC_DIRS",
    "CdiRegistry",
    "CdiSpec",
    "CdiSpecError",
    "ContainerEdits",
    "Hook",
    "Mount",
    "load_spec",
    "parse_spec",
]

DEFAULT_SPEC_DIRS: Final = (Path("/etc/cdi"), Path("/var/run/cdi"))
"""Where CDI specs live (the CNCF default; later directories take precedence)."""
DEFAULT_KIND: Final = "nvidia.com/gpu"
SUPPORTED_VERSIONS: Final = frozenset(
    {"0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"}
)
MAX_SPEC_BYTES: Final = 4 * 2**20
"""A generated NVIDIA spec is ~20 KiB per GPU; this bounds a broken file, not a real one."""
_KIND: Final = re.compile(
    r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$"
)
_DEVICE_NAME: Final = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9_.:-]*[a-zA-Z0-9])?$")
_ENV: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=[^\x00]*$")
_ALL: Final = "all"


class CdiSpecError(Exception):
    """A spec file is unreadable or malformed; the message names the file and the field."""


@dataclass(frozen=True)
class Mount:
    """A ``mounts`` entry: ``host_path`` bind-mounted at ``container_path``."""

    host_path: PurePosixPath
    container_path: PurePosixPath
    options: tuple[str, ...]


@dataclass(frozen=True)
class Hook:
    """A ``hooks`` entry (an OCI hook the runtime would run at ``hook_name``)."""

    hook_name: str
    path: PurePosixPath
    args: tuple[str, ...]


@dataclass(frozen=True)
class ContainerEdits:
    """What a container started with a device gets: ``env`` (``KEY=value``), device node
    paths, mounts and hooks — in the spec's order, duplicates removed on merge."""

    env: tuple[str, ...] = ()
    device_nodes: tuple[PurePosixPath, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()

    def merged(self, other: ContainerEdits) -> ContainerEdits:
        def union(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
            return a + tuple(x for x in b if x not in a)

        return ContainerEdits(
            union(self.env, other.env),
            union(self.device_nodes, other.device_nodes),
            union(self.mounts, other.mounts),
            union(self.hooks, other.hooks),
        )


@dataclass(frozen=True)
class CdiSpec:
    """One spec file: its kind, its devices' edits by name, and the spec-wide edits."""

    path: Path
    kind: str
    version: str
    devices: Mapping[str, ContainerEdits]
    common: ContainerEdits = field(default_factory=ContainerEdits)


def parse_spec(text: str, *, path: Path) -> CdiSpec:
    """The spec in ``text`` (JSON, or YAML when PyYAML is installed), validated."""
    data = _decode(text, path)
    where = str(path)
    if not isinstance(data, dict):
        raise CdiSpecError(f"{where}: a CDI spec is a mapping")
    version = data.get("cdiVersion")
    if version not in SUPPORTED_VERSIONS:
        raise CdiSpecError(f"{where}: cdiVersion {version!r} is not one this agent reads")
    kind = data.get("kind")
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise CdiSpecError(f"{where}: kind {kind!r} is not vendor/class")
    devices: dict[str, ContainerEdits] = {}
    for index, device in enumerate(_list(data, "devices", where)):
        name = device.get("name") if isinstance(device, dict) else None
        if not isinstance(name, str) or not _DEVICE_NAME.fullmatch(name):
            raise CdiSpecError(f"{where}: devices[{index}].name {name!r} is not a device name")
        if name in devices:
            raise CdiSpecError(f"{where}: device {name!r} is defined twice")
        devices[name] = _edits(device.get("containerEdits"), f"{where}: device {name}")
    if not devices:
        raise CdiSpecError(f"{where}: the spec defines no device")
    common = _edits(data.get("containerEdits"), f"{where}: containerEdits")
    return CdiSpec(path, kind, version, devices, common)


def load_spec(path: Path) -> CdiSpec:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise CdiSpecError(f"{path}: {e.strerror}") from e
    if len(raw) > MAX_SPEC_BYTES:
        raise CdiSpecError(f"{path}: larger than {MAX_SPEC_BYTES} bytes")
    return parse_spec(raw.decode("utf-8", errors="strict"), path=path)


class CdiRegistry:
    """The specs of one kind found in ``spec_dirs`` (read afresh on each :meth:`refresh`:
    the toolkit regenerates them when the driver changes)."""

    def __init__(
        self, spec_dirs: Sequence[Path] = DEFAULT_SPEC_DIRS, *, kind: str = DEFAULT_KIND
    ) -> None:
        self.spec_dirs = tuple(spec_dirs)
        self.kind = kind
        self.specs: tuple[CdiSpec, ...] = ()
        self._read: dict[Path, tuple[tuple[int, int, int], CdiSpec]] = {}
        """Each file's (inode, size, mtime) when it was parsed, and its spec: an unchanged
        file is not parsed again (a spec of a few GPUs is tens of KiB of YAML)."""

    def refresh(self) -> tuple[CdiSpec, ...]:
        """Read every ``*.json``/``*.yaml``/``*.yml`` of the directories; a malformed file is
        an error (a node whose spec is broken must say so, not attach half a driver)."""
        found = []
        read: dict[Path, tuple[tuple[int, int, int], CdiSpec]] = {}
        for directory in self.spec_dirs:
            if not directory.is_dir():
                continue
            for path in sorted(directory.iterdir()):
                if path.suffix not in (".json", ".yaml", ".yml") or not path.is_file():
                    continue
                info = path.stat()
                stamp = (info.st_ino, info.st_size, info.st_mtime_ns)
                known = self._read.get(path)
                spec = known[1] if known is not None and known[0] == stamp else load_spec(path)
                read[path] = (stamp, spec)
                if spec.kind == self.kind:
                    found.append(spec)
        self._read = read
        self.specs = tuple(found)
        return self.specs

    def edits(self, device_node: PurePosixPath) -> ContainerEdits | None:
        """The edits a container started with the device whose node is ``device_node`` gets:
        its spec's common edits and the device's own. ``None`` when no spec names it."""
        for spec in reversed(self.specs):  # the last directory's spec wins, as in CDI
            for name, edits in spec.devices.items():
                if name != _ALL and device_node in edits.device_nodes:
                    return spec.common.merged(edits)
        return None


def _decode(text: str, path: Path) -> object:
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except ValueError as e:
            raise CdiSpecError(f"{path}: not JSON: {e}") from e
    try:
        import yaml  # PyYAML: the agent's Kubernetes extra has it; local mode may not
    except ImportError as e:
        raise CdiSpecError(
            f"{path}: a YAML spec needs PyYAML (pip install pyyaml), or write the spec as "
            "JSON (nvidia-ctk cdi generate --format json)"
        ) from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CdiSpecError(f"{path}: not YAML: {e}") from e


def _list(data: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = data.get(key) or []
    if not isinstance(value, list):
        raise CdiSpecError(f"{where}: {key} is not a list")
    return value


def _path(value: object, where: str) -> PurePosixPath:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise CdiSpecError(f"{where}: {value!r} is not an absolute path")
    path = PurePosixPath(value)
    if ".." in path.parts or str(path) != value.rstrip("/") or path == PurePosixPath("/"):
        raise CdiSpecError(f"{where}: {value!r} is not a normalised path below /")
    return path


def _strings(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and "\0" not in v for v in value):
        raise CdiSpecError(f"{where}: not a list of strings")
    return tuple(value)


def _edits(value: object, where: str) -> ContainerEdits:
    if value is None:
        return ContainerEdits()
    if not isinstance(value, dict):
        raise CdiSpecError(f"{where}: containerEdits is not a mapping")
    env = _strings(value.get("env"), f"{where}.env")
    for item in env:
        if not _ENV.fullmatch(item):
            raise CdiSpecError(f"{where}.env: {item!r} is not KEY=value")
    nodes = tuple(
        _path(n.get("path") if isinstance(n, dict) else None, f"{where}.deviceNodes[{i}].path")
        for i, n in enumerate(_list(value, "deviceNodes", where))
    )
    mounts = []
    for i, m in enumerate(_list(value, "mounts", where)):
        if not isinstance(m, dict):
            raise CdiSpecError(f"{where}.mounts[{i}] is not a mapping")
        mounts.append(
            Mount(
                _path(m.get("hostPath"), f"{where}.mounts[{i}].hostPath"),
                _path(m.get("containerPath"), f"{where}.mounts[{i}].containerPath"),
                _strings(m.get("options"), f"{where}.mounts[{i}].options"),
            )
        )
    hooks = []
    for i, h in enumerate(_list(value, "hooks", where)):
        if not isinstance(h, dict) or not isinstance(h.get("hookName"), str):
            raise CdiSpecError(f"{where}.hooks[{i}] has no hookName")
        hooks.append(
            Hook(
                h["hookName"],
                _path(h.get("path"), f"{where}.hooks[{i}].path"),
                _strings(h.get("args"), f"{where}.hooks[{i}].args"),
            )
        )
    return ContainerEdits(env, nodes, tuple(mounts), tuple(hooks))
