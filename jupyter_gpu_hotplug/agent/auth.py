"""Who is calling, and may they act on this target? Local mode's identity and authorization.

Why it exists: the agent runs as root and changes other processes' device access, so each
request must be tied to a caller before anything happens. Local mode knows two kinds:

- a process on the **unix socket**, identified by the kernel (``SO_PEERCRED``: pid, uid, gid at
  connect time). Without a token it may act on **its own container** only: the target's device
  cgroups must equal the caller's. This is how a kernel in a sandbox attaches a GPU to itself.
- a holder of the **agent token** (``<state-dir>/token``, created 0600 at first start, like
  Jupyter's own token), on either transport: it may act on any target the resolver accepts.
  TCP offers no peer identity, so over TCP the token is required for everything but the
  unauthenticated endpoints (``/healthz``, ``/metrics``, ``/v1/openapi.json``).

A wrong token is refused (401) even on the unix socket: a client that sends credentials means
to use them, and silently falling back to its peer identity would hide its mistake.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .errors import Forbidden, Unauthenticated
from .resolver import ResolvedTarget, Resolver
from .statedir import unsafe_reason

__all__ = [
    "Authenticator",
    "Authorizer",
    "Caller",
    "PeerCredentials",
    "TokenError",
    "load_or_create_token",
]

log = logging.getLogger(__name__)

_TOKEN_BYTES = 32
_MAX_TOKEN_FILE = 4096


class TokenError(Exception):
    """The token file cannot be read or created safely."""


@dataclass(frozen=True)
class PeerCredentials:
    """The process at the other end of a unix socket, as the kernel recorded it at connect."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Caller:
    """An authenticated caller."""

    transport: Literal["unix", "tcp"]
    peer: PeerCredentials | None
    """The calling process (unix socket only)."""
    has_token: bool
    """Presented the agent token: may act on any acceptable target."""

    def __str__(self) -> str:
        who = f"pid {self.peer.pid} uid {self.peer.uid}" if self.peer else self.transport
        return f"{who}{' with token' if self.has_token else ''}"


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


class Authenticator:
    """Turns a request's credentials into a ``Caller``, or refuses with 401."""

    def __init__(self, token: str, *, token_path: Path) -> None:
        self._token = token.encode()
        self._token_path = token_path

    def authenticate(self, *, authorization: str | None, peer: PeerCredentials | None) -> Caller:
        transport: Literal["unix", "tcp"] = "unix" if peer is not None else "tcp"
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
            return Caller(transport=transport, peer=peer, has_token=True)
        if peer is None:
            raise Unauthenticated(
                "no credentials: over TCP a bearer token is required", hint=self._hint()
            )
        return Caller(transport="unix", peer=peer, has_token=False)

    def _hint(self) -> str:
        return (
            f"send 'Authorization: Bearer <token>' with the token from {self._token_path} "
            "(readable by root), or call through the agent's unix socket to act on your own "
            "container without one"
        )


class Authorizer:
    """Decides whether an authenticated caller may act on a resolved target."""

    def __init__(self, resolver: Resolver) -> None:
        self._resolver = resolver

    def check(self, caller: Caller, target: ResolvedTarget) -> None:
        """Raise ``Forbidden`` unless the caller holds the token or shares the container."""
        if caller.has_token:
            return
        if caller.peer is None:
            raise Forbidden("no identity to authorize", hint="send the agent token")
        own = self._resolver.container_of(caller.peer.pid)
        if own is None:
            raise Forbidden(
                f"the calling process {caller.peer.pid} exited before it could be authorized",
                hint="call from a running process",
            )
        if own != target.container:
            raise Forbidden(
                f"{target.target} is not in your container (yours: {own}; its: {target.container})",
                hint="without the agent token you may act on your own container only; "
                "leave out the target to mean yourself",
            )
