"""A notebook pod calling the agent through the node-local Service with its projected token, as
the server extension does: the pod, and the request written out from inside it.

Why a module of its own: the deployment test, the Helm chart's test and the production node's
tests (``test_production_node.py``, pods on the VM node) make the same calls; a pod on another
node is reached through the API server (``Cluster.exec``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from ..k8s.image import TOOLS_IMAGE
from .cluster import Cluster, eventually

TOKEN_PATH: Final = "/var/run/secrets/gpu-hotplug/token"
AGENT_PORT: Final = 8477
REQUEST_TIMEOUT: Final = 120
"""Seconds an attach or detach from inside the notebook may take (its holder's start)."""


def notebook_with_token(name: str, node: str | None = None) -> dict[str, Any]:
    """A notebook pod as the spawner makes it: a projected token for the agent's audience;
    ``node``: scheduled to that node only."""
    spec: dict[str, Any] = {
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
    }
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"metadata": {"name": name}, "spec": spec}


def agent_call(
    cluster: Cluster,
    ns: str,
    service_ip: str,
    method: str,
    body: str | None = None,
    *,
    pod: str = "nb",
    path: str = "/v1/attachments",
    timeout: int = REQUEST_TIMEOUT,
) -> tuple[int, str]:
    """``method path`` from inside the notebook pod ``pod`` with its projected
    token; returns the status and the body, so that a refusal shows the agent's own words
    (status 0: no answer, while the Service has no endpoint yet).

    Written out for busybox's ``nc`` (its ``wget`` knows no DELETE and hides an error's body).
    The request is written by ``nc -e``'s program, which then copies the answer to stderr: a
    plain ``printf | nc`` half-closes the connection when its input ends, and tornado takes
    that for the caller going away (the answer is then dropped)."""
    request = f"{method} {path} HTTP/1.0\\r\\nAuthorization: Bearer %s\\r\\n"
    if body is not None:
        request += f"Content-Type: application/json\\r\\nContent-Length: {len(body)}\\r\\n"
    request += "\\r\\n" + (body or "")  # printf's format: no '%' in the body
    program = f'printf "$1" "$(cat {TOKEN_PATH})"; cat >&2'
    argv = ["nc", "-w", str(timeout), service_ip, str(AGENT_PORT),
            "-e", "/bin/sh", "-c", program, "sh", request]  # fmt: skip
    answer = cluster.exec(ns, pod, argv, timeout=timeout + 10)
    status_line, _, rest = answer.stderr.partition("\r\n")
    if not status_line.startswith("HTTP/"):
        return 0, f"no HTTP answer: {answer}"
    return int(status_line.split()[1]), rest.partition("\r\n\r\n")[2]


def attach_through_the_service(
    cluster: Cluster,
    ns: str,
    service_ip: str,
    *,
    pod: str = "nb",
    expect: int = 201,
    wait_seconds: int | None = None,
) -> dict[str, Any]:
    """An attach of one GPU from ``pod``, retried while the Service has no endpoint yet or
    the agent says the refusal is temporary; the answer's body once its status is ``expect``
    (anything else fails at once with the agent's answer). ``wait_seconds``: the request's
    (how long its holder may take to start, and to wait in the queue)."""
    answers: list[tuple[int, str]] = []
    request = {"count": 1} | ({} if wait_seconds is None else {"wait_seconds": wait_seconds})
    timeout = REQUEST_TIMEOUT + (wait_seconds or 0)

    def attach() -> dict[str, Any] | None:
        status, body = agent_call(
            cluster, ns, service_ip, "POST", json.dumps(request), pod=pod, timeout=timeout
        )
        answers.append((status, body))
        if status == 0:
            return None
        try:
            answered: dict[str, Any] = json.loads(body)
        except ValueError:
            raise AssertionError(f"not a JSON answer: {answers[-3:]}") from None
        if status == expect:
            return answered
        assert answered.get("retryable"), answers
        return None

    try:
        answered: dict[str, Any] = eventually(attach, "an attach through the Service")
    except AssertionError as e:
        raise AssertionError(f"{e}; the agent's last answers: {answers[-3:]}") from e
    return answered


def attach_and_detach_through_the_service(cluster: Cluster, ns: str, service_ip: str) -> None:
    """A notebook pod in ``ns`` attaches a GPU through the agent's Service at ``service_ip``
    with its projected token, opens it, and detaches (the kustomize and Helm chart tests)."""
    cluster.core.create_namespaced_pod(ns, notebook_with_token("nb"))
    cluster.wait_running(ns, "nb")
    created = attach_through_the_service(cluster, ns, service_ip)
    (attachment,) = created["attachments"]
    assert attachment["target"]["pod"] == {"namespace": ns, "name": "nb", "container": "notebook"}
    opened = cluster.exec(ns, "nb", ["cat", f"/dev/nvidia{attachment['minor']}"])
    assert "No such device or address" in opened.stdout + opened.stderr
    (holder,) = cluster.holders(ns)
    assert holder["status"]["phase"] == "Running"
    status, body = agent_call(cluster, ns, service_ip, "DELETE")
    assert status == 204, body
    eventually(lambda: cluster.holders(ns) == [], "the detach through the Service frees the GPU")
