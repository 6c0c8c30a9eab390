"""``jupyter gpu-hotplug demo``: the whole product on one Linux machine, in one command.

Why it exists: the README's first command must show GPUs being hot-plugged into a *running*
kernel without a cluster. The demo starts a local-mode node agent (real NVIDIA GPUs when NVML
finds some, otherwise clearly labelled simulated ones) and a JupyterLab whose kernels each run
in a container-like sandbox, wires the two together, and takes everything down again on
Ctrl-C, releasing every GPU. On a workstation with GPUs this is a real mode: per-kernel GPU
isolation and hot-plug on a shared machine.

Layout, one job per module: ``options`` (what the user asked for; light, for ``--help``),
``command`` (the subcommand's arguments), ``preflight`` (refuse early and say why: not Linux,
not root, busy port), ``gpus`` (are there real GPUs?), ``layout`` (the demo directory and the
starter notebook), ``labconfig`` (JupyterLab's configuration), ``children`` (one supervised
child process), ``runner`` (start, supervise, stop). Heavy imports stay out of ``options`` and
``command`` so that ``jupyter gpu-hotplug --help`` stays instant.
"""

from __future__ import annotations
