# The node agent's image (k8s/base/daemonset.yaml runs it):
#   docker build -t registry.example.org/gpu-hotplug-agent:0.1.0 .
# Stage 1 builds the wheel (the JupyterLab extension inside it needs Node.js) as an
# unprivileged user; stage 2 installs only that wheel on a slim Python.
#
# The agent itself runs as root, in a privileged pod with the host's pid namespace: it writes
# other containers' device cgroups and creates device nodes inside their mount namespaces, which
# no capability set short of that allows (docs/operator-guide.md, "Why privileged").

FROM node:20-bookworm-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
USER node
WORKDIR /home/node/src
COPY --chown=node:node . .
RUN python3 -m venv /home/node/venv \
 && /home/node/venv/bin/pip install --no-cache-dir "build>=1.2" \
 && /home/node/venv/bin/python -m build --wheel --outdir /home/node/dist .

FROM python:3.11-slim-bookworm
COPY --from=build /home/node/dist/ /tmp/dist/
RUN pip install --no-cache-dir /tmp/dist/*.whl && rm -rf /tmp/dist
# Root on purpose (see above); the pod's securityContext makes it privileged.
USER 0
ENTRYPOINT ["jupyter-gpu-hotplug", "agent"]
CMD ["--help"]
