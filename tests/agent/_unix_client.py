"""Runs *inside* a test sandbox: one request to the agent's unix socket, without a token.

Usage: ``python -I -S _unix_client.py SOCKET METHOD PATH BODY OUTFILE`` (BODY ``-`` for none).
Writes ``{"status": N, "body": "..."}`` to OUTFILE, atomically (the test polls for it), and
nothing to stdout, which belongs to the sandbox probe's protocol. Standard library only.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=60)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.path)


def main() -> None:
    socket_path, method, path, body, outfile = sys.argv[1:6]
    connection = UnixConnection(socket_path)
    headers = {} if body == "-" else {"Content-Type": "application/json"}
    connection.request(method, path, body=None if body == "-" else body.encode(), headers=headers)
    response = connection.getresponse()
    result = {"status": response.status, "body": response.read().decode()}
    connection.close()
    with open(outfile + ".tmp", "w") as out:
        json.dump(result, out)
    os.replace(outfile + ".tmp", outfile)


if __name__ == "__main__":
    main()
