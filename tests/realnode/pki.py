"""Certificates, keys and kubeconfigs of the real node, made with ``openssl``.

Why certificates at all: the real control plane authenticates every component by client
certificate (the scheduler, the controller manager and the kubelet are users
``system:kube-scheduler``, ``system:kube-controller-manager`` and ``system:node:<node>``), and
the Node authorizer and ``NodeRestriction`` only apply to a kubelet that is really
``system:node:<node>`` in group ``system:nodes``. One CA signs everything; keys are ECDSA P-256
(an RSA key costs about a second on a loaded 2-core machine, an EC key milliseconds) and
certificates are valid for a week (a node lives for one test session).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

_DAYS: Final = "7"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _new_key(path: Path, cwd: Path) -> None:
    _openssl(
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        str(path),
        cwd=cwd,
    )


@dataclass(frozen=True)
class Identity:
    """A client (or serving) certificate and its key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """Everything the components and the tests authenticate with."""

    directory: Path
    ca: Identity
    apiserver: Identity
    """The apiserver's serving certificate (127.0.0.1, localhost, the node name, kubernetes.*)."""
    apiserver_kubelet_client: Identity
    admin: Identity
    """``system:masters``: the tests' and the human operator's identity."""
    controller_manager: Identity
    scheduler: Identity
    node: Identity
    """``system:node:<node>`` in ``system:nodes``: the kubelet."""
    proxy: Identity
    """``system:kube-proxy``, bound to ``system:node-proxier`` by the default policy."""
    service_account_key: Path
    service_account_public: Path


def _sign(directory: Path, name: str, subject: str, san: str | None, ca: Identity) -> Identity:
    key, csr, cert, ext = (directory / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
    _new_key(key, directory)
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr), cwd=directory)
    lines = [
        "basicConstraints=CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        "extendedKeyUsage=serverAuth,clientAuth",
    ]
    if san:
        lines.append(f"subjectAltName={san}")
    ext.write_text("\n".join(lines) + "\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca.cert),
        "-CAkey",
        str(ca.key),
        "-CAcreateserial",
        "-days",
        _DAYS,
        "-extfile",
        str(ext),
        "-out",
        str(cert),
        cwd=directory,
    )
    csr.unlink()
    ext.unlink()
    return Identity(cert, key)


def make_pki(directory: Path, node_name: str, node_ip: str) -> Pki:
    """A fresh CA and every certificate the node needs, in ``directory`` (created, 0700)."""
    directory.mkdir(mode=0o700, parents=True)
    ca = Identity(directory / "ca.crt", directory / "ca.key")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        str(ca.key),
        "-out",
        str(ca.cert),
        "-days",
        _DAYS,
        "-subj",
        "/CN=jupyter-gpu-hotplug-node-ca",
        cwd=directory,
    )
    names = ",".join(
        f"DNS:{n}"
        for n in (
            "localhost",
            node_name,
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        )
    )
    sa_key, sa_pub = directory / "sa.key", directory / "sa.pub"
    _new_key(sa_key, directory)
    _openssl("pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub), cwd=directory)
    return Pki(
        directory=directory,
        ca=ca,
        apiserver=_sign(
            directory,
            "apiserver",
            "/CN=kube-apiserver",
            f"IP:127.0.0.1,IP:{node_ip},IP:10.96.0.1,{names}",
            ca,
        ),
        apiserver_kubelet_client=_sign(
            directory, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver", None, ca
        ),
        admin=_sign(directory, "admin", "/O=system:masters/CN=node-admin", None, ca),
        controller_manager=_sign(
            directory, "controller-manager", "/CN=system:kube-controller-manager", None, ca
        ),
        scheduler=_sign(directory, "scheduler", "/CN=system:kube-scheduler", None, ca),
        node=sign_node(directory, "node", node_name, node_ip, ca),
        proxy=_sign(directory, "proxy", "/CN=system:kube-proxy", None, ca),
        service_account_key=sa_key,
        service_account_public=sa_pub,
    )


def sign_node(directory: Path, name: str, node_name: str, node_ip: str, ca: Identity) -> Identity:
    """A kubelet's client certificate: ``system:node:<node_name>`` in ``system:nodes``, the
    identity the Node authorizer and ``NodeRestriction`` hold to its own node."""
    return _sign(
        directory,
        name,
        f"/O=system:nodes/CN=system:node:{node_name}",
        f"DNS:{node_name},IP:127.0.0.1,IP:{node_ip}",
        ca,
    )


def write_kubeconfig(path: Path, server: str, ca: Path, user: Identity | str) -> Path:
    """A kubeconfig for ``server`` as ``user`` (a client certificate, or a bearer token)."""
    credentials = (
        f"token: {user}"
        if isinstance(user, str)
        else f"client-certificate: {user.cert}\n    client-key: {user.key}"
    )
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: node
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: user
  user:
    {credentials}
contexts:
- name: node
  context: {{cluster: node, user: user}}
current-context: node
"""
    )
    path.chmod(0o600)
    return path
