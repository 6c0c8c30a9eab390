"""Linux mechanics: device cgroups (v1 and v2/eBPF), mount namespaces, device nodes.

This layer knows nothing of Kubernetes or Jupyter. It holds two products on shared mechanics:

- the **hot-plug device engine** (:mod:`.engine` and what it drives: :mod:`.device_controllers`,
  :mod:`.systemd_units`, :mod:`.busy`, :mod:`.mig`, :mod:`.cdi_spec`, :mod:`.driver_edits`,
  :mod:`.bindmounts`, :mod:`.journal`), which the node agent's injector uses;
- the **sandbox runtime** (:mod:`.sandbox`), local mode's mini container runtime for kernels.

Both stand on the shared mechanics: the device policy model (:mod:`.devrules`), cgroup
discovery (:mod:`.cgroups`), the v1 allow list (:mod:`.cgroup_v1`), the v2 eBPF device programs
(:mod:`.cgroup_v2`, :mod:`.bpf`), device nodes (:mod:`.devnodes`), :mod:`.procfs` and
:mod:`._sys`. Neither product imports the other (import-linter). It is Linux-only by nature
and needs root (CAP_SYS_ADMIN, CAP_BPF, CAP_MKNOD) for anything that changes a host.
"""
