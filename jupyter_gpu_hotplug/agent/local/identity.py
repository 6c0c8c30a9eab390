"""Who is calling, and may they act on this target? Local mode's ``Identity``.

Why it exists: the agent runs as root and changes other processes' device access, so each
request must be tied to a caller before anything happens. Local mode knows two kinds:

- a process on the **unix socket**, identified by the kernel (``SO_PEERCRED``: pid, uid, gid at
  connect time, and ``SO_PEERPIDFD``: a pidfd for that very process). Its container is resolved
  **once, when the connection is accepted**, and proven to be the peer's by the pidfd (the
  process was still alive after its cgroups were read, so its pid had not been reused). Every
  request on the connection acts as that container, never as whatever process holds the pid
  later: a connection kept open by a child after its parent exited cannot borrow the identity
  of a process in another container that inherits the pid. Without a token it may act on
  **its own container** only: the target's device cgroups must be the caller's or an ancestor's
  of them — exactly what a grant to the target reaches (a v1 allow is written to the container's
  cgroup and every descendant). This is how a kernel in a sandbox attaches a GPU to itself.
- a holder of the **agent token** (``<state-dir>/token``, created 0600 at first start, like
  Jupyter's own token), on either transport: it may act on any target the resolver accepts.
  TCP offers no peer identity, so over TCP the token is required for everything but the
  probes (``/healthz``, ``/readyz``); ``/metrics`` and ``/v1/openapi.json`` take either kind
  of caller, like the API.

A wrong token is refused (401) even on the unix socket: a client that sends credentials means
to use them, and silently falling back to its peer identity would hide its mistake.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import signal
import stat
from pathlib import Path
from typing import Protocol

from ..._structs import PidRef, Target, TargetRef
from ..core.errors import Forbidden, NotFound, Unauthenticated
from ..core.seams import (
    Caller,
    ConnectionInfo,
    ContainerCgroups,
    ContainerKey,
    HostContainer,
    PeerCredentials,
    Verb,
)
from ..statedir import unsafe_reason
from .resolver import LOCAL_TARGET_HINT

__all__ = ["LocalIdentity", "TokenError", "load_or_create_token"]

log = logging.getLogger(__name__)

_TOKEN_BYTES = 32
_MAX_TOKEN_FILE = 4096


class TokenError(Exception):
    """The token file cannot be read or created safely."""


def load_or_create_token(path: Path) -> str:
    """The agent token stored at ``path``; created (0600, ``token_urlsafe(32)``) if missing.

    An existing file is adopted only if it is the agent user's own with mode 0600 (or
    stricter), never through a symlink: the token grants root-level power over every
    container's devices, and one that someone else prepared or could read is known to them.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return _read_token(path)
    except OSError as e:
        raise TokenError(f"cannot create the token file {path}: {e.strerror}") from e
    token = secrets.token_urlsafe(_TOKEN_BYTES)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, f"{token}\n".encode("ascii"))
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise TokenError(f"cannot write the token file {path}: {e.strerror}") from e
    os.close(fd)
    log.info("created the agent token in %s (mode 0600)", path)
    return token


def _read_token(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        reason = "it is a symlink" if e.errno == errno.ELOOP else e.strerror
        raise TokenError(f"cannot read the token file {path}: {reason}") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TokenError(f"the token file {path} is not a regular file")
        unsafe = unsafe_reason(info, forbidden_bits=0o077)
        if unsafe is not None:
            # Someone else's, or readable by others: it may be known to them already.
            raise TokenError(
                f"refusing the token file {path}: {unsafe}; delete it to have a new one "
                "created (mode 0600)"
            )
        data = os.read(fd, _MAX_TOKEN_FILE)
    except OSError as e:
        raise TokenError(f"cannot read the token file {path}: {e.strerror}") from e
    finally:
        os.close(fd)
    token = data.decode("ascii", "replace").strip()
    if len(token) < 16 or not token.isprintable() or " " in token:
        raise TokenError(
            f"the token file {path} does not hold a token; delete it to have a new one created"
        )
    return token


class PeerResolver(Protocol):
    """What the identity asks of local mode's resolver (``ProcResolver``)."""

    @property
    def agent_container(self) -> ContainerCgroups: ...

    def container_of(self, pid: int) -> ContainerCgroups | None: ...

    def key_of(self, container: ContainerCgroups) -> ContainerKey: ...

    def oldest_member(self, container: ContainerCgroups) -> int | None: ...


class LocalIdentity:
    """``Identity`` of local mode: the agent token, or the unix socket's peer container."""

    def __init__(self, token: str, *, token_path: Path, resolver: PeerResolver) -> None:
        self._token = token.encode()
        self._token_path = token_path
        self._resolver = resolver

    def bind_connection(self, *, peer: PeerCredentials | None, pidfd: int | None) -> ConnectionInfo:
        if peer is None:
            return ConnectionInfo(transport="tcp")
        unbound = ConnectionInfo(transport="unix", peer=peer)
        if pidfd is None:
            # No pidfd (not given by this kernel): the cgroups read could be another
            # process's, so the connection gets no container.
            return unbound
        container = self._resolver.container_of(peer.pid)
        try:
            # After the read: the peer still lives, so the pid was still its own.
            signal.pidfd_send_signal(pidfd, 0)
        except ProcessLookupError:
            return unbound
        if container is None:
            return unbound
        return ConnectionInfo(
            transport="unix",
            peer=peer,
            container=self._resolver.key_of(container),
            cgroups=container,
        )

    async def authenticate(
        self, *, authorization: str | None, connection: ConnectionInfo
    ) -> Caller:
        peer = connection.peer
        who = f"pid {peer.pid} uid {peer.uid}" if peer is not None else connection.transport
        if authorization is not None:
            scheme, _, credentials = authorization.strip().partition(" ")
            if scheme.lower() != "bearer" or not credentials.strip():
                raise Unauthenticated(
                    "the Authorization header must be 'Bearer <token>'", hint=self._hint()
                )
            if not hmac.compare_digest(credentials.strip().encode(), self._token):
                raise Unauthenticated(
                    "the bearer token is not this agent's token", hint=self._hint()
                )
            return Caller(
                description=f"{who} with token",
                container=connection.container,
                cgroups=connection.cgroups,
                privileged=True,
                connection=connection,
            )
        if peer is None:
            raise Unauthenticated(
                "no credentials: over TCP a bearer token is required", hint=self._hint()
            )
        return Caller(
            description=who,
            container=connection.container,
            cgroups=connection.cgroups,
            connection=connection,
        )

    async def authenticate_reader(
        self, *, authorization: str | None, connection: ConnectionInfo, path: str
    ) -> Caller:
        """Any caller of the API: the token holder, or a peer of the socket (whose mode
        already says who may connect)."""
        return await self.authenticate(authorization=authorization, connection=connection)

    async def may_see(self, caller: Caller, target: Target) -> bool:
        """Yes: a target is a process of this host, which its users see in ``/proc``."""
        return True

    def _hint(self) -> str:
        return (
            f"send 'Authorization: Bearer <token>' with the token from {self._token_path} "
            "(readable by root), or call through the agent's unix socket to act on your own "
            "container without one"
        )

    async def authorize(self, caller: Caller, verb: Verb, target: HostContainer) -> None:
        """``Forbidden`` unless the caller holds the token or the target's grant reaches the
        caller's own container."""
        if caller.privileged:
            return
        if caller.cgroups is None:
            raise Forbidden(
                f"{caller} is in no container the agent could tell when it connected",
                hint="call from a process inside the container, and keep it running while "
                "it is connected",
            )
        if not caller.cgroups.within(target.cgroups):
            raise Forbidden(
                f"{target.target} is not in your container (yours: {caller.cgroups}; its: "
                f"{target.cgroups})",
                hint="without the agent token you may act on your own container only; "
                "leave out the target to mean yourself",
            )

    def self_target(self, caller: Caller) -> TargetRef:
        """The oldest process of the caller's container (it outlives a terminal command)."""
        if caller.connection is None or caller.connection.transport == "tcp":
            # A well-formed request whose target, "the caller itself", does not exist: a
            # token over TCP is nobody's container (404, like a caller that has exited).
            raise NotFound(
                "container of the caller",
                str(caller),
                hint="over TCP the agent cannot tell who 'the caller itself' is; name the "
                f"target ({LOCAL_TARGET_HINT})",
            )
        if caller.cgroups is None:
            raise NotFound("process", str(caller), hint="the calling process exited")
        if caller.cgroups.in_root_cgroup or caller.cgroups == self._resolver.agent_container:
            raise Forbidden(
                f"{caller} is not in a container ({caller.cgroups}), so it has no container "
                "to attach a GPU to",
                hint="call from inside a container or sandbox, or name the target",
            )
        oldest = self._resolver.oldest_member(caller.cgroups)
        if oldest is None:
            raise NotFound("process", str(caller), hint="your container has no process left")
        return PidRef(oldest)
