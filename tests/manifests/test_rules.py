"""The PrometheusRule proven with the real ``promtool test rules`` (Prometheus 3.16, built from its
Go module by ``tests/realnode/build.sh promtool``): every alert fires where it should and stays
silent where it should (an agent down, whichever monitor scraped it; no agent scraped at all; a
DaemonSet that cannot place its pod or left one where it should not be; the agent's own alerts),
and the recording rules give a hot-plugged GPU's dcgm-exporter usage to its notebook.

The promtool tests are ``rules_test.yaml`` beside this file. Their input series must be what
Prometheus would hold: the agent's series are checked against the agent's own registry (names
and label names) plus the target labels the Prometheus Operator adds, so a renamed metric or
label fails here and not in someone's silent alert.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any, Final

import promql_parser
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from jupyter_gpu_hotplug.agent.core.metrics import AgentMetrics

from .support import K8S_DIR, by_kind, render, tool_or_skip

TESTS: Final = Path(__file__).with_name("rules_test.yaml")
TARGET_LABELS: Final = frozenset(
    {"job", "instance", "namespace", "pod", "container", "endpoint", "service"}
    | {"app_kubernetes_io_name"}
)
"""What the Prometheus Operator writes on every agent series (podTargetLabels included)."""
AGENT_SELECTOR: Final = 'app_kubernetes_io_name="gpu-hotplug-agent"'
SUFFIXES: Final = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count")}


# promtool from tests/realnode/build.sh: the real-node lane of .ci/test, which builds it first.
# promtool is the node build's last component: the lane runs this module at its end.
pytestmark = [pytest.mark.realnode, pytest.mark.built_last]


@pytest.fixture(scope="module")
def promtool() -> str:
    return tool_or_skip("promtool")


@pytest.fixture(scope="module")
def groups() -> list[dict[str, Any]]:
    rule = by_kind(render(K8S_DIR / "monitoring"), "PrometheusRule")
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


@pytest.fixture(scope="module")
def tests() -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = yaml.safe_load(TESTS.read_text())["tests"]
    return tests


def _promtool_rules(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The rules as promtool loads them, each alert's annotations but its summary dropped:
    promtool compares annotations whole, and the descriptions are fixed prose (checked here),
    so the tests state only the templated summaries."""
    out = []
    for group in groups:
        rules = []
        for rule in group["rules"]:
            if "annotations" in rule:
                assert "{{" not in rule["annotations"]["description"], rule["alert"]
                rule = {**rule, "annotations": {"summary": rule["annotations"]["summary"]}}
            rules.append(rule)
        out.append({**group, "rules": rules})
    return {"groups": out}


def _run(argv: list[str], cwd: Path) -> str:
    """Run promtool in ``cwd`` (rule files are named relative to the test file); its output,
    after asserting that it succeeded."""
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_promtool_proves_every_rule(
    promtool: str, groups: list[dict[str, Any]], tmp_path: Path
) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_promtool_rules(groups)))
    shutil.copy(TESTS, tmp_path / TESTS.name)
    _run([promtool, "check", "rules", "rules.yaml"], tmp_path)
    assert "SUCCESS" in _run([promtool, "test", "rules", TESTS.name], tmp_path)


def test_every_alert_fires_and_stays_silent_and_every_record_is_tested(
    groups: list[dict[str, Any]], tests: list[dict[str, Any]]
) -> None:
    rules = [rule for group in groups for rule in group["rules"]]
    alert_cases = [case for test in tests for case in test.get("alert_rule_test", [])]
    for alert in (r["alert"] for r in rules if "alert" in r):
        outcomes = {bool(c["exp_alerts"]) for c in alert_cases if c["alertname"] == alert}
        assert outcomes == {True, False}, f"{alert}: a case where it fires and one where not"
    tested = {case["expr"] for test in tests for case in test.get("promql_expr_test", [])}
    assert {r["record"] for r in rules if "record" in r} <= tested


def _agent_label_names() -> dict[str, frozenset[str]]:
    """Every series name the agent exports, with its label names. Read from each metric's
    declared label names (``_labelnames``: prometheus_client has no public accessor, and a
    labelled metric exposes no sample until a label value is used)."""
    names: dict[str, frozenset[str]] = {}
    for metric in vars(AgentMetrics()).values():
        if isinstance(metric, MetricWrapperBase):
            labels = frozenset(metric._labelnames)
            for suffix in SUFFIXES[str(metric._type)]:
                names[metric._name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


def _selector(series: str) -> tuple[str, dict[str, str]]:
    node = promql_parser.parse(series)
    assert isinstance(node, promql_parser.VectorSelector), series
    assert node.name is not None, series
    labels = {m.name: m.value for m in node.matchers.matchers if m.name != "__name__"}
    return node.name, labels


def test_the_input_series_are_what_the_agent_and_the_operator_export(
    tests: list[dict[str, Any]],
) -> None:
    exported = _agent_label_names()
    assert "gpu_hotplug_stray_gpu_access" in exported
    seen: set[str] = set()
    for test in tests:
        for item in test["input_series"]:
            name, labels = _selector(item["series"])
            if name.startswith("gpu_hotplug_"):
                assert name in exported, name
                assert labels.keys() <= exported[name] | TARGET_LABELS, item["series"]
                seen.add(name)
            agent = labels.get("app_kubernetes_io_name") == "gpu-hotplug-agent"
            if agent or name.startswith("gpu_hotplug_"):
                # An agent target: scraped by a monitor of ours (podTargetLabels).
                assert agent and labels.keys() >= {"job", "instance", "pod"}, item["series"]
    assert seen, "the tests feed the agent's own series"


def test_no_rule_names_a_job(groups: list[dict[str, Any]]) -> None:
    """A PodMonitor's job is <namespace>/<name>, a ServiceMonitor's the Service's name: a rule
    that names either misses the other. The agent's `up` is selected by the pod label."""
    for rule in (rule for group in groups for rule in group["rules"]):
        assert "job=" not in rule["expr"].replace(" ", ""), rule
        if "up{" in rule["expr"]:
            assert AGENT_SELECTOR in rule["expr"], rule
