#!/usr/bin/env bash
# Regenerates the committed Python code for the .proto files beside this script.
# Needs grpcio-tools; its version fixes the minimum grpcio/protobuf runtime that the
# generated code accepts, so raise the pins in pyproject.toml when you upgrade it:
#   pip install 'grpcio-tools==1.85.1' && ./generate.sh
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
for proto in *.proto; do
  grpc_out=()
  # Service stubs only where the proto declares a service (cri.proto has messages only).
  grep -q '^service ' "$proto" && grpc_out=(--grpc_python_out=.)
  "$python" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. "${grpc_out[@]}" "$proto"
done
# protoc writes `import x_pb2` (absolute); the package needs a relative import.
sed -i -E 's/^import ([a-z_]+_pb2) as /from . import \1 as /' ./*_pb2_grpc.py
