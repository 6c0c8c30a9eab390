"""The fake apiserver through the official ``kubernetes`` client over HTTP: the proof that
what the agent will be tested against behaves like the real server where the agent relies
on it (server-set fields, selectors, watch, patches, deletion, garbage collection, reviews,
discovery, and the faults only a fake can inject on demand: 410 Gone, ended watches,
errors). No root, no containerd: the kubelet is not running here."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import kubernetes.client
import kubernetes.config
import kubernetes.watch
import pytest
from kubernetes.client import ApiException

from .apiserver.reviews import POD_NAME_KEY, POD_UID_KEY
from .kube import AGENT_USER, FakeKube

pytestmark = pytest.mark.k8s

k8s: Any = kubernetes.client
watch: Any = kubernetes.watch
config: Any = kubernetes.config
"""The official client, untyped here: the tests pass it plain dicts, as the agent does."""

NODE = "node-a"


@pytest.fixture
def api(kube: FakeKube) -> Iterator[Any]:
    with kube.client() as client:
        yield client


@pytest.fixture
def core(api: Any) -> Any:
    return k8s.CoreV1Api(api)


def pod_body(name: str = "", *, node: str = NODE, gpus: int = 0, **meta: Any) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    metadata = {"name": name} if name else {"generateName": "p-"}
    return {
        "metadata": metadata | meta,
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "image": "busybox:1", "resources": {"limits": limits}}],
        },
    }


def status_of(error: pytest.ExceptionInfo[ApiException]) -> tuple[int, str]:
    body = json.loads(error.value.body or "{}")
    return error.value.status, body["message"]


def test_server_sets_identity_fields(kube: FakeKube, core: Any) -> None:
    first = core.create_namespaced_pod("default", pod_body())
    second = core.create_namespaced_pod("default", pod_body())
    assert first.metadata.name.startswith("p-") and len(first.metadata.name) == 7
    assert first.metadata.name != second.metadata.name
    assert first.metadata.uid != second.metadata.uid
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    assert first.metadata.creation_timestamp is not None
    assert first.status.phase == "Pending" and first.status.qos_class == "BestEffort"
    assert first.spec.restart_policy == "Always" and first.spec.priority == 0

    read = core.read_namespaced_pod(first.metadata.name, "default")
    assert read.metadata.uid == first.metadata.uid

    with pytest.raises(ApiException) as duplicate:
        core.create_namespaced_pod("default", pod_body(first.metadata.name))
    assert status_of(duplicate) == (409, f'pods "{first.metadata.name}" already exists')
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod("nope", "default")
    assert status_of(missing) == (404, 'pods "nope" not found')
    with pytest.raises(ApiException) as no_namespace:
        core.create_namespaced_pod("elsewhere", pod_body("x"))
    assert status_of(no_namespace) == (404, 'namespaces "elsewhere" not found')
    with pytest.raises(ApiException) as unnamed:
        core.create_namespaced_pod("default", {"spec": pod_body()["spec"]})
    assert unnamed.value.status == 422


def test_extended_resources_are_validated_and_make_qos(core: Any) -> None:
    body = pod_body(gpus=1)
    body["spec"]["containers"][0]["resources"] = {"requests": {"nvidia.com/gpu": "1"}}
    with pytest.raises(ApiException) as no_limit:
        core.create_namespaced_pod("default", body)
    assert no_limit.value.status == 422
    assert "Limit must be set for non overcommitable resources" in status_of(no_limit)[1]

    guaranteed = pod_body(gpus=1)
    guaranteed["spec"]["containers"][0]["resources"]["limits"] |= {"cpu": "1m", "memory": "4Mi"}
    created = core.create_namespaced_pod("default", guaranteed)
    assert created.status.qos_class == "Guaranteed"
    assert created.spec.containers[0].resources.requests == {
        "nvidia.com/gpu": "1",
        "cpu": "1m",
        "memory": "4Mi",
    }


def test_label_and_field_selectors(core: Any) -> None:
    core.create_namespaced_pod("default", pod_body("a", labels={"role": "holder", "gpu": "0"}))
    core.create_namespaced_pod("default", pod_body("b", labels={"role": "holder"}, node="node-b"))
    core.create_namespaced_pod("default", pod_body("c", labels={"role": "notebook"}))

    def names(**selectors: str) -> list[str]:
        listed = core.list_namespaced_pod("default", **selectors)
        return sorted(p.metadata.name for p in listed.items)

    assert names(label_selector="role=holder") == ["a", "b"]
    assert names(label_selector="role!=holder") == ["c"]
    assert names(label_selector="role in (holder,notebook),gpu") == ["a"]
    assert names(label_selector="role notin (holder)") == ["c"]
    assert names(label_selector="!gpu") == ["b", "c"]
    assert names(field_selector=f"spec.nodeName={NODE}") == ["a", "c"]
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector=f"spec.nodeName={NODE},metadata.name!=a") == ["c"]
    assert names(label_selector="role=holder", field_selector=f"spec.nodeName={NODE}") == ["a"]
    everywhere = core.list_pod_for_all_namespaces(field_selector="metadata.name=a")
    assert [p.metadata.namespace for p in everywhere.items] == ["default"]
    with pytest.raises(ApiException) as unsupported:
        names(field_selector="spec.hostname=x")
    assert status_of(unsupported) == (400, "field label not supported: spec.hostname")


def watch_events(
    core: Any, resource_version: str, count: int, **kwargs: Any
) -> tuple[threading.Thread, list[tuple[str, str, str]]]:
    """Collect (type, name, resourceVersion) of the first ``count`` events of a pod watch,
    in a thread (the watch's own timeout is only an upper bound)."""
    events: list[tuple[str, str, str]] = []

    def run() -> None:
        stream = watch.Watch()
        for event in stream.stream(
            core.list_namespaced_pod,
            "default",
            resource_version=resource_version,
            timeout_seconds=60,
            **kwargs,
        ):
            obj = event["object"]
            events.append((event["type"], obj.metadata.name, obj.metadata.resource_version))
            if len(events) == count:
                stream.stop()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, events


def test_watch_from_a_list_misses_nothing(kube: FakeKube, core: Any) -> None:
    listed = core.list_namespaced_pod("default")
    # Changes made before the watch starts are replayed from the list's resourceVersion.
    core.create_namespaced_pod("default", pod_body("w", labels={"keep": "yes"}))
    thread, events = watch_events(
        core, listed.metadata.resource_version, 3, label_selector="keep=yes"
    )
    core.patch_namespaced_pod("w", "default", {"metadata": {"annotations": {"a": "1"}}})
    core.create_namespaced_pod("default", pod_body("other"))  # outside the selection
    # Leaving the selection is a DELETED for this watch, although the pod still exists.
    core.patch_namespaced_pod("w", "default", {"metadata": {"labels": {"keep": None}}})
    thread.join()
    assert [(kind, name) for kind, name, _ in events] == [
        ("ADDED", "w"),
        ("MODIFIED", "w"),
        ("DELETED", "w"),
    ]
    versions = [int(v) for _, _, v in events]
    assert versions == sorted(versions) and len(set(versions)) == 3
    assert core.read_namespaced_pod("w", "default").metadata.labels == {}


def test_watch_ends_after_its_timeout(core: Any) -> None:
    events = list(watch.Watch().stream(core.list_namespaced_pod, "default", timeout_seconds=1))
    assert events == []  # nothing exists, nothing happened: the server ended the stream


def test_watch_after_compaction_is_gone(kube: FakeKube, core: Any) -> None:
    old = core.list_namespaced_pod("default").metadata.resource_version
    core.create_namespaced_pod("default", pod_body("x"))
    kube.compact()
    with pytest.raises(ApiException) as gone:
        for _ in watch.Watch().stream(
            core.list_namespaced_pod, "default", resource_version=old, timeout_seconds=1
        ):
            pass
    assert gone.value.status == 410


def test_patches_and_status(core: Any) -> None:
    core.create_namespaced_pod("default", pod_body("p", annotations={"keep": "1", "drop": "2"}))
    # A dict body is a strategic merge patch: maps merge, null deletes.
    patched = core.patch_namespaced_pod(
        "p", "default", {"metadata": {"annotations": {"new": "3", "drop": None}}}
    )
    assert patched.metadata.annotations == {"keep": "1", "new": "3"}
    # A list body is a JSON patch.
    patched = core.patch_namespaced_pod(
        "p", "default", [{"op": "add", "path": "/metadata/labels", "value": {"l": "v"}}]
    )
    assert patched.metadata.labels == {"l": "v"}
    # The main resource ignores status; the status subresource changes only status.
    ignored = core.patch_namespaced_pod("p", "default", {"status": {"phase": "Running"}})
    assert ignored.status.phase == "Pending"
    running = core.patch_namespaced_pod_status(
        "p",
        "default",
        {
            "metadata": {"labels": {"l": "changed"}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
        },
    )
    assert running.status.phase == "Running" and running.metadata.labels == {"l": "v"}
    merged = core.patch_namespaced_pod_status(
        "p", "default", {"status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}
    )
    assert sorted(c.type for c in merged.status.conditions) == ["PodScheduled", "Ready"]
    # A pod's spec is immutable but for a few fields.
    with pytest.raises(ApiException) as immutable:
        core.patch_namespaced_pod("p", "default", {"spec": {"nodeName": "elsewhere"}})
    assert immutable.value.status == 422
    # Optimistic concurrency: a stale resourceVersion is a conflict.
    stale = core.read_namespaced_pod("p", "default")
    core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"l": "w"}}})
    stale.metadata.labels = {"l": "x"}
    with pytest.raises(ApiException) as conflict:
        core.replace_namespaced_pod("p", "default", stale)
    assert conflict.value.status == 409


def delete_options(grace: int, uid: str) -> k8s.V1DeleteOptions:
    return k8s.V1DeleteOptions(
        grace_period_seconds=grace, preconditions=k8s.V1Preconditions(uid=uid)
    )


def test_delete_is_graceful_for_running_pods(core: Any) -> None:
    core.create_namespaced_pod("default", pod_body("unbound", node=""))
    core.delete_namespaced_pod("unbound", "default")  # never scheduled: gone at once
    assert not core.list_namespaced_pod("default").items

    created = core.create_namespaced_pod("default", pod_body("bound"))
    marked = core.delete_namespaced_pod("bound", "default")
    assert marked.metadata.deletion_timestamp is not None
    assert marked.metadata.deletion_grace_period_seconds == 30
    with pytest.raises(ApiException) as precondition:
        core.delete_namespaced_pod("bound", "default", body=delete_options(0, "other"))
    assert precondition.value.status == 409
    core.delete_namespaced_pod("bound", "default", body=delete_options(0, created.metadata.uid))
    assert not core.list_namespaced_pod("default").items


def owned_by(owner: Any) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": owner.metadata.name,
            "uid": owner.metadata.uid,
            "blockOwnerDeletion": True,
        }
    ]


def test_garbage_collection(kube: FakeKube, core: Any) -> None:
    kube.create_namespace("team")
    owner = core.create_namespaced_pod("team", pod_body("owner", node=""))
    dependent = pod_body("dep", node="", ownerReferences=owned_by(owner))
    core.create_namespaced_pod("team", dependent)
    # The same reference from another namespace names no owner the collector can find.
    core.create_namespace({"metadata": {"name": "other"}})
    core.create_namespaced_pod("other", pod_body("cross", node="", ownerReferences=owned_by(owner)))
    kube.wait_for_pod(
        "other", "cross", lambda p: p is None, "the cross-namespace dependent is collected"
    )
    assert kube.pod("team", "dep") is not None

    core.delete_namespaced_pod("owner", "team")
    kube.wait_for_pod("team", "dep", lambda p: p is None, "the dependent is collected")

    orphan_owner = core.create_namespaced_pod("team", pod_body("owner2", node=""))
    core.create_namespaced_pod(
        "team", pod_body("kept", node="", ownerReferences=owned_by(orphan_owner))
    )
    core.delete_namespaced_pod("owner2", "team", propagation_policy="Orphan")
    kept = kube.wait_for_pod(
        "team", "kept", lambda p: p is not None and not p["metadata"]["ownerReferences"], "orphaned"
    )
    assert kept is not None


def token_review(api: Any, token: str, audiences: list[str]) -> Any:
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
              "spec": {"token": token, "audiences": audiences}}  # fmt: skip
    return k8s.AuthenticationV1Api(api).create_token_review(review).status


def test_token_review(kube: FakeKube, api: Any) -> None:
    core = k8s.CoreV1Api(api)
    pod = core.create_namespaced_pod("default", pod_body("nb", node=""))
    token = kube.pod_token("default", "nb")

    status = token_review(api, token, ["gpu-hotplug"])
    assert status.authenticated is True
    assert status.user.username == "system:serviceaccount:default:default"
    assert status.user.extra[POD_NAME_KEY] == ["nb"]
    assert status.user.extra[POD_UID_KEY] == [pod.metadata.uid]
    assert status.audiences == ["gpu-hotplug"]

    assert token_review(api, token, ["another-service"]).authenticated is False
    unknown = token_review(api, "not-a-token", ["gpu-hotplug"])
    assert unknown.authenticated is False and unknown.error
    core.delete_namespaced_pod("nb", "default")  # unbound pod: gone at once
    core.create_namespaced_pod("default", pod_body("nb", node=""))  # same name, new uid
    assert token_review(api, token, ["gpu-hotplug"]).authenticated is False
    assert kube.token_reviews == 4


def test_subject_access_review(kube: FakeKube, api: Any) -> None:
    kube.allow(verbs=("create", "delete"), resources=("pods/gpus",), users=("alice",))
    kube.allow(verbs=("get",), resources=("pods/gpus",), groups=("ops",), namespaces=("team",))
    authz = k8s.AuthorizationV1Api(api)

    def allowed(verb: str, namespace: str, user: str = "", groups: tuple[str, ...] = ()) -> bool:
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": user,
                "groups": list(groups),
                "resourceAttributes": {"namespace": namespace, "verb": verb, "group": "",
                                       "resource": "pods", "subresource": "gpus", "name": "nb"},
            },
        }  # fmt: skip
        return bool(authz.create_subject_access_review(review).status.allowed)

    assert allowed("create", "team", "alice") and allowed("delete", "any", "alice")
    assert not allowed("get", "team", "alice")
    assert allowed("get", "team", "bob", ("ops",)) and not allowed("get", "other", "bob", ("ops",))
    assert not allowed("create", "team", "mallory", ("system:authenticated",))
    with pytest.raises(ApiException) as nobody:
        allowed("get", "team")
    assert nobody.value.status == 422


def test_priority_classes(kube: FakeKube, core: Any) -> None:
    kube.create_priority_class("notebooks", 1000)
    body = pod_body("nb")
    body["spec"]["priorityClassName"] = "notebooks"
    assert core.create_namespaced_pod("default", body).spec.priority == 1000
    body = pod_body("other")
    body["spec"]["priorityClassName"] = "missing"
    with pytest.raises(ApiException) as unknown:
        core.create_namespaced_pod("default", body)
    assert status_of(unknown) == (
        403,
        'pods "other" is forbidden: no PriorityClass with name missing was found',
    )


def test_events_runtime_classes_and_discovery(kube: FakeKube, api: Any) -> None:
    core = k8s.CoreV1Api(api)
    pod = core.create_namespaced_pod("default", pod_body("nb"))
    event = {
        "metadata": {"generateName": "nb."},
        "involvedObject": {"kind": "Pod", "namespace": "default", "name": "nb",
                           "uid": pod.metadata.uid, "apiVersion": "v1"},
        "reason": "GpuAttached", "message": "attached GPU-1", "type": "Normal",
        "source": {"component": "gpu-hotplug-agent"},
    }  # fmt: skip
    core.create_namespaced_event("default", event)
    listed = core.list_namespaced_event("default", field_selector="involvedObject.name=nb")
    assert [e.reason for e in listed.items] == ["GpuAttached"]
    kube.create_namespace("team")
    with pytest.raises(ApiException) as elsewhere:
        core.create_namespaced_event("team", event)  # about a pod of another namespace
    assert elsewhere.value.status == 422

    kube.create_runtime_class("kata", "kata-qemu")
    node_api = k8s.NodeV1Api(api)
    assert node_api.read_runtime_class("kata").handler == "kata-qemu"

    assert k8s.VersionApi(api).get_code().major == "1"
    groups = k8s.ApisApi(api).get_api_versions()
    names = {g.name for g in groups.groups}
    assert {"authentication.k8s.io", "authorization.k8s.io", "node.k8s.io"} <= names
    resources = core.get_api_resources()
    assert {"pods", "pods/status", "events", "namespaces"} <= {r.name for r in resources.resources}
    assert any(uri.startswith("/version") for method, uri in kube.requests if method == "GET")


AGENT_ROLE = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "ClusterRole",
    "metadata": {"name": "agent"},
    "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["authentication.k8s.io"],
            "resources": ["tokenreviews"],
            "verbs": ["create"],
        },
    ],
}


def test_callers_can_be_held_to_their_rbac(kube: FakeKube) -> None:
    kube.authorize_callers()
    kube.grant(AGENT_ROLE, users=(AGENT_USER,))
    agent_client = config.new_client_from_config(config_file=str(kube.kubeconfig_path))
    with agent_client:
        agent = k8s.CoreV1Api(agent_client)
        assert agent.list_pod_for_all_namespaces(field_selector="spec.nodeName=n").items == []
        with pytest.raises(ApiException) as denied:
            agent.create_namespaced_pod("default", pod_body("x"))
        assert k8s.CoreV1Api(agent_client).list_namespaced_pod("default").items == []
        assert status_of(denied) == (
            403,
            f'pods is forbidden: User "{AGENT_USER}" cannot create resource "pods" in API group '
            '"" in the namespace "default"',
        )
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                  "spec": {"token": "x"}}  # fmt: skip
        assert k8s.AuthenticationV1Api(agent_client).create_token_review(review).status
        # Holder-style pods that block their owner's deletion need pods/finalizers too.
        owner = kube.create_pod("default", pod_body("nb"))["metadata"]
        reference = {"apiVersion": "v1", "kind": "Pod", "name": "nb", "uid": owner["uid"],
                     "blockOwnerDeletion": True}  # fmt: skip
        holder = pod_body("held", ownerReferences=[reference])
        kube.grant(
            {"rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}]},
            users=(AGENT_USER,),
        )
        with pytest.raises(ApiException) as blocked:
            agent.create_namespaced_pod("default", holder)
        assert blocked.value.status == 403 and "blockOwnerDeletion" in status_of(blocked)[1]
        kube.grant(
            {"rules": [{"apiGroups": [""], "resources": ["pods/finalizers"], "verbs": ["update"]}]},
            users=(AGENT_USER,),
        )
        assert agent.create_namespaced_pod("default", holder).metadata.owner_references
    with kube.client("unknown-token") as stranger, pytest.raises(ApiException) as unknown:
        k8s.CoreV1Api(stranger).list_namespaced_pod("default")
    assert unknown.value.status == 401
    with kube.client() as admin:
        assert k8s.CoreV1Api(admin).create_namespaced_pod("default", pod_body("x"))


def test_injected_failures_and_ended_watches(kube: FakeKube, core: Any) -> None:
    kube.fail("POST", "/pods", 503, times=1)
    with pytest.raises(ApiException) as down:
        core.create_namespaced_pod("default", pod_body("x"))
    assert down.value.status == 503
    core.create_namespaced_pod("default", pod_body("x"))  # consumed: served again

    resource_version = core.list_namespaced_pod("default").metadata.resource_version
    thread, events = watch_events(core, resource_version, 1)
    kube.wait_for_pod(
        "default",
        "x",
        lambda _: any(
            u.startswith("/api/v1/namespaces/default/pods?") and "watch=" in u
            for _, u in kube.requests
        ),
        "the watch is open",
    )
    kube.end_watches()
    thread.join()
    assert events == []  # the stream ended without an event: the client must watch again


def test_deleting_a_namespace_deletes_its_content(kube: FakeKube, core: Any) -> None:
    kube.create_namespace("team")
    core.create_namespaced_pod("team", pod_body("unbound", node=""))
    core.create_namespaced_pod("team", pod_body("bound"))  # no kubelet: its deletion waits
    core.delete_namespace("team")
    assert core.read_namespace("team").status.phase == "Terminating"
    assert [p.metadata.name for p in core.list_namespaced_pod("team").items] == ["bound"]
    with pytest.raises(ApiException) as terminating:
        core.create_namespaced_pod("team", pod_body("late"))
    assert terminating.value.status == 403
    core.delete_namespaced_pod("bound", "team", grace_period_seconds=0)  # the kubelet's part
    kube.wait_for_pod("team", "bound", lambda p: p is None, "the pod is gone")
    kube.wait_for(lambda: kube.namespace("team") is None, "the empty namespace goes")
    with pytest.raises(ApiException) as gone:
        core.read_namespace("team")
    assert gone.value.status == 404
