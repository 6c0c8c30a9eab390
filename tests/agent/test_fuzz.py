"""Fuzzing the API with hypothesis: whatever a client sends, the answer is never a 5xx and
always one that ``openapi.json`` documents, with a body matching its schema.

Requests are built from the document's own vocabulary (routes, query names, body members)
mixed with garbage, over both transports and with good, bad and missing credentials, against
one agent served over the in-memory fakes for the whole module (state accumulates across
examples, as it would on a real node).
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .api_harness import TOKEN, ApiClient, Response, ServedAgent, self_in, serve_agent

UUIDS = st.one_of(
    st.just("GPU-00000000-0000-4000-8000-000000000000"),
    st.just("GPU-00000001-0000-4000-8000-000000000000"),
    st.uuids().map(lambda u: f"GPU-{u}"),
    st.uuids().map(lambda u: f"MIG-{u}"),
    st.text(min_size=1, max_size=40),
)
PATHS = st.one_of(
    st.sampled_from(["/v1/gpus", "/v1/attachments", "/healthz", "/metrics", "/v1/openapi.json"]),
    UUIDS.map(lambda u: "/v1/attachments/" + urllib.parse.quote(u, safe="")),
    st.text(max_size=30).map(lambda t: "/" + urllib.parse.quote(t)),
)
QUERY_NAMES = st.sampled_from(["pid", "pod", "container", "force", "verbose", ""])
QUERY_VALUES = st.one_of(
    st.integers(min_value=-5, max_value=5_000_000).map(str),
    st.sampled_from(["100", "true", "false", "1", "0", "ns/name", "a/b/c", "kernel"]),
    st.text(max_size=20),
)
QUERIES = st.lists(st.tuples(QUERY_NAMES, QUERY_VALUES), max_size=4)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
TARGETS = st.one_of(
    st.fixed_dictionaries({"pid": st.one_of(st.sampled_from([1, 2, 100, 4000]), JSON_VALUES)}),
    st.fixed_dictionaries(
        {
            "pod": st.fixed_dictionaries(
                {"namespace": st.text(max_size=8), "name": st.text(max_size=8)}
            )
        }
    ),
    JSON_VALUES,
)
ATTACH_BODIES = st.fixed_dictionaries(
    {"count": st.one_of(st.integers(min_value=-2, max_value=10), JSON_VALUES)},
    optional={
        "target": TARGETS,
        "wait_seconds": st.one_of(st.floats(), st.integers(), JSON_VALUES),
        "request_id": st.one_of(st.text(max_size=20), st.sampled_from(["r1", "r2"])),
        "extra": JSON_VALUES,
    },
)
BODIES = st.one_of(
    st.none(),
    ATTACH_BODIES.map(lambda body: json.dumps(body).encode()),
    JSON_VALUES.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=200),
)
CREDENTIALS = st.sampled_from(["tcp-token", "tcp-none", "tcp-wrong", "unix-none", "unix-token"])


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedAgent]:
    with serve_agent(tmp_path_factory.mktemp("fuzz"), gpus=4) as served:
        served.host.spawn(100, "kernel-a")
        served.host.spawn(2, "kernel-b")
        self_in(served, "kernel-a")
        yield served


def _client(served: ServedAgent, credentials: str) -> ApiClient:
    transport, _, token = credentials.partition("-")
    client = served.tcp if transport == "tcp" else served.unix
    return client.with_token({"token": TOKEN, "none": None, "wrong": "x" * 43}[token])


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    method=st.sampled_from(["GET", "POST", "DELETE"]),
    path=PATHS,
    query=QUERIES,
    body=BODIES,
    credentials=CREDENTIALS,
)
def test_no_request_gets_a_5xx(
    fuzzed: ServedAgent,
    method: str,
    path: str,
    query: list[tuple[str, str]],
    body: bytes | None,
    credentials: str,
) -> None:
    target = path + ("?" + urllib.parse.urlencode(query) if query else "")

    # ``call`` checks the answer against openapi.json (documented status, schema).
    response: Response = _client(fuzzed, credentials).call(method, target, raw=body)

    assert response.status < 500, response.body


def test_the_fuzzed_agent_still_keeps_its_books(fuzzed: ServedAgent) -> None:
    # After the fuzzing: every GPU the ledger gives out is usable by exactly its target.
    by_container: dict[Any, set[int]] = {}
    for entry in fuzzed.ledger.attachments():
        process = fuzzed.host.processes[entry.target.pid]  # type: ignore[union-attr]
        by_container.setdefault(process.container, set()).add(entry.gpu.minor)
    granted = {
        where: {d.minor for d in devices} for where, devices in fuzzed.injector.granted.items()
    }
    assert {k: v for k, v in granted.items() if v} == by_container
