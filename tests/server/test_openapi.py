"""The server extension's OpenAPI document: valid, served as this server configures it, its
shared schemas the agent's own, and every 405 with ``Allow``. (That the server does what the
document says is the fuzz tier's schemathesis run, ``tests/fuzz/test_fuzz_server.py``.)"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from openapi_spec_validator import validate as validate_openapi
from tornado.httpclient import HTTPClientError, HTTPResponse
from traitlets.config import Config

from jupyter_gpu_hotplug.agent import openapi_document as agent_document
from jupyter_gpu_hotplug.server.openapi import openapi_document

Fetch = Callable[..., Awaitable[HTTPResponse]]
SHARED = ("GpuUuid", "Dns1123Label", "Dns1123Subdomain", "PodRef", "PodTarget", "PidTarget")
SHARED_TOO = ("Target", "Attachment", "IdleReason", "Suspended")


def _schemas(document: bytes) -> dict[str, Any]:
    schemas: dict[str, Any] = json.loads(document)["components"]["schemas"]
    return schemas


@pytest.mark.parametrize("mode", ["local", "kubernetes"])
def test_the_document_is_valid_openapi_in_either_mode(mode: Any) -> None:
    validate_openapi(json.loads(openapi_document(mode=mode, max_count=3)))


def test_the_served_document_states_this_servers_rules() -> None:
    local = _schemas(openapi_document(mode="local", max_count=3))
    cluster = _schemas(openapi_document(mode="kubernetes", max_count=5))

    assert local["AttachBody"]["properties"]["count"]["maximum"] == 3
    assert cluster["AttachBody"]["properties"]["count"]["maximum"] == 5
    for body in ("AttachBody", "DetachBody", "CancelBody"):
        assert "kernel_id" in local[body]["required"]
        assert "kernel_id" not in cluster[body]["required"]


def test_the_agents_shapes_are_the_agents() -> None:
    ours, agents = _schemas(openapi_document(mode="local", max_count=8)), _schemas(agent_document())
    for name in SHARED + SHARED_TOO:
        assert ours[name] == agents[name], name


@pytest.fixture
def jp_server_config(jp_server_config: Config) -> Config:
    jp_server_config.GPUHotplug.max_gpus_per_request = 2
    jp_server_config.GPUHotplug.mode = "local"
    return jp_server_config


async def test_the_server_serves_its_document(jp_fetch: Fetch) -> None:
    response = await jp_fetch("gpu-hotplug", "api", "openapi.json")

    assert response.code == 200
    served = _schemas(response.body)
    assert served["AttachBody"]["properties"]["count"]["maximum"] == 2
    assert "kernel_id" in served["AttachBody"]["required"]


@pytest.mark.parametrize("method", ["TRACE", "DELETE", "PUT"])
async def test_a_405_says_which_methods_are_allowed(jp_fetch: Fetch, method: str) -> None:
    with pytest.raises(HTTPClientError) as caught:
        await jp_fetch(
            "gpu-hotplug",
            "api",
            "version",
            method=method,
            body=None if method != "PUT" else b"{}",
            allow_nonstandard_methods=True,
        )

    assert caught.value.code == 405
    assert caught.value.response is not None
    allowed = {m.strip() for m in caught.value.response.headers["Allow"].split(",")}
    assert "GET" in allowed and method not in allowed
