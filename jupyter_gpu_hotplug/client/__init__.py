"""The notebook side's one way to talk to the node agent (DESIGN §3, §6).

Every frontend (server extension, ``%gpu`` magic, widget, command line) uses
``AgentClient`` (blocking) or ``AsyncAgentClient`` (asyncio); both offer the same methods,
return the same frozen values (``Gpu``, ``Attachment``, ``Health``) and raise only
``AgentClientError`` subclasses, whose ``message`` is written for the person at the notebook.

Boundary: this package never imports the agent (``jupyter_gpu_hotplug.agent``); it shares only
the wire shapes in ``_structs`` and the contract in ``agent/openapi.json``, against which its
tests check the answers they serve. Layout: ``_http`` (HTTP/1.1 framing, no I/O), ``_core``
(calls, retries, token; no I/O but the token file), ``_sync`` and ``_async`` (transports),
``models`` and ``errors``.

Typical use::

    client = AgentClient.from_environment()      # GPU_HOTPLUG_AGENT_URL, GPU_HOTPLUG_TOKEN_PATH
    try:
        attached = client.attach(1)
    except AgentClientError as error:
        print(error.message)
"""

from __future__ import annotations

from ._async import AsyncAgentClient
from ._core import (
    AGENT_URL_ENV,
    DEFAULT_AGENT_URL,
    DEFAULT_WAIT_SECONDS,
    TOKEN_PATH_ENV,
    AnyTarget,
    BaseAgentClient,
    RetryPolicy,
    Timeouts,
)
from ._sync import AgentClient
from .errors import (
    AgentClientError,
    AgentConnectionLost,
    AgentError,
    AgentInternalError,
    AgentProtocolError,
    AgentTimeout,
    AgentUnavailable,
    Busy,
    BusyProcess,
    ClientConfigError,
    Forbidden,
    InsufficientGpus,
    InvalidRequest,
    NotFound,
    TargetNotReady,
    Unauthenticated,
)
from .models import (
    Attachment,
    AttachmentState,
    Gpu,
    Health,
    IdleNotice,
    IdleRelease,
    LostHolderNotice,
    QueuedRequest,
    Suspension,
    plain_free,
    plain_total,
)
from .selection import is_index, normalise_selector, select_gpus

__all__ = [
    "AGENT_URL_ENV",
    "DEFAULT_AGENT_URL",
    "DEFAULT_WAIT_SECONDS",
    "TOKEN_PATH_ENV",
    "AgentClient",
    "AgentClientError",
    "AgentConnectionLost",
    "AgentError",
    "AgentInternalError",
    "AgentProtocolError",
    "AgentTimeout",
    "AgentUnavailable",
    "AnyTarget",
    "AsyncAgentClient",
    "Attachment",
    "AttachmentState",
    "BaseAgentClient",
    "Busy",
    "BusyProcess",
    "ClientConfigError",
    "Forbidden",
    "Gpu",
    "Health",
    "IdleNotice",
    "IdleRelease",
    "InsufficientGpus",
    "InvalidRequest",
    "LostHolderNotice",
    "NotFound",
    "QueuedRequest",
    "RetryPolicy",
    "Suspension",
    "TargetNotReady",
    "Timeouts",
    "Unauthenticated",
    "is_index",
    "normalise_selector",
    "plain_free",
    "plain_total",
    "select_gpus",
]
