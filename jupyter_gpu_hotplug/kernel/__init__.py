"""The kernel side: the ``%gpu`` magic, the GPU monitor widget, CUDA detection — code that
runs inside the user's kernel — and local mode's sandboxed kernel provisioner, which runs in
the Jupyter server and starts each kernel in its own container-like sandbox.

Kept apart from ``server`` because the in-kernel parts run in a different process, with
IPython rather than tornado, and must stay cheap to import: ``%load_ext jupyter_gpu_hotplug``
happens in every kernel that wants the magic.
"""

from __future__ import annotations
