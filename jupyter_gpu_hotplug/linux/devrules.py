"""The device access policy as pure values: one model, rendered by every backend.

Why a separate, I/O-free module: cgroup v1 (``devices.allow``/``devices.deny``
text), cgroup v2 (an eBPF program) and verification (parsing ``devices.list``)
must agree on what "allow c 195:3 rw" means. Modelling it once here, like the
opencontainers cgroups ``devices`` package does, keeps the backends from
re-implementing the policy each in its own slightly different way.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass

#: ``*`` in a rule: any major or any minor.
WILDCARD = None

"""The major of ``/dev/nvidia<minor>`` and ``/dev/nvidiactl`` (fixed by the driver)."""
NVIDIACTL_MINOR = 255


class Access(enum.Flag):
    """The three device cgroup access bits, named as in ``devices.allow``."""

    NONE = 0
    MKNOD = enum.auto()
    READ = enum.auto()
    WRITE = enum.auto()

    @classmethod
    def parse(cls, text: str) -> Access:
        """``"rw"`` → ``READ|WRITE``; rejects anything but the letters r, w, m."""
        bits = {"r": cls.READ, "w": cls.WRITE, "m": cls.MKNOD}
        access = cls.NONE
        for letter in text:
            if letter not in bits:
                raise ValueError(f"invalid device access {text!r}: use letters r, w, m")
            access |= bits[letter]
        return access

    def render(self) -> str:
        """The kernel's spelling, always in ``rwm`` order."""
        return "".join(
            letter
            for letter, bit in (("r", Access.READ), ("w", Access.WRITE), ("m", Access.MKNOD))
            if bit in self
        )


ALL_ACCESS = Access.READ | Access.WRITE | Access.MKNOD
RW = Access.READ | Access.WRITE


class DevType(enum.Enum):
    """Device type letter as the kernel writes it; ``a`` (all) only appears in rules."""

    CHAR = "c"
    BLOCK = "b"
    ALL = "a"


@dataclass(frozen=True)
class DeviceRule:
    """One allow or deny rule; ``major``/``minor`` of ``None`` mean ``*``."""

    type: DevType
    major: int | None
    minor: int | None
    access: Access
    allow: bool = True

    def __post_init__(self) -> None:
        for name in ("major", "minor"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 2**32:
                raise ValueError(f"device {name} {value} out of range")
        if not self.access:
            raise ValueError("a device rule needs at least one of r, w, m")

    def render_v1(self) -> str:
        """The line written to ``devices.allow``/``devices.deny`` (which file is the caller's)."""
        if self.type is DevType.ALL:
            return "a"
        major = "*" if self.major is None else str(self.major)
        minor = "*" if self.minor is None else str(self.minor)
        return f"{self.type.value} {major}:{minor} {self.access.render()}"

    def covers(self, type_: DevType, major: int, minor: int) -> bool:
        """Whether this rule's device pattern matches one concrete device."""
        if self.type is not DevType.ALL and self.type is not type_:
            return False
        if self.major is not None and self.major != major:
            return False
        return self.minor is None or self.minor == minor

    @property
    def is_wildcard(self) -> bool:
        return self.type is DevType.ALL or self.major is None or self.minor is None


def char_device(major: int, minor: int, access: Access = RW, *, allow: bool = True) -> DeviceRule:
    """A rule for exactly one character device, the common case for GPUs."""
    return DeviceRule(DevType.CHAR, major, minor, access, allow)


_LIST_LINE = re.compile(r"^(?P<type>[abc]) (?P<major>\*|\d+):(?P<minor>\*|\d+) (?P<access>[rwm]+)$")


def parse_v1_list(text: str) -> list[DeviceRule]:
    """Parse cgroup v1 ``devices.list`` (the allow list the kernel really enforces).

    ``a *:* rwm`` there means "everything allowed" (the cgroup is in deny-list
    mode); any other line is one allowed pattern.
    """
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        match = _LIST_LINE.match(line)
        if match is None:
            raise ValueError(f"unparseable devices.list line {line!r}")
        major = None if match["major"] == "*" else int(match["major"])
        minor = None if match["minor"] == "*" else int(match["minor"])
        rules.append(
            DeviceRule(DevType(match["type"]), major, minor, Access.parse(match["access"]))
        )
    return rules


def effective_access(
    allowed: Iterable[DeviceRule], type_: DevType, major: int, minor: int
) -> Access:
    """The access an allow list grants to one device: the union of matching rules."""
    access = Access.NONE
    for rule in allowed:
        if rule.allow and rule.covers(type_, major, minor):
            access |= rule.access
    return access


#: What runc/crun allow in every container by default (OCI runtime spec defaults):
#: null, zero, full, random, urandom, tty, console, ptmx, /dev/pts/*, and mknod of any
#: char or block device (mknod alone opens nothing).
CONTAINER_DEFAULTS: tuple[DeviceRule, ...] = (
    DeviceRule(DevType.CHAR, None, None, Access.MKNOD),
    DeviceRule(DevType.BLOCK, None, None, Access.MKNOD),
    char_device(1, 3, ALL_ACCESS),  # /dev/null
    char_device(1, 5, ALL_ACCESS),  # /dev/zero
    char_device(1, 7, ALL_ACCESS),  # /dev/full
    char_device(1, 8, ALL_ACCESS),  # /dev/random
    char_device(1, 9, ALL_ACCESS),  # /dev/urandom
    char_device(5, 0, ALL_ACCESS),  # /dev/tty
    char_device(5, 1, ALL_ACCESS),  # /dev/console
    char_device(5, 2, ALL_ACCESS),  # /dev/ptmx
    DeviceRule(DevType.CHAR, 136, None, ALL_ACCESS),  # /dev/pts/*
)


@dataclass(frozen=True, order=True)
class CharDevice:
    """One concrete character device number, as a device node's ``st_rdev`` names it.

    Rules are patterns that may hold ``*``; granting, revoking, creating a node and
    finding who holds a device open all need one plain number pair instead.
    """

    major: int
    minor: int

    def __post_init__(self) -> None:
        for name in ("major", "minor"):
            value = getattr(self, name)
            if not 0 <= value < 2**32:
                raise ValueError(f"device {name} {value} out of range")

    def rule(self, access: Access = RW, *, allow: bool = True) -> DeviceRule:
        """The rule naming exactly this device."""
        return char_device(self.major, self.minor, access, allow=allow)

    def __str__(self) -> str:
        return f"c {self.major}:{self.minor}"


def v1_allow_list(rules: Iterable[DeviceRule]) -> list[DeviceRule]:
    """The ``devices.list`` a v1 cgroup shows after ``a`` went to ``devices.deny``
    and then ``rules``, in order (allow rules to ``devices.allow``, deny rules to
    ``devices.deny``).

    Mirrors security/device_cgroup.c in allow-list mode: an allow merges its access
    into the entry with the same pattern or appends one; a deny clears bits only of
    the entry with exactly the same pattern, so it never punches a hole in a
    wildcard. Type ``a`` rules switch the cgroup's whole mode and are refused here.
    """
    entries: dict[tuple[DevType, int | None, int | None], Access] = {}
    for rule in rules:
        if rule.type is DevType.ALL:
            raise ValueError(f"rule {rule.render_v1()!r} switches the cgroup's mode; not modelled")
        key = (rule.type, rule.major, rule.minor)
        if rule.allow:
            entries[key] = entries.get(key, Access.NONE) | rule.access
        elif key in entries:
            remaining = entries[key] & ~rule.access
            if remaining:
                entries[key] = remaining
            else:
                del entries[key]
    return [DeviceRule(*pattern, access) for pattern, access in entries.items()]
