"""``%load_ext jupyter_gpu_hotplug`` and ``%gpu`` in a real ipykernel, as a notebook runs them."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import start_new_async_kernel

from jupyter_gpu_hotplug import __version__

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0
"""Upper bound for a reply on a loaded shared machine; never an assertion about speed."""


@pytest.fixture
async def kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[AsyncKernelClient]:
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    # The kernel must import this checkout, installed or not.
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    manager, client = await start_new_async_kernel(
        kernel_name="python3",
        env={**os.environ, "PYTHONPATH": pythonpath},
        startup_timeout=DEADLINE_S,
    )
    try:
        yield client
    finally:
        client.stop_channels()
        await manager.shutdown_kernel(now=True)


async def _execute(client: AsyncKernelClient, code: str) -> tuple[dict[str, Any], str, str]:
    """Run ``code``; return the reply content and the stdout and stderr texts."""
    streams: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def on_output(message: dict[str, Any]) -> None:
        if message["msg_type"] == "stream":
            streams[message["content"]["name"]].append(message["content"]["text"])

    reply = await client.execute_interactive(code, timeout=DEADLINE_S, output_hook=on_output)
    return reply["content"], "".join(streams["stdout"]), "".join(streams["stderr"])


async def test_gpu_version_in_a_kernel(kernel: AsyncKernelClient) -> None:
    reply, out, _ = await _execute(kernel, "%load_ext jupyter_gpu_hotplug\n%gpu version")

    assert reply["status"] == "ok"
    assert out == f"jupyter-gpu-hotplug {__version__}\n"


async def test_bad_input_reports_usage_error_and_the_kernel_lives_on(
    kernel: AsyncKernelClient,
) -> None:
    reply, _, err = await _execute(kernel, "%load_ext jupyter_gpu_hotplug\n%gpu bogus")
    # IPython shows a UsageError as one line on stderr, without a traceback.
    assert (reply["status"], reply["ename"]) == ("error", "UsageError")
    assert "invalid choice: 'bogus'" in err
    assert "Traceback" not in err

    reply, out, _ = await _execute(kernel, "print(6 * 7)")
    assert (reply["status"], out) == ("ok", "42\n")
