"""The agent as it is deployed (``deployment.py``: the image built from this repository,
``kubectl apply -k`` of an overlay over ``k8s/`` — the DaemonSet, its RBAC, probes and host
mounts on the real node) and a notebook pod that attaches a GPU through the node-local Service
with its projected token, as the server extension does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from ..fixtures.requirements import needs_root
from ..k8s.image import TOOLS_IMAGE
from . import deployment
from .cluster import Cluster, eventually

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]

TOKEN_PATH: Final = "/var/run/secrets/gpu-hotplug/token"
REQUEST_TIMEOUT: Final = 120
"""Seconds an attach or detach from inside the notebook may take (its holder's start)."""


@pytest.fixture
def deployed_agent(cluster: Cluster) -> Iterator[str]:
    """The agent's DaemonSet (``deployment.deployed_agent``); yields its Service's ClusterIP."""
    with deployment.deployed_agent(cluster) as service_ip:
        yield service_ip


def _notebook_with_token(name: str) -> dict[str, Any]:
    """A notebook pod as the spawner makes it: a projected token for the agent's audience."""
    return {
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "notebook",
                    "image": TOOLS_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "infinity"],
                    "volumeMounts": [
                        {"name": "gpu-hotplug-token", "mountPath": str(Path(TOKEN_PATH).parent)}
                    ],
                }
            ],
            "volumes": [
                {
                    "name": "gpu-hotplug-token",
                    "projected": {
                        "sources": [
                            {
                                "serviceAccountToken": {
                                    "audience": "gpu-hotplug",
                                    "expirationSeconds": 3600,
                                    "path": Path(TOKEN_PATH).name,
                                }
                            }
                        ]
                    },
                }
            ],
        },
    }


def test_the_deployed_agent_attaches_through_the_node_local_service(
    cluster: Cluster, deployed_agent: str
) -> None:
    attach_and_detach_through_the_service(cluster, cluster.namespace("deployed"), deployed_agent)


def _agent_call(
    cluster: Cluster, ns: str, service_ip: str, method: str, body: str | None = None
) -> tuple[int, str]:
    """``method /v1/attachments`` from inside the notebook pod ``nb`` with its projected token;
    returns the status and the body, so that a refusal shows the agent's own words (status 0:
    no answer, while the Service has no endpoint yet).

    Written out for busybox's ``nc`` (its ``wget`` knows no DELETE and hides an error's body).
    The request is written by ``nc -e``'s program, which then copies the answer to stderr: a
    plain ``printf | nc`` half-closes the connection when its input ends, and tornado takes
    that for the caller going away (the answer is then dropped)."""
    request = f"{method} /v1/attachments HTTP/1.0\\r\\nAuthorization: Bearer %s\\r\\n"
    if body is not None:
        request += f"Content-Type: application/json\\r\\nContent-Length: {len(body)}\\r\\n"
    request += "\\r\\n" + (body or "")  # printf's format: no '%' in the body
    program = f'printf "$1" "$(cat {TOKEN_PATH})"; cat >&2'
    argv = ["nc", "-w", str(REQUEST_TIMEOUT), service_ip, "8477",
            "-e", "/bin/sh", "-c", program, "sh", request]  # fmt: skip
    answer = cluster.exec(ns, "nb", argv, timeout=REQUEST_TIMEOUT + 10)
    status_line, _, rest = answer.stderr.partition("\r\n")
    if not status_line.startswith("HTTP/"):
        return 0, f"no HTTP answer: {answer}"
    return int(status_line.split()[1]), rest.partition("\r\n\r\n")[2]


def attach_and_detach_through_the_service(cluster: Cluster, ns: str, service_ip: str) -> None:
    """A notebook pod in ``ns`` attaches a GPU through the agent's Service at ``service_ip``
    with its projected token, opens it, and detaches (also the Helm chart's test)."""
    cluster.core.create_namespaced_pod(ns, _notebook_with_token("nb"))
    cluster.wait_running(ns, "nb")
    answers: list[tuple[int, str]] = []

    def attach() -> dict[str, Any] | None:
        # Retried while the Service has no endpoint yet (nc gets no answer) or the agent says
        # the refusal is temporary; anything else fails at once with the agent's answer.
        status, body = _agent_call(cluster, ns, service_ip, "POST", '{"count": 1}')
        answers.append((status, body))
        if status == 201:
            created: dict[str, Any] = json.loads(body)
            return created
        assert status == 0 or json.loads(body).get("retryable"), answers
        return None

    try:
        created = eventually(attach, "an attach through the Service")
    except AssertionError as e:
        raise AssertionError(f"{e}; the agent's last answers: {answers[-3:]}") from e
    (attachment,) = created["attachments"]
    assert attachment["target"]["pod"] == {"namespace": ns, "name": "nb", "container": "notebook"}
    opened = cluster.exec(ns, "nb", ["cat", f"/dev/nvidia{attachment['minor']}"])
    assert "No such device or address" in opened.stdout + opened.stderr
    (holder,) = cluster.holders(ns)
    assert holder["status"]["phase"] == "Running"
    status, body = _agent_call(cluster, ns, service_ip, "DELETE")
    assert status == 204, body
    eventually(lambda: cluster.holders(ns) == [], "the detach through the Service frees the GPU")
