"""Request parsing: every way a request can be wrong is refused with InvalidRequest, and only so.

Cases are named tables: (id, input, the field the error names, a fragment of its message).
The hypothesis tests feed arbitrary bytes, JSON and query strings and require that nothing but
``InvalidRequest`` ever escapes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpu_hotplug._structs import (
    DEFAULT_WAIT_SECONDS,
    PID_MAX_LIMIT,
    GpuSelector,
    GpuUuid,
    PidRef,
    PodTarget,
    RequestId,
    WireFormatError,
)
from jupyter_gpu_hotplug.agent.api.validation import (
    MAX_BODY_BYTES,
    check_query_names,
    parse_attach_request,
    parse_detach_all,
    parse_force,
    parse_gpu_uuid,
    parse_request_id,
    parse_target_query,
)
from jupyter_gpu_hotplug.agent.core.errors import InvalidRequest
from jupyter_gpu_hotplug.agent.core.seams import AttachRequest

MAX_COUNT = 4


def body(obj: object) -> bytes:
    return json.dumps(obj).encode()


def pod(**members: object) -> dict[str, object]:
    return {"count": 1, "target": {"pod": {"namespace": "jhub", "name": "jupyter-a", **members}}}


# --- bodies that parse --------------------------------------------------------------------------

NAMED = ["GPU-0123abcd-4567-89ef-0123-456789abcdef", "MIG-0123abcd-4567-89ef-0123-456789abcdef"]
"""A GPU and a MIG slice, as an attach may name them."""

VALID_BODIES: list[tuple[str, bytes, AttachRequest]] = [
    ("count-only", b'{"count": 1}', AttachRequest(1, None, DEFAULT_WAIT_SECONDS, None)),
    ("many", b'{"count": 4096}', AttachRequest(4096, None, DEFAULT_WAIT_SECONDS, None)),
    # JSON Schema's integer, as the document says: 1.0 and 1e0 are 1 (true is not).
    ("integral-float", b'{"count": 1.0}', AttachRequest(1, None, DEFAULT_WAIT_SECONDS, None)),
    ("exponent", b'{"count": 1e0}', AttachRequest(1, None, DEFAULT_WAIT_SECONDS, None)),
    ("whitespace", b' \n{ "count" : 2 }\n', AttachRequest(2, None, DEFAULT_WAIT_SECONDS, None)),
    (
        "everything",
        body(
            {
                "count": 2,
                "target": {"pod": {"namespace": "jhub", "name": "jupyter-a.b", "container": "nb"}},
                "wait_seconds": 600,
                "request_id": "A-z_0.9:x",
            }
        ),
        AttachRequest(
            2, PodTarget("jhub", "jupyter-a.b", "nb"), 600.0, RequestId("A-z_0.9:x"), queued=True
        ),
    ),
    ("pod-no-container", body(pod()), AttachRequest(1, PodTarget("jhub", "jupyter-a"), 60.0, None)),
    (
        "pid",
        body({"count": 1, "target": {"pid": 2}}),
        AttachRequest(1, PidRef(2), DEFAULT_WAIT_SECONDS, None),
    ),
    (
        "pid-max",
        body({"count": 1, "target": {"pid": PID_MAX_LIMIT - 1}}),
        AttachRequest(1, PidRef(PID_MAX_LIMIT - 1), DEFAULT_WAIT_SECONDS, None),
    ),
    (
        "fractional-wait",
        body({"count": 1, "wait_seconds": 0.001}),
        AttachRequest(1, None, 0.001, None, queued=True),
    ),
    (
        "idle-release",
        body({"count": 1, "idle_release_seconds": 90}),
        AttachRequest(1, None, 60.0, None, idle_release_seconds=90.0),
    ),
    (
        "long-names",
        body(pod(namespace="n" * 63, name="p" * 253, container="c" * 63)),
        AttachRequest(1, PodTarget("n" * 63, "p" * 253, "c" * 63), 60.0, None),
    ),
    (
        "named",
        body({"count": 2, "gpus": NAMED}),
        AttachRequest(2, None, 60.0, None, gpus=tuple(GpuUuid(u) for u in NAMED)),
    ),
    (
        "model",
        body({"count": 2, "model": "H100"}),
        AttachRequest(2, None, 60.0, None, selector=GpuSelector(model="H100")),
    ),
    (
        "model-64-and-memory",
        body({"count": 1, "model": "m" * 64, "min_memory": 40 * 2**30}),
        AttachRequest(1, None, 60.0, None, selector=GpuSelector("m" * 64, 40 * 2**30)),
    ),
    (
        "min-memory-integral-float",
        body({"count": 1, "min_memory": 1024.0}),
        AttachRequest(1, None, 60.0, None, selector=GpuSelector(min_memory=1024)),
    ),
    (
        "request-id-128",
        body({"count": 1, "request_id": "r" * 128}),
        AttachRequest(1, None, 60.0, RequestId("r" * 128)),
    ),
]


@pytest.mark.parametrize(
    ("raw", "expected"), [c[1:] for c in VALID_BODIES], ids=[c[0] for c in VALID_BODIES]
)
def test_valid_bodies(raw: bytes, expected: AttachRequest) -> None:
    assert parse_attach_request(raw) == expected


# --- bodies that do not -------------------------------------------------------------------------

SELECTOR_BODIES: list[tuple[str, bytes, str, str]] = [
    (f"{field}-{name}", body({"count": 1, field: value}), field, words)
    for name, field, value, words in (
        ("empty", "model", "", "1 to 64 printable"),
        ("long", "model", "m" * 65, "1 to 64 printable"),
        ("control", "model", "H\n100", "printable"),
        ("unicode", "model", "H100\u00e9", "ASCII"),
        ("number", "model", 100, "got 100"),
        ("zero", "min_memory", 0, "greater than 0"),
        ("text", "min_memory", "40G", 'got "40G"'),
        ("fraction", "min_memory", 1.5, "whole number"),
        ("bool", "min_memory", True, "got true"),
    )
]
"""``model`` and ``min_memory`` refused alone (``_structs.check_selector``)."""

INVALID_BODIES: list[tuple[str, bytes, str, str]] = [
    ("empty", b"", "body", "empty"),
    ("blank", b" \n\t", "body", "empty"),
    ("not-utf8", b'{"count": 1, "x": "\xff"}', "body", "not UTF-8"),
    ("bom", b"\xef\xbb\xbf" + b'{"count": 1}', "body", "not valid JSON"),
    ("not-json", b"{count: 1}", "body", "not valid JSON"),
    ("truncated", b'{"count": 1', "body", "not valid JSON"),
    ("trailing-garbage", b'{"count": 1} x', "body", "not valid JSON"),
    ("nan", b'{"count": NaN}', "body", "NaN"),
    ("infinity", b'{"count": 1, "wait_seconds": Infinity}', "body", "Infinity"),
    ("minus-infinity", b'{"count": 1, "wait_seconds": -Infinity}', "body", "-Infinity"),
    ("huge-int", b'{"count": 1' + b"0" * 5000 + b"}", "body", "too many digits"),
    ("deep", b"[" * 50_000, "body", "nested too deeply"),
    (
        "too-large",
        b'{"count": 1, "request_id": "' + b"a" * MAX_BODY_BYTES + b'"}',
        "body",
        f"the limit is {MAX_BODY_BYTES}",
    ),
    ("array", b"[1]", "body", "JSON object"),
    ("string", b'"count"', "body", "JSON object"),
    ("null", b"null", "body", "JSON object"),
    ("number", b"1", "body", "JSON object"),
    ("duplicate", b'{"count": 1, "count": 2}', "count", "appears twice"),
    ("unknown-huge", body({"count": 1, "x" * 5000: 1}), "x" * 61 + "...", "unknown member(s)"),
    ("duplicate-nested", b'{"count": 1, "target": {"pid": 5, "pid": 6}}', "pid", "appears twice"),
    ("unknown", b'{"count": 1, "gpu": 2}', "gpu", 'unknown member(s) of the request body "gpu"'),
    ("gpus-not-array", b'{"count": 1, "gpus": 2}', "gpus", "non-empty array of GPU UUIDs"),
    ("gpus-empty", b'{"count": 1, "gpus": []}', "gpus", "got an array"),
    ("gpus-string", body({"count": 1, "gpus": NAMED[0]}), "gpus", "non-empty array"),
    ("gpus-fewer", body({"count": 2, "gpus": NAMED[:1]}), "gpus", "names 1 GPU(s) but count is 2"),
    ("gpus-more", body({"count": 1, "gpus": NAMED}), "gpus", "names 2 GPU(s) but count is 1"),
    ("gpus-twice", body({"count": 2, "gpus": [NAMED[0]] * 2}), "gpus", "more than once"),
    ("gpus-upper", body({"count": 1, "gpus": [NAMED[0].upper()]}), "gpus[0]", "lowercase hex"),
    ("gpus-index", b'{"count": 2, "gpus": ["%s", 1]}' % NAMED[0].encode(), "gpus[1]", "got 1"),
    *SELECTOR_BODIES,
    (
        "model-with-gpus",
        body({"count": 1, "gpus": NAMED[:1], "model": "H100"}),
        "model",
        "cannot be given with gpus",
    ),
    (
        "memory-with-mig",
        b'{"count": 1, "mig": "1g.10gb", "min_memory": 1}',
        "min_memory",
        "cannot be given with mig",
    ),
    ("unknown-several", b'{"count": 1, "b": 1, "a": 1}', "a", '"a", "b"'),
    ("missing-count", b"{}", "count", "count is required"),
    ("count-zero", b'{"count": 0}', "count", "at least 1"),
    ("count-negative", b'{"count": -1}', "count", "got -1"),
    ("count-bool", b'{"count": true}', "count", "got true"),
    ("count-fraction", b'{"count": 1.5}', "count", "got 1.5"),
    ("count-string", b'{"count": "1"}', "count", 'got "1"'),
    ("count-null", b'{"count": null}', "count", "got null"),
    ("count-object", b'{"count": {}}', "count", "got an object"),
    ("wait-zero", b'{"count": 1, "wait_seconds": 0}', "wait_seconds", "greater than 0"),
    ("wait-negative", b'{"count": 1, "wait_seconds": -5}', "wait_seconds", "got -5"),
    ("wait-too-long", b'{"count": 1, "wait_seconds": 600.5}', "wait_seconds", "at most 600"),
    ("wait-overflow", b'{"count": 1, "wait_seconds": 1e999}', "wait_seconds", "got inf"),
    ("wait-bool", b'{"count": 1, "wait_seconds": true}', "wait_seconds", "got true"),
    ("wait-string", b'{"count": 1, "wait_seconds": "60"}', "wait_seconds", 'got "60"'),
    ("request-id-empty", b'{"count": 1, "request_id": ""}', "request_id", "1 to 128"),
    ("request-id-long", body({"count": 1, "request_id": "r" * 129}), "request_id", "1 to 128"),
    ("request-id-space", b'{"count": 1, "request_id": "a b"}', "request_id", '"a b"'),
    ("request-id-slash", b'{"count": 1, "request_id": "a/b"}', "request_id", "letters, digits"),
    ("request-id-newline", b'{"count": 1, "request_id": "ab\\n"}', "request_id", "1 to 128"),
    ("request-id-unicode", body({"count": 1, "request_id": "\u00e9"}), "request_id", "1 to 128"),
    ("request-id-int", b'{"count": 1, "request_id": 7}', "request_id", "got 7"),
    ("target-null", b'{"count": 1, "target": null}', "target", "got null"),
    ("target-string", b'{"count": 1, "target": "ns/pod"}', "target", '{"pid": N}'),
    ("target-empty", b'{"count": 1, "target": {}}', "target", "an empty object"),
    ("target-both", b'{"count": 1, "target": {"pid": 5, "pod": {}}}', "target", "got both"),
    ("target-unknown", b'{"count": 1, "target": {"node": "x"}}', "target.node", '"node"'),
    ("pid-1", b'{"count": 1, "target": {"pid": 1}}', "target.pid", "init process"),
    ("pid-0", b'{"count": 1, "target": {"pid": 0}}', "target.pid", "from 2 to 4194303"),
    ("pid-negative", b'{"count": 1, "target": {"pid": -3}}', "target.pid", "got -3"),
    ("pid-max", body({"count": 1, "target": {"pid": PID_MAX_LIMIT}}), "target.pid", "4194304"),
    ("pid-bool", b'{"count": 1, "target": {"pid": true}}', "target.pid", "got true"),
    ("pid-fraction", b'{"count": 1, "target": {"pid": 5.5}}', "target.pid", "got 5.5"),
    ("pid-string", b'{"count": 1, "target": {"pid": "5"}}', "target.pid", 'got "5"'),
    ("pod-not-object", b'{"count": 1, "target": {"pod": "ns/x"}}', "target.pod", '"ns/x"'),
    ("pod-unknown", body(pod(uid="u")), "target.pod.uid", '"uid"'),
    (
        "pod-no-namespace",
        body({"count": 1, "target": {"pod": {"name": "x"}}}),
        "target.pod.namespace",
        "target.pod.namespace is required",
    ),
    (
        "pod-no-name",
        body({"count": 1, "target": {"pod": {"namespace": "x"}}}),
        "target.pod.name",
        "target.pod.name is required",
    ),
    ("namespace-upper", body(pod(namespace="JHub")), "target.pod.namespace", "DNS-1123 label"),
    ("namespace-dot", body(pod(namespace="a.b")), "target.pod.namespace", "DNS-1123 label"),
    ("namespace-empty", body(pod(namespace="")), "target.pod.namespace", 'got ""'),
    (
        "namespace-long",
        body(pod(namespace="n" * 64)),
        "target.pod.namespace",
        "64 characters long; the limit is 63",
    ),
    ("namespace-int", body(pod(namespace=5)), "target.pod.namespace", "got 5"),
    ("name-leading-dash", body(pod(name="-a")), "target.pod.name", "DNS-1123 subdomain"),
    ("name-trailing-dot", body(pod(name="a.")), "target.pod.name", "DNS-1123 subdomain"),
    ("name-underscore", body(pod(name="a_b")), "target.pod.name", "DNS-1123 subdomain"),
    ("name-slash", body(pod(name="a/b")), "target.pod.name", "DNS-1123 subdomain"),
    (
        "name-long",
        body(pod(name="p" * 254)),
        "target.pod.name",
        "254 characters long; the limit is 253",
    ),
    ("name-null", body(pod(name=None)), "target.pod.name", "got null"),
    ("container-dot", body(pod(container="a.b")), "target.pod.container", "DNS-1123 label"),
    ("container-long", body(pod(container="c" * 64)), "target.pod.container", "the limit is 63"),
    ("container-null", body(pod(container=None)), "target.pod.container", "got null"),
]


@pytest.mark.parametrize(
    ("raw", "field", "message"),
    [c[1:] for c in INVALID_BODIES],
    ids=[c[0] for c in INVALID_BODIES],
)
def test_invalid_bodies(raw: bytes, field: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_attach_request(raw)
    assert caught.value.field == field
    assert message in caught.value.message
    assert caught.value.to_body()["field"] == field


def test_body_limit_is_a_parameter() -> None:
    raw = b'{"count": 1}'
    assert parse_attach_request(raw, max_body=len(raw)).count == 1
    with pytest.raises(InvalidRequest, match="the limit is 11"):
        parse_attach_request(raw, max_body=len(raw) - 1)


@pytest.mark.parametrize(
    "raw",
    [
        body({"count": "x" * 10_000}),
        body({"count": 1, "k" * 10_000: 1}),
        b'{"count": 1, "' + b"k" * 10_000 + b'": 1, "' + b"k" * 10_000 + b'": 2}',
        body({"count": 1, "target": {"pod": {"namespace": "a", "name": "N" * 10_000}}}),
    ],
    ids=["value", "unknown-field", "duplicate-field", "pod-name"],
)
def test_long_bad_input_is_not_echoed_whole(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_attach_request(raw)
    assert len(json.dumps(caught.value.to_body())) < 500


def test_library_errors_are_chained() -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_attach_request(b"{")
    assert isinstance(caught.value.__cause__, WireFormatError)
    assert isinstance(caught.value.__cause__.__cause__, json.JSONDecodeError)


# --- request ids, uuids --------------------------------------------------------------------------


def test_request_id() -> None:
    assert parse_request_id("abc-1") == "abc-1"
    with pytest.raises(InvalidRequest, match="request_id"):
        parse_request_id(None)


GOOD_UUIDS = [
    "GPU-0123abcd-4567-89ef-0123-456789abcdef",
    "MIG-0123abcd-4567-89ef-0123-456789abcdef",
]
BAD_UUIDS = [
    ("empty", ""),
    ("upper-hex", "GPU-0123ABCD-4567-89EF-0123-456789ABCDEF"),
    ("lower-prefix", "gpu-0123abcd-4567-89ef-0123-456789abcdef"),
    ("no-prefix", "0123abcd-4567-89ef-0123-456789abcdef"),
    ("legacy-mig", "MIG-GPU-0123abcd-4567-89ef-0123-456789abcdef/1/0"),
    ("short", "GPU-0123abcd-4567-89ef-0123-456789abcde"),
    ("long", "GPU-0123abcd-4567-89ef-0123-456789abcdef0"),
    ("replica-suffix", "GPU-0123abcd-4567-89ef-0123-456789abcdef::1"),
    ("trailing-newline", "GPU-0123abcd-4567-89ef-0123-456789abcdef\n"),
    ("non-hex", "GPU-0123abcg-4567-89ef-0123-456789abcdef"),
    ("unicode-digit", "GPU-0123abc\u0663-4567-89ef-0123-456789abcdef"),
    ("path", "../GPU-0123abcd-4567-89ef-0123-456789abcdef"),
]


@pytest.mark.parametrize("text", GOOD_UUIDS)
def test_good_uuids(text: str) -> None:
    assert parse_gpu_uuid(text) == text


@pytest.mark.parametrize("text", [c[1] for c in BAD_UUIDS], ids=[c[0] for c in BAD_UUIDS])
def test_bad_uuids(text: str) -> None:
    with pytest.raises(InvalidRequest, match="GPU-xxxxxxxx") as caught:
        parse_gpu_uuid(text)
    assert caught.value.field == "uuid"


# --- query arguments -----------------------------------------------------------------------------


def q(**params: str | list[str] | bytes) -> dict[str, list[bytes]]:
    """Build a tornado-style ``query_arguments`` mapping."""
    result: dict[str, list[bytes]] = {}
    for name, value in params.items():
        values = value if isinstance(value, list) else [value]
        result[name] = [v if isinstance(v, bytes) else v.encode() for v in values]
    return result


VALID_QUERIES: list[tuple[str, dict[str, list[bytes]], object]] = [
    ("none", q(), None),
    ("other-params-ignored", q(force="true"), None),
    ("pod", q(pod="jhub/jupyter-a"), PodTarget("jhub", "jupyter-a")),
    ("pod-container", q(pod="jhub/a.b", container="nb"), PodTarget("jhub", "a.b", "nb")),
    ("pid", q(pid="4194303"), PidRef(4194303)),
    ("pid-small", q(pid="2"), PidRef(2)),
]


@pytest.mark.parametrize(
    ("query", "expected"), [c[1:] for c in VALID_QUERIES], ids=[c[0] for c in VALID_QUERIES]
)
def test_valid_target_queries(query: Mapping[str, Sequence[bytes]], expected: object) -> None:
    assert parse_target_query(query) == expected


INVALID_QUERIES: list[tuple[str, dict[str, list[bytes]], str, str]] = [
    ("both", q(pod="a/b", pid="5"), "pid", "not both"),
    ("pod-repeated", q(pod=["a/b", "a/c"]), "pod", "given 2 times"),
    ("pid-repeated", q(pid=["5", "5"]), "pid", "given 2 times"),
    ("container-repeated", q(pod="a/b", container=["x", "y"]), "container", "given 2 times"),
    ("container-alone", q(container="nb"), "container", "needs pod"),
    ("container-with-pid", q(pid="5", container="nb"), "container", "needs pod"),
    ("pod-no-slash", q(pod="jupyter-a"), "pod", "NAMESPACE/NAME"),
    ("pod-empty", q(pod=""), "pod", "NAMESPACE/NAME"),
    ("pod-two-slashes", q(pod="a/b/c"), "pod", "DNS-1123 subdomain"),
    ("pod-empty-namespace", q(pod="/b"), "pod", "namespace in query parameter pod"),
    ("pod-empty-name", q(pod="a/"), "pod", "pod name in query parameter pod"),
    ("pod-upper", q(pod="A/b"), "pod", "DNS-1123 label"),
    ("pod-long-name", q(pod="a/" + "p" * 254), "pod", "the limit is 253"),
    ("pod-not-ascii", q(pod="a/\u00e9".encode()), "pod", "ASCII"),
    ("container-bad", q(pod="a/b", container="Nb"), "container", "DNS-1123 label"),
    ("pid-empty", q(pid=""), "pid", "decimal digits"),
    ("pid-1", q(pid="1"), "pid", "init process"),
    ("pid-0", q(pid="0"), "pid", "decimal digits"),
    ("pid-leading-zero", q(pid="012"), "pid", "decimal digits"),
    ("pid-sign", q(pid="+5"), "pid", "decimal digits"),
    ("pid-negative", q(pid="-5"), "pid", "decimal digits"),
    ("pid-space", q(pid=" 5"), "pid", "decimal digits"),
    ("pid-hex", q(pid="0x10"), "pid", "decimal digits"),
    ("pid-too-big", q(pid="4194304"), "pid", "from 2 to 4194303"),
    ("pid-huge", q(pid="9" * 40), "pid", "decimal digits"),
    ("pid-unicode-digits", q(pid="\u0665".encode()), "pid", "ASCII"),
]


@pytest.mark.parametrize(
    ("query", "field", "message"),
    [c[1:] for c in INVALID_QUERIES],
    ids=[c[0] for c in INVALID_QUERIES],
)
def test_invalid_target_queries(
    query: Mapping[str, Sequence[bytes]], field: str, message: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_target_query(query)
    assert caught.value.field == field
    assert message in caught.value.message


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (q(), False),
        (q(force="true"), True),
        (q(force="1"), True),
        (q(force="false"), False),
        (q(force="0"), False),
    ],
    ids=["absent", "true", "1", "false", "0"],
)
def test_force(query: Mapping[str, Sequence[bytes]], expected: bool) -> None:
    assert parse_force(query) is expected


@pytest.mark.parametrize(
    "query",
    [
        q(force=""),
        q(force="True"),
        q(force="yes"),
        q(force="2"),
        q(force=["true", "true"]),
        q(force=b"\xff"),
    ],
    ids=["blank", "capital", "yes", "two", "repeated", "binary"],
)
def test_bad_force(query: Mapping[str, Sequence[bytes]]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_force(query)
    assert caught.value.field == "force"


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (q(), (False, False)),
        (q(keep="true"), (False, True)),
        (q(keep="0", force="1"), (True, False)),
    ],
    ids=["absent", "keep", "force"],
)
def test_detach_all_flags(
    query: Mapping[str, Sequence[bytes]], expected: tuple[bool, bool]
) -> None:
    assert parse_detach_all(query) == expected


@pytest.mark.parametrize(
    "query", [q(keep="yes"), q(keep="true", force="true")], ids=["bad", "with-force"]
)
def test_bad_keep(query: Mapping[str, Sequence[bytes]]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_detach_all(query)
    assert caught.value.field == "keep"


def test_unknown_query_names() -> None:
    check_query_names(q(pod="a/b", force="1"), allowed={"pod", "container", "pid", "force"})
    with pytest.raises(InvalidRequest, match="unknown query parameter") as caught:
        check_query_names(q(pod="a/b", froce="1"), allowed={"pod", "force"})
    assert caught.value.field == "froce"
    with pytest.raises(InvalidRequest, match="accepted: none"):
        check_query_names(q(x="1"), allowed=())


# --- nothing but InvalidRequest escapes -----------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
field_names = st.sampled_from(
    [
        "count",
        "target",
        "wait_seconds",
        "request_id",
        "pod",
        "pid",
        "namespace",
        "name",
        "container",
        "x",
    ]
)
# Objects made mostly of the right names reach the deeper checks, unlike random dictionaries.
near_requests = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-10, PID_MAX_LIMIT + 10)
    | st.floats()
    | st.text(alphabet="ab-.Z0/", max_size=8),
    lambda children: st.dictionaries(field_names, children, max_size=4),
    max_leaves=10,
)


def parses_or_refuses(raw: bytes) -> None:
    try:
        result = parse_attach_request(raw)
    except InvalidRequest as e:
        assert e.message
        json.dumps(e.to_body())
    else:
        assert result.count >= 1
        assert 0 < result.wait_seconds <= 600


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_arbitrary_bytes(raw: bytes) -> None:
    parses_or_refuses(raw)


@settings(max_examples=300)
@given(json_values)
def test_arbitrary_json(value: object) -> None:
    parses_or_refuses(json.dumps(value).encode())


@settings(max_examples=500)
@given(near_requests)
def test_near_requests(value: object) -> None:
    # allow_nan floats make json.dumps write NaN/Infinity, which must be refused too.
    parses_or_refuses(json.dumps(value).encode())


@settings(max_examples=300)
@given(
    st.dictionaries(
        st.sampled_from(["pod", "pid", "container", "force", "other"]),
        st.lists(
            st.binary(max_size=20) | st.text(alphabet="ab/-.019", max_size=12).map(str.encode),
            max_size=3,
        ),
        max_size=4,
    )
)
def test_arbitrary_queries(query: dict[str, list[bytes]]) -> None:
    for parse in (parse_target_query, parse_force):
        try:
            parse(query)
        except InvalidRequest as e:
            assert e.field in query


@given(st.text(max_size=60))
def test_arbitrary_uuids(text: str) -> None:
    try:
        assert parse_gpu_uuid(text) == text
    except InvalidRequest as e:
        assert e.field == "uuid"


labels = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
targets = (
    st.none()
    | st.builds(PidRef, st.integers(2, PID_MAX_LIMIT - 1))
    | st.builds(
        PodTarget,
        labels,
        st.lists(labels, min_size=1, max_size=3).map(".".join),
        st.none() | labels,
    )
)


@given(
    st.integers(1, MAX_COUNT),
    targets,
    st.floats(min_value=0, max_value=600, exclude_min=True),
    st.none() | st.from_regex(r"\A[A-Za-z0-9._:-]{1,128}\Z"),
)
def test_valid_requests_round_trip(
    count: int, target: PidRef | PodTarget | None, wait: float, request_id: str | None
) -> None:
    obj: dict[str, object] = {"count": count, "wait_seconds": wait}
    if target is not None:
        obj["target"] = target.to_wire()
    if request_id is not None:
        obj["request_id"] = request_id
    assert parse_attach_request(body(obj)) == AttachRequest(
        count,
        target,
        wait,
        None if request_id is None else RequestId(request_id),
        queued=True,
    )
