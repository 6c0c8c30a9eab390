"""Identity in local mode: the token file, bearer credentials, unix-socket peers."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from jupyter_gpu_hotplug.agent.auth import (
    Authenticator,
    Authorizer,
    Caller,
    PeerCredentials,
    TokenError,
    load_or_create_token,
)
from jupyter_gpu_hotplug.agent.errors import Forbidden, Unauthenticated
from jupyter_gpu_hotplug.agent.handlers import peer_credentials

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


def test_token_readable_by_others_is_refused(tmp_path: Path) -> None:
    # Regression (issue 9): it used to be tightened and adopted, though it may have leaked.
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)

    with pytest.raises(TokenError, match=rf"{path}.*owner uid 0 \(root\), mode 0644"):
        load_or_create_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # left as found


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


AUTH = Authenticator(TOKEN, token_path=Path("/state/token"))


@pytest.mark.parametrize(
    ("authorization", "peer", "expected"),
    [
        (f"Bearer {TOKEN}", None, Caller("tcp", None, True)),
        (f"bearer  {TOKEN} ", None, Caller("tcp", None, True)),
        (f"Bearer {TOKEN}", PEER, Caller("unix", PEER, True)),
        (None, PEER, Caller("unix", PEER, False)),
    ],
    ids=["tcp-token", "scheme-case-and-spaces", "unix-token", "unix-peer"],
)
def test_accepted_credentials(
    authorization: str | None, peer: PeerCredentials | None, expected: Caller
) -> None:
    assert AUTH.authenticate(authorization=authorization, peer=peer) == expected


@pytest.mark.parametrize(
    ("authorization", "peer"),
    [
        (None, None),
        ("Bearer wrong", None),
        (f"Basic {TOKEN}", None),
        ("Bearer", None),
        (f"Bearer {TOKEN}x", PEER),
        (f"Bearer {TOKEN[:-1]}", PEER),
    ],
    ids=["tcp-nothing", "tcp-wrong", "basic", "empty", "unix-longer", "unix-shorter"],
)
def test_refused_credentials(authorization: str | None, peer: PeerCredentials | None) -> None:
    with pytest.raises(Unauthenticated) as caught:
        AUTH.authenticate(authorization=authorization, peer=peer)

    assert "/state/token" in caught.value.message
    assert TOKEN not in caught.value.message


def test_peer_credentials_of_a_unix_socket() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        assert peer_credentials(left) == PeerCredentials(os.getpid(), os.getuid(), os.getgid())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        assert peer_credentials(tcp) is None
    assert peer_credentials(None) is None


def test_authorization_by_container() -> None:
    host = FakeHost()
    resolver = FakeResolver(host)
    mine = host.spawn(100, "a")
    host.spawn(150, "a")
    theirs = host.spawn(200, "b")
    authorizer = Authorizer(resolver)

    def caller(pid: int, *, token: bool = False) -> Caller:
        return Caller("unix", PeerCredentials(pid, 0, 0), token)

    authorizer.check(caller(150), resolver.resolve(mine.target_ref))
    authorizer.check(caller(150, token=True), resolver.resolve(theirs.target_ref))
    authorizer.check(Caller("tcp", None, True), resolver.resolve(theirs.target_ref))
    with pytest.raises(Forbidden, match="not in your container"):
        authorizer.check(caller(150), resolver.resolve(theirs.target_ref))
    with pytest.raises(Forbidden, match="exited"):
        authorizer.check(caller(999), resolver.resolve(mine.target_ref))
