"""The agent's settings (listen addresses, checks), its log formats and its named steps.

``AgentApp`` itself is exercised as a process (``test_cli_agent``): building one configures the
process's logging, which must not leak into other tests.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import NODE_NAME_ENV
from jupyter_gpu_hotplug.agent.app import PAUSE_ENV, AgentApp
from jupyter_gpu_hotplug.agent.core.checkpoints import STEPS, Checkpoints
from jupyter_gpu_hotplug.agent.core.driver_files import DriverFilesMode
from jupyter_gpu_hotplug.agent.core.lost import LostPolicy
from jupyter_gpu_hotplug.agent.logs import JsonFormatter, TextFormatter
from jupyter_gpu_hotplug.agent.settings import (
    DEFAULT_HOLDER_CPU,
    NOTEBOOKS_LABEL,
    AgentSettings,
    Backend,
    KubernetesSettings,
    LabelSelector,
    Option,
    SettingsError,
    TcpAddress,
    UnixAddress,
    options,
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
    ],
)
def test_holder_settings_are_checked(changes: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        KubernetesSettings(node_name="n", **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"stray_policy": "kill"}, "stray_policy"),
        ({"sweep_cgroup": "gpu-hotplug-sandboxes"}, "sweep_cgroup"),
    ],
)
def test_sweep_settings_are_checked(changes: dict[str, object], message: str) -> None:
    """The node sweep's settings are every mode's (issue 38: local mode sweeps too)."""
    with pytest.raises(SettingsError, match=message):
        settings(**changes)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--keep-memory-fraction=1.5"], "keep_memory_fraction must be from 0 to 1"),
        (["--keep-memory-fraction=-0.1"], "keep_memory_fraction must be from 0 to 1"),
        (["--keep-memory-per-target=lots"], "keep_memory_per_target 'lots' is not a size"),
        (["--keep-memory-per-target=0"], "keep_memory_per_target '0' is not a size"),
    ],
)
def test_the_budget_for_kept_state_is_checked(argv: list[str], message: str) -> None:
    """Issue 39: how much host memory suspended kernels may keep."""
    with pytest.raises(SettingsError, match=message):
        _resolved(argv)


def test_what_idle_release_does_with_a_held_gpu_is_one_of_its_choices() -> None:
    with pytest.raises(SettingsError, match="idle_held 'maybe' is not one of suspend, leave"):
        settings(idle_held="maybe")


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
    assert resolved.stray_policy == "revoke"
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
        "after_intent",
        "after_grant",
        "after_mark_granted",
        "after_begin_release",
        "after_revoke",
        "after_suspend_intent",
        "after_checkpoint",
        "after_suspend_revoke",
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


# Issue 38 item 5: each setting is declared once (a field with its ``setting(...)``), and
# AgentApp's traits and flags are made from those declarations. What one gives on the command
# line must reach the field, and what one does not give must be the field's default.

ROOT = Path(__file__).parents[2]
KUBERNETES_FIELDS = {name for name, _, _ in options(KubernetesSettings)}

# For every setting: what its flag is given (repeated for a repeatable one), what the field then
# holds, and the other flags its value needs. None of these is the default.
GIVEN: dict[str, tuple[list[str], object, list[str]]] = {
    "listen": (
        ["127.0.0.1:1", "unix:/run/x.sock"],
        (TcpAddress("127.0.0.1", 1), UnixAddress(Path("/run/x.sock"))),
        [],
    ),
    "metrics_listen": ([":9"], (TcpAddress("", 9),), []),
    "backend": (["kubernetes"], Backend.KUBERNETES, ["--node-name=n"]),
    "state_dir": (["/srv/state"], Path("/srv/state"), []),
    "host_proc": (["/host/proc"], Path("/host/proc"), []),
    "cgroup_root": (["/host"], Path("/host"), []),
    "max_gpus_per_target": (["2"], 2, []),
    "device_major": (["196"], 196, []),
    "socket_mode": (["0600"], 0o600, []),
    "socket_group": (["root"], 0, []),
    "simulate": (["2"], 2, []),
    "simulate_mig": (["1g.10gb, 2g.20gb"], ("1g.10gb", "2g.20gb"), []),
    "simulate_nvlink": (["1"], 1, ["--simulate=2"]),
    "simulation_dir": (["/srv/sim"], Path("/srv/sim"), []),
    "simulation_interval": (["0"], 0.0, []),
    "reconcile_interval": (["0.5"], 0.5, []),
    "force_grace": (["1"], 1.0, []),
    "idle_release_seconds": (["600"], 600.0, []),
    "idle_warning_seconds": (["30"], 30.0, []),
    "idle_handover_seconds": (["30"], 30.0, []),
    "max_lease_seconds": (["3600"], 3600.0, []),
    "idle_check_interval": (["1"], 1.0, []),
    "lost_grace_seconds": (["5"], 5.0, []),
    "lost_policy": (["force"], LostPolicy.FORCE, []),
    "driver_files": (["check"], DriverFilesMode.CHECK, []),
    "cdi_spec_dirs": (
        ["/host/cdi/0", "/host/cdi/1"],
        (Path("/host/cdi/0"), Path("/host/cdi/1")),
        [],
    ),
    "cdi_kind": (["example.com/gpu"], "example.com/gpu", []),
    "host_root": (["/host/root"], Path("/host/root"), []),
    "node_name": (["node-b"], "node-b", []),
    "kubeconfig": (["/etc/kube/config"], Path("/etc/kube/config"), []),
    "pod_resources_socket": (["/run/pr/kubelet.sock"], Path("/run/pr/kubelet.sock"), []),
    "cri_endpoint": (["unix:///var/run/crio/crio.sock"], "unix:///var/run/crio/crio.sock", []),
    "holder_image": (["registry.example.org/pause:3.10"], "registry.example.org/pause:3.10", []),
    "resource_name": (["nvidia.com/mig-1g.10gb"], "nvidia.com/mig-1g.10gb", []),
    "holder_priority_class": ([""], "", []),
    "holder_image_pull_policy": (["Always"], "Always", []),
    "holder_image_pull_secrets": (["mirror", "backup"], ("mirror", "backup"), []),
    "holder_cpu": (["200m"], "200m", []),
    "holder_memory": (["32Mi"], "32Mi", []),
    "stray_policy": (["revoke"], "revoke", []),
    "keep_memory_fraction": (["0.25"], 0.25, []),
    "idle_held": (["leave"], "leave", []),
    "keep_memory_per_target": (["32Gi"], 32 * 2**30, []),
    "sweep_cgroup": (["/gpu-hotplug-sandboxes"], "/gpu-hotplug-sandboxes", []),
    "default_max_gpus": (["0"], 0, []),
    "allowed_namespaces": (["jhub", "batch"], ("jhub", "batch"), []),
    "allowed_namespace_selector": (["team=ml,!legacy"], LabelSelector.parse("team=ml,!legacy"), []),
    "rbac_scope": (
        ["namespaces"],
        "namespaces",
        ["--allowed-namespaces=jhub", "--allowed-namespace-selector="],
    ),
}


def _declared() -> dict[str, tuple[Option, object]]:
    return {
        name: (option, value)
        for settings in (AgentSettings, KubernetesSettings)
        for name, option, value in options(settings)
    }


def _resolved(argv: list[str]) -> AgentSettings:
    app = AgentApp()
    try:
        app.initialize(argv)
        return app.resolved_settings()
    finally:
        app.close_handlers()


@pytest.fixture
def node_name(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(NODE_NAME_ENV, "node-a")
    monkeypatch.delenv(PAUSE_ENV, raising=False)
    return "node-a"


def test_every_setting_is_given_here() -> None:
    assert set(GIVEN) == set(_declared())


def test_without_flags_every_setting_is_its_fields_default(node_name: str) -> None:
    plain = _resolved([])
    kubernetes = _resolved(["--backend=kubernetes"]).kubernetes
    assert plain.kubernetes is None and kubernetes is not None
    for name, (option, default) in _declared().items():
        if name in KUBERNETES_FIELDS:
            expected = node_name if option.env == NODE_NAME_ENV else default
            assert getattr(kubernetes, name) == expected, name
        else:
            assert getattr(plain, name) == default, name
        # what describe() logs, AgentApp's own traits and the log line, the same
        assert option.parse(option.text(default)) == default, name


@pytest.mark.parametrize("name", sorted(GIVEN))
def test_every_flag_reaches_its_field(name: str, node_name: str) -> None:
    option, default = _declared()[name]
    values, expected, needs = GIVEN[name]
    assert expected != default
    flag = f"--{option.flag}" if option.flag is not None else f"--AgentApp.{name}"
    argv = [*(f"{flag}={value}" for value in values), *needs]
    if name in KUBERNETES_FIELDS:
        kubernetes = _resolved(["--backend=kubernetes", *argv]).kubernetes
        assert kubernetes is not None
        assert getattr(kubernetes, name) == expected
    else:
        assert getattr(_resolved(argv), name) == expected


def test_a_kubernetes_agent_without_a_node_name_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(NODE_NAME_ENV, raising=False)
    with pytest.raises(SettingsError, match="node_name: give --node-name or set"):
        _resolved(["--backend=kubernetes"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--socket-mode=rw"], "socket_mode 'rw' is not an octal mode"),
        (["--socket-group=no-such-group-here"], "socket_group 'no-such-group-here': no such"),
        (["--listen=nowhere"], "listen address 'nowhere'"),
    ],
)
def test_a_flags_text_that_cannot_be_read_names_the_setting(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        _resolved(argv)


def _agent_flags() -> set[str]:
    """Every flag ``jupyter gpu-hotplug agent`` takes, without its dashes."""
    traits = {f"AgentApp.{name}" for name in AgentApp.class_traits(config=True)}
    return {*AgentApp.aliases, *AgentApp.flags, "help", "help-all", "version", *traits}


# Other programs' flags the operator guide shows (helm, pip, docker, NVIDIA's device plugin).
OTHER_PROGRAMS_FLAGS = {
    "image",
    "mig-strategy",
    "no-deps",
    "require-hashes",
    "sbom",
    "set",
    "set-json",
    "set-string",
    "cap-add",
    "device",
    "privileged",
    "runtime",
}
_FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w.-]*[\w])")
_FLAG_TERM = re.compile(r"`--([A-Za-z][\w.-]*[\w])")
"""A flag named as a term of the text (`` `--idle-release S` ``), not inside a command line."""


def _documented_agent_flags() -> dict[str, set[str]]:
    """The flags the docs and manifests give the agent, by where: those the usage guide's
    sections on the agent name, those the operator guide names but another program's, command
    lines of ``gpu-hotplug agent`` (with their continuations), ``c.AgentApp.…`` anywhere, and
    the agent's ``args`` in the manifests and the chart."""
    found: dict[str, set[str]] = {}
    usage = (ROOT / "docs/usage.md").read_text()
    for section in re.split(r"\n(?=## )", usage):
        if section.startswith(("## The node agent", "## Kubernetes mode")):
            found["usage.md"] = found.get("usage.md", set()) | set(_FLAG_TERM.findall(section))
    guide = (ROOT / "docs/operator-guide.md").read_text()
    found["operator-guide.md"] = set(_FLAG_TERM.findall(guide)) - OTHER_PROGRAMS_FLAGS
    for doc in (ROOT / "docs").glob("*.md"):
        text = doc.read_text()
        found[f"{doc.name} (c.AgentApp)"] = {
            f"AgentApp.{name}" for name in re.findall(r"\bAgentApp\.(\w+)", text)
        }
        command = re.findall(r"hotplug agent(?:[^\n`]*\\\n)*[^\n`]*", text)
        found[f"{doc.name} (commands)"] = {f for line in command for f in _FLAG.findall(line)}
    for manifest in (
        "k8s/base/daemonset.yaml",
        "k8s/chart/jupyter-gpu-hotplug/templates/daemonset.yaml",
    ):
        args = re.findall(r"^\s*- --([\w-]+)", (ROOT / manifest).read_text(), re.MULTILINE)
        found[manifest] = set(args)
    return found


def test_docs_and_manifests_give_the_agent_only_flags_it_has() -> None:
    documented = _documented_agent_flags()
    flags = _agent_flags()
    assert {where: sorted(given - flags) for where, given in documented.items()} == {
        where: [] for where in documented
    }
    # the catalogue is read at all: the usage guide's table and the chart's args
    assert {"idle-release", "holder-image-pull-secret", "cdi-spec-dir"} <= documented["usage.md"]
    assert (
        "allowed-namespace-selector"
        in documented["k8s/chart/jupyter-gpu-hotplug/templates/daemonset.yaml"]
    )
    assert "AgentApp.idle_check_interval" in documented["usage.md (c.AgentApp)"]


def test_a_config_file_reaches_the_fields_and_the_command_line_wins(
    tmp_path: Path, node_name: str
) -> None:
    config = tmp_path / "agent_config.py"
    config.write_text(
        "c.AgentApp.idle_release_seconds = 5.0\n"
        "c.AgentApp.simulate_mig = '1g.10gb'\n"
        "c.AgentApp.allowed_namespaces = ['jhub']\n"
    )
    resolved = _resolved(["--backend=kubernetes", f"--config={config}", "--idle-release=7"])
    assert (resolved.idle_release_seconds, resolved.simulate_mig) == (7.0, ("1g.10gb",))
    assert resolved.kubernetes is not None
    assert resolved.kubernetes.allowed_namespaces == ("jhub",)
