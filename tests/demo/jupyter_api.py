"""A test's view of a running Jupyter server: its REST API, and kernels driven over websockets.

Why the websocket and not ZMQ: the demo's kernels belong to the demo's server, in another
process; the only way a browser (or a test standing in for one) reaches them is the server's
``/api/kernels/<id>/channels`` websocket, speaking the Jupyter message protocol as JSON text
frames. Going that way tests what users use — authentication, the server's kernel manager, the
sandbox provisioner behind it — with nothing borrowed from the server's private runtime files.

Blocking code on purpose (``urllib``, ``websocket-client``, both dependencies of
jupyter_server): every step waits for the previous one, and a plain call stack is the clearest
way to read such a story.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

import websocket

_PROTOCOL_VERSION = "5.3"
READY_TIMEOUT = 60.0
EXECUTE_TIMEOUT = 120.0


@dataclass(frozen=True)
class Response:
    status: int
    text: str
    content_type: str

    @property
    def body(self) -> Any:
        """The decoded JSON body (``None`` for an empty one)."""
        return json.loads(self.text) if self.text.strip() else None


class JupyterServer:
    """The REST API of a server at ``base_url`` (``http://host:port``), with its token."""

    def __init__(self, base_url: str, token: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token

    def request(
        self, method: str, path: str, body: Any = None, *, timeout: float = 120.0
    ) -> Response:
        """One request; error statuses are returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.base_url}/{path.lstrip('/')}",
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                status, headers, raw = answer.status, answer.headers, answer.read()
        except urllib.error.HTTPError as error:
            status, headers, raw = error.code, error.headers, error.read()
        return Response(status, raw.decode(errors="replace"), headers.get("Content-Type", ""))

    def start_kernel(self, name: str = "python3") -> str:
        answer = self.request("POST", "api/kernels", {"name": name})
        assert answer.status == 201, answer
        kernel_id: str = answer.body["id"]
        return kernel_id

    def start_session(self, path: str, name: str = "python3") -> str:
        """Open the notebook at ``path`` as a browser tab does (a session); its kernel's id."""
        answer = self.request(
            "POST",
            "api/sessions",
            {"path": path, "name": path, "type": "notebook", "kernel": {"name": name}},
        )
        assert answer.status == 201, answer
        kernel_id: str = answer.body["kernel"]["id"]
        return kernel_id

    def restart_kernel(self, kernel_id: str) -> None:
        answer = self.request("POST", f"api/kernels/{kernel_id}/restart")
        assert answer.status == 200, answer

    def shutdown_kernel(self, kernel_id: str) -> None:
        answer = self.request("DELETE", f"api/kernels/{kernel_id}")
        assert answer.status in (204, 404), answer

    def kernel_ids(self) -> list[str]:
        answer = self.request("GET", "api/kernels")
        assert answer.status == 200, answer
        return [kernel["id"] for kernel in answer.body]

    def connect(self, kernel_id: str) -> KernelSession:
        """A websocket session with the kernel, once the kernel answers."""
        ws_url = "ws" + self.base_url.removeprefix("http") + f"/api/kernels/{kernel_id}/channels"
        connection = websocket.create_connection(
            ws_url, header=[f"Authorization: token {self.token}"], timeout=READY_TIMEOUT
        )
        session = KernelSession(connection)
        try:
            session.wait_ready()
        except BaseException:
            session.close()
            raise
        return session


@dataclass
class Execution:
    """What one ``execute_request`` produced."""

    status: str = ""
    """``ok`` or ``error``, from the ``execute_reply``."""
    stdout: str = ""
    stderr: str = ""
    results: list[str] = field(default_factory=list)
    """``text/plain`` of ``execute_result`` and ``display_data`` messages, in order."""
    error: str | None = None
    """``ename: evalue`` and the traceback, when the code raised."""

    @property
    def output(self) -> str:
        return "\n".join([self.stdout, self.stderr, *self.results, self.error or ""])

    def json(self) -> Any:
        """The last line printed, as JSON (the probes below print one)."""
        return json.loads(self.stdout.strip().splitlines()[-1])


class KernelSession:
    """One kernel's channels over one websocket (legacy JSON-frame protocol)."""

    def __init__(self, connection: websocket.WebSocket) -> None:
        self._ws = connection
        self._session = uuid.uuid4().hex

    def close(self) -> None:
        self._ws.close()

    def __enter__(self) -> KernelSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _send(self, msg_type: str, content: dict[str, Any], channel: str = "shell") -> str:
        msg_id = uuid.uuid4().hex
        header = {
            "msg_id": msg_id,
            "msg_type": msg_type,
            "session": self._session,
            "username": "test",
            "date": "",
            "version": _PROTOCOL_VERSION,
        }
        message = {
            "header": header,
            "parent_header": {},
            "metadata": {},
            "content": content,
            "channel": channel,
            "buffers": [],
        }
        self._ws.send(json.dumps(message))
        return msg_id

    def _replies(self, msg_id: str, deadline: float) -> Any:
        """Messages answering ``msg_id`` until ``deadline`` (binary frames are skipped)."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no complete answer to {msg_id} in time")
            self._ws.settimeout(remaining)
            frame = self._ws.recv()
            if not isinstance(frame, str):
                continue  # Messages with binary buffers (widget state); none of ours.
            message = json.loads(frame)
            if message.get("parent_header", {}).get("msg_id") == msg_id:
                yield message

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until the kernel answers a ``kernel_info_request`` (it may still be starting)."""
        deadline = time.monotonic() + timeout
        while True:
            msg_id = self._send("kernel_info_request", {})
            try:
                for message in self._replies(msg_id, min(deadline, time.monotonic() + 2.0)):
                    if message["msg_type"] == "kernel_info_reply":
                        return
            except (TimeoutError, websocket.WebSocketTimeoutException):
                if time.monotonic() > deadline:
                    raise

    def execute(self, code: str, *, timeout: float = EXECUTE_TIMEOUT) -> Execution:
        """Run ``code``; returns when the reply and the kernel's ``idle`` status are in."""
        msg_id = self._send(
            "execute_request",
            {
                "code": code,
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": True,
            },
        )
        result = Execution()
        replied = idle = False
        for message in self._replies(msg_id, time.monotonic() + timeout):
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                if content["name"] == "stdout":
                    result.stdout += content["text"]
                else:
                    result.stderr += content["text"]
            elif kind in ("execute_result", "display_data", "update_display_data"):
                result.results.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                result.error = f"{content['ename']}: {content['evalue']}\n" + "\n".join(
                    content["traceback"]
                )
            elif kind == "execute_reply":
                result.status, replied = content["status"], True
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
            if replied and idle:
                return result
        raise AssertionError("unreachable: _replies ends by raising")

    def run(self, code: str, *, timeout: float = EXECUTE_TIMEOUT) -> Execution:
        """``execute`` that must succeed; the failure message shows everything the cell said."""
        result = self.execute(code, timeout=timeout)
        assert result.status == "ok", f"cell failed:\n{code}\n---\n{result.output}"
        return result
