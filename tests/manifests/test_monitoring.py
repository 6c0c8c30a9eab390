"""``k8s/monitoring/``: the PodMonitor scrapes what the DaemonSet serves, every rule and every
dashboard query parses as PromQL (``promql-parser``, the Rust parser's bindings) and names only
metrics the agent exports (read from ``AgentMetrics``' own registry), Prometheus's ``up``, or the
kube-state-metrics and dcgm-exporter series the rules say they assume, and the alerts the
operator guide promises exist. ``test_rules.py`` proves what the rules do with ``promtool``.
"""

from __future__ import annotations

import json
from typing import Any, Final

import promql_parser
import pytest
import yaml

from jupyter_gpu_hotplug.agent.core.metrics import AgentMetrics

from .support import K8S_DIR, by_kind, render, validate

MONITORING: Final = K8S_DIR / "monitoring"
DASHBOARD: Final = MONITORING / "gpu-hotplug-dashboard.json"
PROMETHEUS_METRICS: Final = frozenset({"up"})
"""Series Prometheus itself writes for every target."""
KUBE_STATE_METRICS: Final = frozenset(
    {
        "kube_daemonset_status_desired_number_scheduled",
        "kube_daemonset_status_number_available",
        "kube_daemonset_status_number_misscheduled",
        "kube_pod_owner",
    }
)
"""kube-state-metrics (v2, default collectors) series the rules assume: the DaemonSet's coverage
and a holder pod's owner (its notebook)."""
DCGM_EXPORTER: Final = frozenset({"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"})
"""dcgm-exporter's default-counter series the recording rules give to notebooks."""
SUFFIXES: Final = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
}
SEVERITIES: Final = frozenset({"critical", "warning", "info"})
# Grafana's variables, replaced by what Grafana would send (a range and a label regex).
GRAFANA_VARIABLES: Final = {"$__rate_interval": "5m"}


def exported_series() -> set[str]:
    """Every series name the agent's registry can expose."""
    names: set[str] = set()
    for family in AgentMetrics().registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def metrics_of(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node: Any) -> None:
        # A selector without a name ({__name__=~"..."}) names no metric we could check.
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name is not None, f"{expr}: name the metric"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render(MONITORING)


def _rules(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The alerting rules (recording rules are checked in their own test)."""
    rule = by_kind(objects, "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]


def _records(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rule = by_kind(objects, "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"] if "record" in r]


def test_alerts_parse_and_name_exported_metrics(objects: list[dict[str, Any]]) -> None:
    rule = by_kind(objects, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    groups = rule["spec"]["groups"]
    assert len({g["name"] for g in groups}) == len(groups)
    known = exported_series() | PROMETHEUS_METRICS | KUBE_STATE_METRICS
    alerts = _rules(objects)
    assert len({a["alert"] for a in alerts}) == len(alerts)
    for alert in alerts:
        assert set(alert) <= {"alert", "expr", "for", "labels", "annotations"}, alert["alert"]
        assert metrics_of(alert["expr"]) <= known, alert["alert"]
        if "for" in alert:
            promql_parser.parse_duration(alert["for"])
        assert alert["labels"]["severity"] in SEVERITIES
        assert {"summary", "description"} <= alert["annotations"].keys()


def test_recording_rules_follow_the_naming_convention(objects: list[dict[str, Any]]) -> None:
    """``level:metric:operations`` (Prometheus's convention), over the series they assume."""
    records = _records(objects)
    assert records
    for record in records:
        assert set(record) == {"record", "expr"}, record["record"]
        level, metric, operation = record["record"].split(":")
        assert level and operation and metric in metrics_of(record["expr"])
        assert metrics_of(record["expr"]) <= DCGM_EXPORTER | KUBE_STATE_METRICS


def test_the_promised_alerts_exist(objects: list[dict[str, Any]]) -> None:
    """Agent down or absent, DaemonSet coverage, stray access, orphan revokes, queue wait, idle
    releases, attach errors, untrusted holders."""
    watched = {alert["alert"]: metrics_of(alert["expr"]) for alert in _rules(objects)}
    assert watched == {
        "GpuHotplugAgentDown": {"up"},
        "GpuHotplugAgentAbsent": {"up", "kube_daemonset_status_desired_number_scheduled"},
        "GpuHotplugAgentMissingOnNodes": {
            "kube_daemonset_status_desired_number_scheduled",
            "kube_daemonset_status_number_available",
        },
        "GpuHotplugAgentMisscheduled": {"kube_daemonset_status_number_misscheduled"},
        "GpuHotplugStrayGpuAccess": {"gpu_hotplug_stray_gpu_access"},
        "GpuHotplugOrphanRevokes": {"gpu_hotplug_lost_revokes_total"},
        "GpuHotplugLostHolders": {"gpu_hotplug_lost_revokes_total"},
        "GpuHotplugQueueWaiting": {"gpu_hotplug_queue_length"},
        "GpuHotplugIdleReleases": {"gpu_hotplug_idle_releases_total"},
        "GpuHotplugAttachErrors": {"gpu_hotplug_attach_total"},
        "GpuHotplugUntrustedHolders": {"gpu_hotplug_untrusted_holders_total"},
    }


def test_pod_monitor_scrapes_the_agents_metrics_port(objects: list[dict[str, Any]]) -> None:
    agent = render()
    daemonset = by_kind(agent, "DaemonSet", "gpu-hotplug-agent")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    monitor = by_kind(objects, "PodMonitor")
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (port,) = [p for p in container["ports"] if p["name"] == endpoint["port"]]
    assert f"--metrics-listen=:{port['containerPort']}" in container["args"]
    # The agent's NetworkPolicy admits the monitoring namespace on that port.
    policy = by_kind(agent, "NetworkPolicy")
    assert any(
        rule["ports"] == [{"protocol": "TCP", "port": port["containerPort"]}]
        for rule in policy["spec"]["ingress"]
    )
    # The monitor copies the pod's name label onto every series (podTargetLabels), as
    # app_kubernetes_io_name: what GpuHotplugAgentDown selects, whatever the job is called.
    assert monitor["spec"]["podTargetLabels"] == ["app.kubernetes.io/name"]
    selected = 'app_kubernetes_io_name="' + labels["app.kubernetes.io/name"] + '"'
    (down,) = [a for a in _rules(objects) if a["alert"] == "GpuHotplugAgentDown"]
    assert f"up{{{selected}}}" in down["expr"]


def test_pod_monitor_sends_a_token_rbac_allows_to_read_metrics(
    objects: list[dict[str, Any]],
) -> None:
    """Issue 31: the agent answers /metrics only to a token reviewed by TokenReview whose
    user RBAC allows ``get`` on that non-resource URL: the PodMonitor sends the metrics
    reader's (a ServiceAccount token the API server keeps in a Secret), bound to exactly
    that rule."""
    (endpoint,) = by_kind(objects, "PodMonitor")["spec"]["podMetricsEndpoints"]
    credentials = endpoint["authorization"]["credentials"]
    assert endpoint["authorization"]["type"] == "Bearer"
    secret = by_kind(objects, "Secret", credentials["name"])
    assert (secret["type"], credentials["key"]) == ("kubernetes.io/service-account-token", "token")
    account = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    assert by_kind(objects, "ServiceAccount", account)["metadata"]["namespace"] == "gpu-hotplug"
    binding = by_kind(objects, "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "gpu-hotplug"}
    ]
    role = by_kind(objects, "ClusterRole", binding["roleRef"]["name"])
    assert role["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]


def test_dashboard_queries_parse_and_name_exported_metrics(
    objects: list[dict[str, Any]],
) -> None:
    config_map = by_kind(objects, "ConfigMap")
    validate(config_map)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"][DASHBOARD.name])
    assert dashboard == json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    known = exported_series() | PROMETHEUS_METRICS
    used: set[str] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            names = metrics_of(expr)
            assert names <= known, (panel["title"], names - known)
            used |= names
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    # Every metric the agent exports has a panel.
    shown = {
        name.removesuffix(suffix)
        for name in used
        for suffix in ("_bucket", "_total", "")
        if name.endswith(suffix)
    }
    for family in AgentMetrics().registry.collect():
        assert family.name in shown, family.name


def test_rule_file_is_plain_yaml() -> None:
    """The file itself (not only kustomize's output) is one document a user may apply."""
    (document,) = yaml.safe_load_all((MONITORING / "prometheusrule.yaml").read_text())
    assert document["kind"] == "PrometheusRule"
