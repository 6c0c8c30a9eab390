"""``GET <base_url>/gpu-hotplug/api/version`` through a real jupyter_server."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import pytest
from tornado.httpclient import HTTPClientError, HTTPResponse

from jupyter_gpu_hotplug import __version__

Fetch = Callable[..., Awaitable[HTTPResponse]]


@pytest.mark.parametrize("jp_base_url", ["/", "/a%40b/", "/user/al%20ice/"])
async def test_version_is_served_under_any_base_url(jp_fetch: Fetch, jp_base_url: str) -> None:
    response = await jp_fetch("gpu-hotplug", "api", "version")

    assert response.code == 200
    assert response.headers["Content-Type"].startswith("application/json")
    assert json.loads(response.body) == {"version": __version__}


async def test_version_without_token_is_unauthenticated(jp_fetch: Fetch) -> None:
    with pytest.raises(HTTPClientError) as caught:
        await jp_fetch("gpu-hotplug", "api", "version", headers={"Authorization": ""})

    # tornado's decorator refuses with 403; the base handler answers what it is: 401, with
    # how to authenticate (RFC 9110; the extension's document says so).
    assert caught.value.code == 401
    assert caught.value.response is not None
    assert caught.value.response.headers["WWW-Authenticate"].startswith("token")


async def test_version_with_wrong_token_is_unauthenticated(jp_fetch: Fetch) -> None:
    with pytest.raises(HTTPClientError) as caught:
        await jp_fetch(
            "gpu-hotplug", "api", "version", headers={"Authorization": "token not-the-token"}
        )

    assert caught.value.code == 401
