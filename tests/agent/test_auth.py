"""Identity in local mode: the token file, bearer credentials, unix-socket peers."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.agent.api.connection import peer_credentials, peer_pidfd
from jupyter_gpu_hotplug.agent.core.errors import Forbidden, Unauthenticated
from jupyter_gpu_hotplug.agent.core.seams import Caller, ConnectionInfo, PeerCredentials
from jupyter_gpu_hotplug.agent.local.identity import (
    LocalIdentity,
    TokenError,
    load_or_create_token,
)

from .fakes import FakeHost, FakeResolver

TOKEN = "a-token-long-enough-to-be-accepted-0123"
PEER = PeerCredentials(pid=1234, uid=1000, gid=1000)


def test_token_is_created_0600_once(tmp_path: Path) -> None:
    path = tmp_path / "token"

    first = load_or_create_token(path)
    again = load_or_create_token(path)

    assert first == again
    assert len(first) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_token_readable_by_others_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)

    assert load_or_create_token(path) == TOKEN
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: p.symlink_to("/etc/hostname"), id="symlink"),
        pytest.param(lambda p: p.mkdir(), id="directory"),
        pytest.param(lambda p: p.write_text("short"), id="too-short"),
        pytest.param(lambda p: p.write_text("has spaces in the middle of it"), id="spaces"),
    ],
)
def test_bad_token_files_are_refused(tmp_path: Path, make: object) -> None:
    path = tmp_path / "token"
    make(path)  # type: ignore[operator]

    with pytest.raises(TokenError):
        load_or_create_token(path)


HOST = FakeHost()
IDENTITY = LocalIdentity(TOKEN, token_path=Path("/state/token"), resolver=FakeResolver(HOST))
TCP = ConnectionInfo(transport="tcp")
UNIX = ConnectionInfo(transport="unix", peer=PEER)


@pytest.mark.parametrize(
    ("authorization", "connection", "privileged"),
    [
        (f"Bearer {TOKEN}", TCP, True),
        (f"bearer  {TOKEN} ", TCP, True),
        (f"Bearer {TOKEN}", UNIX, True),
        (None, UNIX, False),
    ],
    ids=["tcp-token", "scheme-case-and-spaces", "unix-token", "unix-peer"],
)
async def test_accepted_credentials(
    authorization: str | None, connection: ConnectionInfo, privileged: bool
) -> None:
    caller = await IDENTITY.authenticate(authorization=authorization, connection=connection)

    assert caller.privileged is privileged
    assert caller.connection == connection


@pytest.mark.parametrize(
    ("authorization", "connection"),
    [
        (None, TCP),
        ("Bearer wrong", TCP),
        (f"Basic {TOKEN}", TCP),
        ("Bearer", TCP),
        (f"Bearer {TOKEN}x", UNIX),
        (f"Bearer {TOKEN[:-1]}", UNIX),
    ],
    ids=["tcp-nothing", "tcp-wrong", "basic", "empty", "unix-longer", "unix-shorter"],
)
async def test_refused_credentials(authorization: str | None, connection: ConnectionInfo) -> None:
    with pytest.raises(Unauthenticated) as caught:
        await IDENTITY.authenticate(authorization=authorization, connection=connection)

    assert "/state/token" in caught.value.message
    assert TOKEN not in caught.value.message


def test_peer_credentials_and_pidfd_of_a_unix_socket() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        assert peer_credentials(left) == PeerCredentials(os.getpid(), os.getuid(), os.getgid())
        pidfd = peer_pidfd(left)
        assert pidfd is not None
        try:
            # The pidfd names this very process: it answers for our pid in fdinfo.
            fdinfo = Path(f"/proc/self/fdinfo/{pidfd}").read_text()
            assert f"Pid:\t{os.getpid()}" in fdinfo
        finally:
            os.close(pidfd)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        assert peer_credentials(tcp) is None
    assert peer_credentials(None) is None


async def test_authorization_by_container() -> None:
    host = FakeHost()
    resolver = FakeResolver(host)
    identity = LocalIdentity(TOKEN, token_path=Path("/state/token"), resolver=resolver)
    mine = host.spawn(100, "a")
    host.spawn(150, "a")
    theirs = host.spawn(200, "b")
    host.spawn(250, "a/child")

    async def caller(pid: int, *, token: bool = False) -> Caller:
        pidfd = os.pidfd_open(os.getpid())
        try:
            info = identity.bind_connection(peer=PeerCredentials(pid, 0, 0), pidfd=pidfd)
        finally:
            os.close(pidfd)
        return await identity.authenticate(
            authorization=f"Bearer {TOKEN}" if token else None, connection=info
        )

    await identity.authorize(await caller(150), "create", resolver.resolve(mine.target_ref))
    await identity.authorize(await caller(250), "create", resolver.resolve(mine.target_ref))
    await identity.authorize(
        await caller(150, token=True), "create", resolver.resolve(theirs.target_ref)
    )
    admin = await identity.authenticate(authorization=f"Bearer {TOKEN}", connection=TCP)
    await identity.authorize(admin, "create", resolver.resolve(theirs.target_ref))
    with pytest.raises(Forbidden, match="not in your container"):
        await identity.authorize(await caller(150), "create", resolver.resolve(theirs.target_ref))
    # A grant to a/child does not reach a: a caller in a may not act on it.
    with pytest.raises(Forbidden, match="not in your container"):
        await identity.authorize(await caller(150), "create", resolver.resolve(PidRef(250)))
    with pytest.raises(Forbidden, match="no container"):
        await identity.authorize(await caller(999), "create", resolver.resolve(mine.target_ref))
