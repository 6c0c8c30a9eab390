#!/usr/bin/env bash
# Download what the real-GPU tier needs on a GPU machine (tests/gpu/requirements.txt) as wheels
# for its Python (CPython 3.12, x86-64 Linux) into tests/gpu/wheelhouse/, which git ignores and
# the device tool carries along with the checkout (`carry: ["tests/gpu/wheelhouse"]`). Needs PyPI;
# run-on-device.sh then needs no network. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=${PYTHON:-.venv/bin/python}
wheelhouse=tests/gpu/wheelhouse
mkdir -p "$wheelhouse"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  --dest "$wheelhouse" --requirement tests/gpu/requirements.txt
echo "prepare: $(ls "$wheelhouse" | wc -l) wheels, $(du -sh "$wheelhouse" | cut -f1) in $wheelhouse"
