"""The kernel side: the ``%gpu`` magic, the GPU monitor widget, CUDA detection — code that
runs inside the user's kernel.

Kept apart from ``server`` because it runs in a different process, with IPython rather than
tornado, and must stay cheap to import: ``%load_ext jupyter_gpu_hotplug`` happens in every
kernel that wants the magic. It never touches host mechanics (``linux``): the sandboxed kernel
provisioner, which does, runs in the Jupyter server and lives in ``sandboxes``.
"""

from __future__ import annotations
