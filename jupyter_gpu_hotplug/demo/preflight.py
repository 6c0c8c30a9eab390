"""Refuse early, and say why: what the demo needs from this machine, checked before it starts.

Why it exists: a demo that starts an agent, builds a library and launches JupyterLab only to
fail on the last step (a busy port) or midway (no permission to create a cgroup) leaves the
user with a wall of logs. Every condition that can be known up front is checked here, in the
order a user would fix them, and each failure is a ``DemoUnavailable`` naming the cause and
what would work. Nothing here starts a process or writes a file.

The facts about the machine (platform, effective uid) are parameters, so the messages are
tested without being root or on another system.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
import sys
from pathlib import Path
from typing import Final

from .errors import DemoUnavailable
from .options import DemoOptions

__all__ = [
    "SUN_PATH_MAX",
    "check_cgroups",
    "check_jupyterlab",
    "check_notebook_dir",
    "check_platform",
    "check_port",
    "check_root",
    "check_socket_path",
    "check_state_dir",
    "preflight",
    "rerun_as_root_hint",
]

SUN_PATH_MAX: Final = 107
"""The longest unix socket path ``sockaddr_un`` holds (108 bytes with the NUL)."""


def rerun_as_root_hint(executable: str = sys.executable) -> str:
    """How to start the demo as root with this installation's ``jupyter``.

    ``sudo`` usually resets ``PATH``, so the absolute path of the ``jupyter`` beside this
    interpreter is suggested when there is one. The user asking may not be allowed into the
    directory the installation lives in (a clone under ``/root``, a 0700 home): then it is
    suggested unseen, because root, who will run it, may enter.
    """
    jupyter = Path(executable).with_name("jupyter")
    try:
        beside = jupyter.is_file()
    except PermissionError:
        beside = True
    command = str(jupyter) if beside else "jupyter"
    return (
        f"Run it as root: sudo {command} gpu-hotplug demo "
        "(or, from a clone of the repository: sudo bash .ci/demo)."
    )


def check_platform(platform: str = sys.platform) -> None:
    """The demo's sandboxes are Linux cgroups and mount namespaces."""
    if not platform.startswith("linux"):
        raise DemoUnavailable(
            f"The demo needs Linux, and this is {platform}: each kernel runs in a sandbox made "
            "of Linux cgroups and a mount namespace, and GPUs are hot-plugged with Linux "
            "device cgroups.",
            hint=(
                "Run it on a Linux machine or in a Linux VM (a container works if it is "
                "privileged, e.g. docker run --privileged --cgroupns=host)."
            ),
        )


def check_root(euid: int) -> None:
    """Creating cgroups, mount namespaces and device nodes needs root (``CAP_SYS_ADMIN``)."""
    if euid != 0:
        raise DemoUnavailable(
            "The demo must run as root: it creates a cgroup and a mount namespace for every "
            "kernel, and its agent changes device cgroups and creates device nodes inside them.",
            hint=rerun_as_root_hint(),
        )


def check_cgroups() -> None:
    """At least one device-cgroup hierarchy must be mounted and writable (v1 or cgroup2)."""
    from ..linux import cgroups

    try:
        hierarchies = cgroups.discover()
    except cgroups.CgroupError as e:
        raise DemoUnavailable(
            f"Cannot tell which cgroup hierarchies this machine has: {e}",
            hint="The demo needs /proc mounted and cgroups (v1 'devices' or cgroup2) enabled.",
        ) from e
    mounts = [m for m in (hierarchies.devices_v1, hierarchies.unified) if m is not None]
    if not any(os.access(mount.mount_point, os.W_OK) for mount in mounts):
        found = ", ".join(str(m.mount_point) for m in mounts) or "none mounted"
        raise DemoUnavailable(
            "No writable device cgroup hierarchy (the v1 'devices' controller or cgroup2; "
            f"found: {found}), so kernels cannot be confined and GPUs cannot be granted.",
            hint=(
                "Run the demo on the host, or in a container started with --privileged and "
                "--cgroupns=host, so that /sys/fs/cgroup is writable."
            ),
        )


def check_jupyterlab() -> None:
    """The demo serves JupyterLab, which this package itself does not depend on."""
    if importlib.util.find_spec("jupyterlab") is None:
        raise DemoUnavailable(
            f"JupyterLab is not installed in this Python environment ({sys.prefix}).",
            hint=f"Install it: {sys.executable} -m pip install 'jupyter-gpu-hotplug[demo]'",
        )


def check_port(ip: str, port: int) -> None:
    """JupyterLab can listen on ``ip:port`` (checked the way it binds: with SO_REUSEADDR)."""
    try:
        addresses = socket.getaddrinfo(ip, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        # UnicodeError: a malformed name ("a..b") fails in the IDNA codec, before any lookup.
        detail = e.strerror if isinstance(e, socket.gaierror) else "not a valid host name"
        raise DemoUnavailable(
            f"Cannot listen on {ip!r}: it is not an address or host name of this machine "
            f"({detail}).",
            hint="Give --ip an address of this machine, e.g. 127.0.0.1 or 0.0.0.0.",
        ) from e
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as e:
                raise _bind_failure(ip, port, e) from e


def _bind_failure(ip: str, port: int, error: OSError) -> DemoUnavailable:
    if error.errno == errno.EADDRINUSE:
        return DemoUnavailable(
            f"Port {port} on {ip} is already in use (another Jupyter server?).",
            hint=f"Stop what is using it, or choose another port: --port {_next_port(port)}",
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return DemoUnavailable(
            f"Cannot listen on {ip}: that address does not belong to this machine.",
            hint="Give --ip an address of this machine, e.g. 127.0.0.1 or 0.0.0.0.",
        )
    return DemoUnavailable(
        f"Cannot listen on {ip}:{port}: {error.strerror}.",
        hint="Choose another --port or --ip.",
    )


def _next_port(port: int) -> int:
    return port + 1 if port < 65535 else 8889


def check_socket_path(path: Path) -> None:
    """The agent's unix socket lives in the state dir, and its path has a size limit."""
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise DemoUnavailable(
            f"The state directory's path is too long for the agent's unix socket ({path} is "
            f"over {SUN_PATH_MAX} bytes).",
            hint="Give a shorter --state-dir, e.g. /tmp/gpu-demo.",
        )


def check_state_dir(path: Path) -> None:
    """A given ``--state-dir`` must be a directory, or a path where one can be made."""
    if path.exists() and not path.is_dir():
        raise DemoUnavailable(
            f"--state-dir {path} exists and is not a directory.",
            hint="Give a directory (it is created if missing), or leave --state-dir out.",
        )


def check_notebook_dir(path: Path) -> None:
    """The notebooks directory must be a directory, or a path where one can be made."""
    if path.exists() and not path.is_dir():
        raise DemoUnavailable(
            f"--notebook-dir {path} exists and is not a directory.",
            hint="Give a directory (it is created if missing), or leave --notebook-dir out "
            "to save notebooks in the current directory.",
        )


def preflight(
    options: DemoOptions,
    *,
    socket_path: Path | None,
    notebooks: Path | None = None,
    platform: str = sys.platform,
    euid: int | None = None,
) -> None:
    """Every check, in the order a user would fix them; raises the first ``DemoUnavailable``.

    ``socket_path`` is where the agent's socket will be, when the state dir is known now;
    ``notebooks`` where notebooks will be saved.
    """
    check_platform(platform)
    check_root(os.geteuid() if euid is None else euid)
    check_cgroups()
    check_jupyterlab()
    if options.state_dir is not None:
        check_state_dir(options.state_dir)
    if notebooks is not None:
        check_notebook_dir(notebooks)
    if socket_path is not None:
        check_socket_path(socket_path)
    check_port(options.ip, options.port)
