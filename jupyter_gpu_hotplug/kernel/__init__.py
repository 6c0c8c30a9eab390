"""Code that runs inside the user's kernel: the ``%gpu`` magic (and, later, the GPU monitor).

Kept apart from ``server`` because it runs in a different process, with IPython rather than
tornado, and must stay cheap to import: ``%load_ext jupyter_gpu_hotplug`` happens in every
kernel that wants the magic.
"""

from __future__ import annotations
