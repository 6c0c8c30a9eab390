"""The agent's settings (listen addresses, checks), its log formats and its named steps.

``AgentApp`` itself is exercised as a process (``test_cli_agent``): building one configures the
process's logging, which must not leak into other tests.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from jupyter_gpu_hotplug.agent.app import AgentApp
from jupyter_gpu_hotplug.agent.core.checkpoints import STEPS, Checkpoints
from jupyter_gpu_hotplug.agent.core.driver_files import DriverFilesMode
from jupyter_gpu_hotplug.agent.core.lost import LostPolicy
from jupyter_gpu_hotplug.agent.logs import JsonFormatter, TextFormatter
from jupyter_gpu_hotplug.agent.settings import (
    DEFAULT_HOLDER_CPU,
    NOTEBOOKS_LABEL,
    AgentSettings,
    KubernetesSettings,
    LabelSelector,
    SettingsError,
    TcpAddress,
    UnixAddress,
    parse_listen,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8477", TcpAddress("127.0.0.1", 8477)),
        (":8477", TcpAddress("", 8477)),
        ("localhost:0", TcpAddress("localhost", 0)),
        ("[::1]:8477", TcpAddress("::1", 8477)),
        ("unix:/run/gpu-hotplug/agent.sock", UnixAddress(Path("/run/gpu-hotplug/agent.sock"))),
    ],
)
def test_listen_addresses(text: str, expected: object) -> None:
    assert parse_listen(text) == expected
    assert str(expected) == text


@pytest.mark.parametrize(
    "text",
    [
        "8477",
        "host",
        "host:port",
        "host:70000",
        "unix:relative.sock",
        "unix:/" + "x" * 120,
        "::1:80",
    ],
)
def test_bad_listen_addresses(text: str) -> None:
    with pytest.raises(SettingsError, match="listen address"):
        parse_listen(text)


def settings(**changes: object) -> AgentSettings:
    values: dict[str, object] = {
        "listen": (TcpAddress("127.0.0.1", 0),),
        "state_dir": Path("/var/lib/gpu-hotplug"),
    }
    values.update(changes)
    return AgentSettings(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"listen": ()}, "at least one address"),
        ({"listen": (TcpAddress("", 1), TcpAddress("", 1))}, "twice"),
        ({"state_dir": Path("relative")}, "absolute"),
        ({"max_gpus_per_target": 0}, "max_gpus_per_target"),
        ({"device_major": 0}, "device_major"),
        ({"socket_mode": 0o1000}, "socket_mode"),
        ({"simulate": 65}, "simulate"),
        (
            {"simulate": 2, "simulate_nvlink": 3},
            r"simulate_nvlink must be from 0 to simulate \(2\)",
        ),
        ({"simulate_nvlink": -1}, "simulate_nvlink"),
        ({"reconcile_interval": -1.0}, "reconcile_interval"),
        ({"lost_grace_seconds": -1.0}, "lost_grace_seconds"),
        ({"cdi_spec_dirs": (Path("etc/cdi"),)}, "cdi_spec_dirs"),
    ],
)
def test_settings_are_checked(changes: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        settings(**changes)


def test_settings_describe_themselves_without_secrets() -> None:
    described = settings(simulate=4).describe()

    assert described["listen"] == ["127.0.0.1:0"]
    assert described["simulate"] == 4
    assert json.loads(json.dumps(described)) == described
    assert not any("token" in key and key != "test_pause_at" for key in described)
    assert settings().token_path == Path("/var/lib/gpu-hotplug/token")


@pytest.mark.parametrize(
    ("resource_name", "profile"),
    [
        ("nvidia.com/gpu", None),
        ("nvidia.com/mig-1g.10gb", "1g.10gb"),
        ("nvidia.com/mig-3g.40gb", "3g.40gb"),
    ],
)
def test_a_mig_resource_name_names_its_profile(resource_name: str, profile: str | None) -> None:
    kubernetes = KubernetesSettings(node_name="n", resource_name=resource_name)
    assert kubernetes.mig_profile == profile


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"holder_image_pull_policy": "Sometimes"}, "holder_image_pull_policy"),
        ({"holder_priority_class": "Not_A_Name"}, "not a Kubernetes object name"),
        ({"holder_image_pull_secrets": ("ok", "bad/name")}, "not a Kubernetes object name"),
        ({"holder_cpu": "lots"}, "holder_cpu"),
        ({"holder_memory": "24MB"}, "holder_memory"),
        ({"stray_policy": "kill"}, "stray_policy"),
    ],
)
def test_holder_and_sweep_settings_are_checked(changes: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        KubernetesSettings(node_name="n", **changes)  # type: ignore[arg-type]


def test_holder_settings_reach_the_agent_from_its_flags() -> None:
    app = AgentApp()
    app.initialize(
        [
            "--backend=kubernetes",
            "--node-name=n",
            "--holder-priority-class=",
            "--holder-image-pull-policy=Always",
            "--holder-image-pull-secret=mirror",
            "--holder-image-pull-secret=backup",
            "--holder-memory=32Mi",
            "--stray-policy=revoke",
            "--lost-grace=5",
            "--lost-policy=force",
        ]
    )
    resolved = app.resolved_settings()
    kubernetes = resolved.kubernetes
    assert kubernetes is not None
    assert kubernetes.holder_priority_class == ""
    assert kubernetes.holder_image_pull_policy == "Always"
    assert kubernetes.holder_image_pull_secrets == ("mirror", "backup")
    assert (kubernetes.holder_cpu, kubernetes.holder_memory) == (DEFAULT_HOLDER_CPU, "32Mi")
    assert kubernetes.stray_policy == "revoke"
    assert (resolved.lost_grace_seconds, resolved.lost_policy) == (5.0, LostPolicy.FORCE)


def test_driver_files_come_from_the_cdi_spec_unless_simulated_or_told_otherwise() -> None:
    """Issue 33: a real node's agent checks and gives the driver's libraries by default; a
    simulation's kernels load the simulation's own library."""
    assert settings().driver_files_mode is DriverFilesMode.CDI
    assert settings(simulate=2).driver_files_mode is DriverFilesMode.OFF
    app = AgentApp()
    app.initialize(
        ["--driver-files=check", "--cdi-spec-dir=/host/cdi/0", "--cdi-spec-dir=/host/cdi/1"]
    )
    resolved = app.resolved_settings()
    assert resolved.driver_files_mode is DriverFilesMode.CHECK
    assert resolved.cdi_spec_dirs == (Path("/host/cdi/0"), Path("/host/cdi/1"))
    assert resolved.describe()["driver_files"] == "check"


def test_tenancy_fails_closed_unless_configured_otherwise() -> None:
    """Issue 31: a pod without the annotation gets one GPU, and only namespaces an operator
    labelled as notebook namespaces get any."""
    app = AgentApp()
    app.initialize(["--backend=kubernetes", "--node-name=n"])
    kubernetes = app.resolved_settings().kubernetes
    assert kubernetes is not None
    assert (kubernetes.default_max_gpus, kubernetes.allowed_namespaces) == (1, ())
    assert str(kubernetes.allowed_namespace_selector) == "gpu-hotplug.jupyter.org/notebooks=true"
    assert kubernetes.allowed_namespace_selector.matches({NOTEBOOKS_LABEL: "true"})
    assert not kubernetes.allowed_namespace_selector.matches({NOTEBOOKS_LABEL: "false"})


def test_tenancy_settings_reach_the_agent_from_its_flags() -> None:
    app = AgentApp()
    app.initialize(
        [
            "--backend=kubernetes",
            "--node-name=n",
            "--default-max-gpus=0",
            "--allowed-namespaces=jhub",
            "--allowed-namespaces=batch",
            "--allowed-namespace-selector=team=ml,!legacy",
        ]
    )
    kubernetes = app.resolved_settings().kubernetes
    assert kubernetes is not None
    assert (kubernetes.default_max_gpus, kubernetes.allowed_namespaces) == (0, ("jhub", "batch"))
    selector = kubernetes.allowed_namespace_selector
    assert selector.matches({"team": "ml"})
    assert not selector.matches({"team": "ml", "legacy": ""})
    assert not selector.matches({})


@pytest.mark.parametrize(
    ("text", "labels", "matches"),
    [
        ("a=b", {"a": "b"}, True),
        ("a==b", {"a": "b"}, True),
        ("a=b", {"a": "c"}, False),
        ("a!=b", {}, True),
        ("a!=b", {"a": "b"}, False),
        ("a", {"a": ""}, True),
        ("a", {}, False),
        ("!a", {}, True),
        ("!a", {"a": "x"}, False),
        ("example.com/k=v,z", {"example.com/k": "v", "z": "1"}, True),
        ("example.com/k=v,z", {"example.com/k": "v"}, False),
        ("", {}, False),
        ("", {"anything": "x"}, False),
    ],
)
def test_label_selectors(text: str, labels: dict[str, str], matches: bool) -> None:
    selector = LabelSelector.parse(text)
    assert selector.matches(labels) is matches
    assert LabelSelector.parse(str(selector)) == selector


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"default_max_gpus": -1}, "default_max_gpus must be from 0 to 255, got -1"),
        ({"default_max_gpus": 256}, "default_max_gpus"),
        ({"allowed_namespaces": ("Jhub",)}, "'Jhub' is not a namespace name"),
        ({"allowed_namespaces": ("",)}, "allowed_namespaces"),
    ],
)
def test_tenancy_settings_are_checked(changes: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        KubernetesSettings(node_name="n", **changes)  # type: ignore[arg-type]


def test_an_agent_with_namespaced_rbac_watches_its_allowed_namespaces_only() -> None:
    """Issue 31, finding 7: with RoleBindings in the allowed namespaces only, the agent lists
    and watches those (a list across namespaces would be forbidden); by default, every one."""
    app = AgentApp()
    app.initialize(
        [
            "--backend=kubernetes",
            "--node-name=n",
            "--rbac-scope=namespaces",
            "--allowed-namespaces=jhub",
            "--allowed-namespaces=batch",
            "--allowed-namespace-selector=",
        ]
    )
    kubernetes = app.resolved_settings().kubernetes
    assert kubernetes is not None
    assert (kubernetes.rbac_scope, kubernetes.watched_namespaces) == (
        "namespaces",
        ("jhub", "batch"),
    )
    assert KubernetesSettings(node_name="n").watched_namespaces is None


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"allowed_namespaces": ("*",), "allowed_namespace_selector": LabelSelector()},
        {"allowed_namespaces": ("jhub",)},
    ],
)
def test_namespaced_rbac_needs_the_namespaces_by_name(changes: dict[str, object]) -> None:
    """A namespace admitted by label (or by ``*``) could hold a notebook whose pod the agent
    may not read: refused at start, saying what to give."""
    with pytest.raises(SettingsError, match="rbac_scope 'namespaces' reads pods only"):
        KubernetesSettings(node_name="n", rbac_scope="namespaces", **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text", ["a in (b)", "!a=b", "a=b=c", "a=b,", "a=b, c", "-a=b", "a=-b", "a b", "x/y/z=1"]
)
def test_a_selector_the_agent_cannot_read_is_refused_naming_the_term(text: str) -> None:
    with pytest.raises(SettingsError, match="allowed_namespace_selector"):
        LabelSelector.parse(text)


def _record(**extra: object) -> logging.LogRecord:
    record = logging.LogRecord(
        "jupyter_gpu_hotplug.agent", logging.INFO, __file__, 1, "hi %s", ("x",), None
    )
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_json_log_lines_carry_the_extras() -> None:
    line = json.loads(JsonFormatter().format(_record(request_id="abc", pid=7)))

    assert line["message"] == "hi x"
    assert (line["level"], line["logger"]) == ("INFO", "jupyter_gpu_hotplug.agent")
    assert (line["request_id"], line["pid"]) == ("abc", 7)
    assert line["time"].endswith("+00:00")


def test_json_log_lines_carry_the_traceback() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), None)
        record.exc_info = sys.exc_info()
    line = json.loads(JsonFormatter().format(record))

    assert "RuntimeError: boom" in line["exception"]


def test_text_log_lines_end_with_the_extras() -> None:
    text = TextFormatter().format(_record(request_id="abc"))

    assert text.endswith("jupyter_gpu_hotplug.agent: hi x [request_id=abc]")


def test_checkpoints_know_their_steps(tmp_path: Path) -> None:
    assert set(STEPS) == {
        "after_reserve",
        "after_grant",
        "after_mark_granted",
        "after_begin_release",
        "after_revoke",
    }
    with pytest.raises(ValueError, match="unknown step"):
        Checkpoints(pause_at="after_lunch", marker_dir=tmp_path)
    with pytest.raises(ValueError, match="marker"):
        Checkpoints(pause_at="after_grant")


async def test_checkpoints_pass_by_default(tmp_path: Path) -> None:
    checkpoints = Checkpoints(pause_at="after_grant", marker_dir=tmp_path)

    await checkpoints.reach("after_reserve")
    await Checkpoints().reach("after_grant")

    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="unknown step"):
        await checkpoints.reach("after_lunch")
