"""Linux mechanics: device cgroups (v1 and v2/eBPF), mount namespaces, device nodes.

This layer knows nothing of Kubernetes or Jupyter. The node agent's injector and
local mode's kernel sandboxes are built on it; it is Linux-only by nature and
needs root (CAP_SYS_ADMIN, CAP_BPF, CAP_MKNOD) for anything that changes a host.
"""
