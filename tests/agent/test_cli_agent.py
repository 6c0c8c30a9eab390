"""``jupyter gpu-hotplug agent|attach|detach|status`` against a served agent (over fakes).

The terminal commands go through the shared ``AgentClient``; here they talk to a real tornado
agent on a unix socket (as a process in a container would, no token) and over TCP with the
token file. ``agent`` itself is run as a subprocess: it configures the process's logging.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.agent.settings import TcpAddress, UnixAddress
from jupyter_gpu_hotplug.cli import main
from jupyter_gpu_hotplug.cli_agent import holder_name

from .api_harness import TOKEN, ServedAgent, self_in

ROOT = Path(__file__).parents[2]


@pytest.fixture
def unix_url(served: ServedAgent) -> str:
    address = served.unix.address
    assert isinstance(address, UnixAddress)
    served.host.spawn(100, "kernel-a")  # older than this process: the container's "itself"
    self_in(served, "kernel-a")
    return f"unix:{address.path}"


@pytest.fixture(autouse=True)
def no_agent_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GPU_HOTPLUG_AGENT_URL", "GPU_HOTPLUG_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)


def test_attach_status_detach_on_the_unix_socket(
    served: ServedAgent, unix_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["attach", "2", "--agent-url", unix_url]) == 0
    out = capsys.readouterr().out
    assert out.startswith("attached 2 GPUs:")
    assert "/dev/nvidia0" in out and "/dev/nvidia1" in out
    assert "start a new process" in out

    assert main(["status", "--agent-url", unix_url]) == 0
    out = capsys.readouterr().out
    assert "GPUs of this node (4):" in out
    assert out.count("attached -> process 100") == 2
    assert "attached here (2):" in out

    gpu = served.ledger.attachments()[0].gpu
    assert main(["detach", gpu.uuid, "--agent-url", unix_url]) == 0
    assert capsys.readouterr().out == f"detached GPU {gpu.index} ({gpu.uuid})\n"
    assert main(["detach", "--agent-url", unix_url]) == 0
    assert served.ledger.attachments() == []


def test_attach_a_named_gpu(
    served: ServedAgent, unix_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 36 item 6: the node's GPU 2, not the first free one.
    assert main(["attach", "--gpu", "2", "--agent-url", unix_url]) == 0
    assert "/dev/nvidia2" in capsys.readouterr().out
    assert [e.gpu.index for e in served.ledger.attachments()] == [2]

    assert main(["attach", "--gpu", "2", "--agent-url", unix_url]) == 1
    err = capsys.readouterr().err
    assert "GPU 2 (" in err and "is already attached to process 100" in err
    assert "--wait" not in err  # waiting cannot help: it is this container's already
    assert main(["attach", "--gpu", "9", "--agent-url", unix_url]) == 1
    assert "'9' names no GPU of this node" in capsys.readouterr().err
    assert main(["attach", "2", "--gpu", "1", "--agent-url", unix_url]) == 2
    assert main(["attach", "--gpu", "all", "--agent-url", unix_url]) == 2
    assert "--gpu names one GPU" in capsys.readouterr().err


def test_attach_by_model_and_memory(
    served: ServedAgent, unix_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 37: the served agent's four GPUs are "Fake GPU (simulated)" with 80 GiB each.
    args = ["attach", "--model", "fake gpu", "--min-memory", "80G", "--agent-url", unix_url]
    assert main(args) == 0
    assert len(served.ledger.attachments()) == 1

    assert main(["attach", "--model", "A100", "--agent-url", unix_url]) == 1
    err = capsys.readouterr().err
    assert (
        "no GPU of this node matches model 'A100' (the node has: Fake GPU (simulated) "
        "(80 GiB) x4)" in err
    )
    assert "--wait" not in err  # waiting cannot help: no such GPU here
    assert main(["attach", "--min-memory", "40X", "--agent-url", unix_url]) == 1
    assert "min_memory must be a size such as 80G" in capsys.readouterr().err
    assert len(served.ledger.attachments()) == 1


def test_json_output(
    served: ServedAgent, unix_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["attach", "--json", "--agent-url", unix_url, "--request-id", "cli-1"]) == 0
    attached = json.loads(capsys.readouterr().out)
    assert attached["attachments"][0]["target"] == {"pid": 100}

    assert main(["status", "--json", "--agent-url", unix_url]) == 0
    status = json.loads(capsys.readouterr().out)
    assert [g["state"] for g in status["gpus"]] == ["attached", "free", "free", "free"]
    assert status["attachments"] == attached["attachments"]


def test_tcp_with_token_file_and_pid(
    served: ServedAgent, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = served.tcp.address
    assert isinstance(address, TcpAddress)
    url = f"http://{address.host}:{address.port}"
    token = tmp_path / "token"
    token.write_text(TOKEN)
    served.host.spawn(200, "kernel-b")

    assert main(["attach", "--agent-url", url, "--token-file", str(token), "--pid", "200"]) == 0
    assert "(to process 200)" in capsys.readouterr().out

    # Without --pid over TCP the agent cannot tell who "you" are: GPUs are still shown.
    assert main(["status", "--agent-url", url, "--token-file", str(token)]) == 0
    out = capsys.readouterr().out
    assert "attached -> process 200" in out
    assert "this shell: no GPUs of its own (--pid N shows those of a process)" in out


def test_holders_are_named_by_their_notebook(tmp_path: Path) -> None:
    """The demo's banner line runs ``status`` on the host: a kernel's GPU shows its notebook."""
    env = {**os.environ, "JPY_SESSION_NAME": "team/train.ipynb"}
    # The child says so once it runs: until its exec, /proc/<pid>/environ is still ours.
    ready = "import time; print('ready', flush=True); time.sleep(600)"
    with subprocess.Popen([sys.executable, "-c", ready], env=env, stdout=subprocess.PIPE) as kernel:
        try:
            assert kernel.stdout is not None and kernel.stdout.readline() == b"ready\n"
            assert holder_name(PidRef(kernel.pid)) == f"team/train.ipynb (process {kernel.pid})"
        finally:
            kernel.kill()
    assert holder_name(PidRef(os.getpid())) == f"process {os.getpid()}"


def test_a_sandboxed_kernel_is_named_by_the_notebook_below_its_sandbox_pid() -> None:
    """The agent names a sandbox by its first process; the kernel (with the notebook in its
    environment) runs below it."""
    script = "JPY_SESSION_NAME=team/train.ipynb sleep 600 & wait"
    with subprocess.Popen(["bash", "-c", script], env=dict(os.environ)) as sandbox:
        children = Path(f"/proc/{sandbox.pid}/task/{sandbox.pid}/children")
        kernels: list[str] = []
        try:
            while not kernels:  # until bash has forked
                kernels = children.read_text().split()
                os.sched_yield()
            while not Path(f"/proc/{kernels[0]}/cmdline").read_bytes().startswith(b"sleep"):
                os.sched_yield()  # ...and the child has exec'd sleep, with its environment
            expected = f"team/train.ipynb (process {sandbox.pid})"
            assert holder_name(PidRef(sandbox.pid)) == expected
        finally:
            for kernel in kernels:
                os.kill(int(kernel), signal.SIGKILL)
            sandbox.kill()


def test_detach_by_node_index_or_uuid_beginning(
    served: ServedAgent, unix_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["attach", "2", "--agent-url", unix_url]) == 0
    first, second = sorted(served.ledger.attachments(), key=lambda a: a.gpu.index)
    capsys.readouterr()

    assert main(["detach", str(first.gpu.index), "--agent-url", unix_url]) == 0
    assert capsys.readouterr().out == f"detached GPU {first.gpu.index} ({first.gpu.uuid})\n"
    assert main(["detach", second.gpu.uuid[:12], "--agent-url", unix_url]) == 0
    assert capsys.readouterr().out == f"detached GPU {second.gpu.index} ({second.gpu.uuid})\n"
    assert main(["detach", "9", "--agent-url", unix_url]) == 1
    assert "'9' names no GPU of this node (0 = GPU-" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["--keep"], "lacks the checkpoint API"),  # this agent has no CUDA driver
        (["--keep", "--force"], "force and keep exclude each other"),  # never sent
        (["0", "--keep"], "--keep detaches all GPUs"),  # never sent
    ],
    ids=["no-driver", "with-force", "one-gpu"],
)
def test_a_refused_keep_exits_1_saying_why_and_the_gpu_stays(
    served: ServedAgent,
    unix_url: str,
    capsys: pytest.CaptureFixture[str],
    words: list[str],
    said: str,
) -> None:
    assert main(["attach", "--agent-url", unix_url]) == 0
    capsys.readouterr()

    assert main(["detach", *words, "--agent-url", unix_url]) == 1

    assert said in capsys.readouterr().err
    assert len(served.ledger.attachments()) == 1


def test_none_free_says_how_to_wait(
    served: ServedAgent, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = served.tcp.address
    assert isinstance(address, TcpAddress)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    common = ["--agent-url", f"http://{address.host}:{address.port}", "--token-file", str(token)]
    served.host.spawn(200, "kernel-b")
    served.host.spawn(201, "kernel-c")
    assert main(["attach", "4", *common, "--pid", "200"]) == 0
    capsys.readouterr()

    assert main(["attach", "1", *common, "--pid", "201"]) == 1
    err = capsys.readouterr().err
    assert "0 free" in err
    assert err.endswith("to wait for one in the queue: add --wait SECONDS\n")


def test_errors_exit_1_with_the_agents_message(
    served: ServedAgent, unix_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["attach", "5", "--agent-url", unix_url]) == 1
    assert "more than this node's 4 GPU(s)" in capsys.readouterr().err

    assert main(["attach", "--json", "--agent-url", unix_url, "--pid", "100"]) == 0
    capsys.readouterr()
    served.host.spawn(300, "kernel-c")
    assert main(["attach", "--json", "--agent-url", unix_url, "--pid", "300"]) == 1
    refusal = json.loads(capsys.readouterr().err)
    assert refusal["error"] == "forbidden"


def test_unreachable_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--agent-url", f"unix:{tmp_path / 'nobody.sock'}"]) == 1
    assert capsys.readouterr().err.startswith("error: ")


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_hotplug.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "GPU_HOTPLUG_TEST_PAUSE_AT": ""},
    )


def test_agent_options_pass_through_to_the_application(tmp_path: Path) -> None:
    done = _run_cli(
        "agent",
        "--show-config-json",
        "--simulate=2",
        "--listen=127.0.0.1:0",
        f"--listen=unix:{tmp_path / 'agent.sock'}",
        f"--state-dir={tmp_path / 'state'}",
        "--log-format=json",
    )

    assert done.returncode == 0, done.stderr
    settings = json.loads(done.stdout)
    assert settings["listen"] == ["127.0.0.1:0", f"unix:{tmp_path / 'agent.sock'}"]
    assert settings["simulate"] == 2


def test_agent_refuses_a_bad_setting(tmp_path: Path) -> None:
    done = _run_cli("agent", "--listen=nowhere", "--log-format=json")

    assert done.returncode == 1
    (line,) = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert line["level"] == "CRITICAL"
    assert "listen address 'nowhere'" in line["message"]


def test_agent_help_is_the_applications(tmp_path: Path) -> None:
    done = _run_cli("agent", "--help")

    assert done.returncode == 0
    assert "--simulate" in done.stdout and "--listen" in done.stdout
