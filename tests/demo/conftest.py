"""Fixtures for the demo's tests: demos started as subprocesses (always cleaned up), and a
port already in use."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.fixtures.agent import free_tcp_port

from .demo_process import DemoProcess


class DemoFactory:
    """Starts ``jupyter gpu-hotplug demo`` for one test; ends whatever is left afterwards."""

    def __init__(self, tmp_path: Path) -> None:
        self._tmp_path = tmp_path
        self.demos: list[DemoProcess] = []
        self.state_dirs: list[Path] = []

    def new_state_dir(self) -> Path:
        """A short path in /tmp: the agent's unix socket lives in it (108-byte limit)."""
        path = Path(tempfile.mkdtemp(prefix="gh-demo-", dir="/tmp"))
        self.state_dirs.append(path)
        return path

    @property
    def notebook_dir(self) -> Path:
        """Where this test's demos save notebooks (never the current directory)."""
        return self._tmp_path / "notebooks"

    def __call__(
        self,
        *,
        simulate: int = 2,
        temporary: bool = False,
        state_dir: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> DemoProcess:
        """A running demo; ``temporary``: without ``--state-dir`` (the demo makes its own);
        ``state_dir``: this one (default: a new one); ``env``: its environment."""
        demo = DemoProcess.start(
            None if temporary else state_dir or self.new_state_dir(),
            notebook_dir=self.notebook_dir,
            env=env,
            port=free_tcp_port(),
            simulate=simulate,
            output_path=self._tmp_path / f"demo-{len(self.demos)}.out",
        )
        self.demos.append(demo)
        print(f"demo {len(self.demos)} ready in {demo.startup_seconds:.1f} s (its own measure)")
        return demo

    def close(self) -> None:
        for demo in self.demos:
            demo.kill_everything()
            if demo.layout.root not in self.state_dirs and demo.layout.root.exists():
                self.state_dirs.append(demo.layout.root)
        for path in self.state_dirs:
            if path.exists():
                shutil.rmtree(path)


@pytest.fixture
def demo_factory(tmp_path: Path) -> Iterator[DemoFactory]:
    factory = DemoFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port of 127.0.0.1 that a socket listens on for the duration of the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]
