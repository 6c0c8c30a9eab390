"""Kubernetes backend of the node agent (DESIGN §3-§4, issue 16).

Implements the core's seams for a Kubernetes node: holder pods as the allocator's durable state,
the kubelet's PodResources API for which GPU a holder got, CRI ``ContainerStatus`` for the
target container's pid and cgroups, TokenReview/SubjectAccessReview for who the caller is.
The ``kubernetes`` and ``grpc`` libraries are imported only inside this package (import-linter),
and importing the package itself stays cheap: submodules are imported where they are used.
"""
