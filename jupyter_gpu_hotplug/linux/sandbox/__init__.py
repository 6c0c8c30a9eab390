"""The sandbox runtime: local mode's mini container runtime for sandboxed kernels.

A product of its own beside the hot-plug device engine (the rest of :mod:`..linux`): it
creates container-like sandboxes (:mod:`.runtime`) whose in-sandbox half (:mod:`._init`) builds
the mount namespace and ``/dev`` and execs the workload. Both products stand on the shared
mechanics of :mod:`..linux` (cgroups, the v1 allow list, the v2 eBPF programs, device nodes,
procfs); neither imports the other (an import-linter contract), so the engine hot-plugs into a
sandbox exactly as into a runc or containerd container, knowing nothing of how it was made.
"""
