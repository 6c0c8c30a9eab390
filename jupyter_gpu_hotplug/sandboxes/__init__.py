"""Local mode's sandboxed kernels: code that runs in the Jupyter server's process and touches
the host.

The kernel provisioner (``provisioner``) starts each Jupyter kernel in a container-like sandbox
of its own (``linux.sandbox.runtime``: a mount namespace with a private ``/dev``, device cgroups
that deny every GPU), and announces each sandbox (``events``) so that the server extension can tell
the agent which process a kernel's GPUs go to. It lives apart from ``kernel`` — the code that
runs *inside* the user's kernel, which must never touch host mechanics — because it runs in
another process, with other privileges.
"""

from __future__ import annotations
