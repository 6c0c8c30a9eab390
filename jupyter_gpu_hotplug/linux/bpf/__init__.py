"""eBPF for cgroup v2 device control: a pure assembler (:mod:`.asm`) and the raw
``bpf(2)`` layer (:mod:`.syscall`), kept apart so the instruction layout is tested
without root and the system calls stay small.

Only :mod:`jupyter_gpu_hotplug.linux.cgroup_v2` is meant to combine the two.
"""
