"""A fake Kubernetes API server, faithful on the wire for what the agent and the kubelet
simulator use; see ``server.py`` for the entry point and ``tests/k8s/README.md`` for the API."""
