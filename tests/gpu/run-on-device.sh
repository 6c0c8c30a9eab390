#!/usr/bin/env bash
# The real-GPU tier in one command, on a GPU machine with nothing fetched there:
#
#   bash tests/gpu/run-on-device.sh              # real NVIDIA GPUs (root, the driver)
#   bash tests/gpu/run-on-device.sh --simulate   # the rehearsal: the same steps, 2 simulated GPUs
#
# It installs the wheels of tests/gpu/wheelhouse/ (made here by tests/gpu/prepare.sh and carried
# along with the checkout) into a folder of its own with pip --no-index --target, runs
# `pytest tests/gpu` with the machine's python3 (GPU_PYTHON to choose another), and writes
# real-gpu.md (commands, outputs, figures, a verdict per step), its raw record, the agent's log,
# pytest's JUnit report and this script's log into $OUT (default ./gpu-out). Never changes the
# machine's GPU settings. On a host where no cgroup hierarchy can be written it mounts cgroup2 in
# a private mount namespace of its own (gone with it). Exit status: pytest's.
set -uo pipefail
script=$(readlink -f "$0")
cd "$(dirname "$script")/../.."

simulate=0
case "${1:-}" in
  --simulate) simulate=${2:-2} ;;
  "") ;;
  *) echo "usage: $0 [--simulate [N]]" >&2; exit 2 ;;
esac
out=${OUT:-$PWD/gpu-out}
python=${GPU_PYTHON:-python3}
limit=${JGH_GPU_TIME_LIMIT:-300}
mkdir -p "$out"
started=$SECONDS
say() { echo "run-on-device [$((SECONDS - started)) s] $*"; }

if [ "${JGH_GPU_INNER:-0}" != 1 ]; then
  exec > >(tee -a "$out/run.log") 2>&1
fi

# The sandboxes need a cgroup hierarchy this root can write (v1 devices or cgroup2).
can_write_cgroups() {
  PYTHONPATH=$PWD "$python" -c 'import sys
from tests.fixtures.requirements import has_root_and_cgroups
sys.exit(0 if has_root_and_cgroups() else 1)'
}
if [ "${JGH_GPU_INNER:-0}" != 1 ] && ! can_write_cgroups; then
  say "no writable cgroup hierarchy: mounting cgroup2 in a private mount namespace"
  JGH_GPU_INNER=1 exec unshare --mount --propagation private -- \
    sh -c 'mount -t cgroup2 cgroup2 /sys/fs/cgroup && exec "$@"' sh bash "$script" "$@"
fi

say "python: $("$python" --version 2>&1) at $(command -v "$python")"
wheels=(tests/gpu/wheelhouse/*.whl)
if [ ! -e "${wheels[0]}" ]; then
  say "no wheels in tests/gpu/wheelhouse: run tests/gpu/prepare.sh where PyPI is reachable" >&2
  exit 3
fi
site=$(mktemp -d /tmp/jgh-gpu-site.XXXXXX)
trap 'rm -rf "$site"' EXIT
if "$python" -m pip --version >/dev/null 2>&1; then
  "$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
    --target "$site" "${wheels[@]}" || exit 3
else
  # No pip: a wheel is a zip whose top level is importable as it is.
  "$python" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
    "$site" "${wheels[@]}" || exit 3
fi
say "installed ${#wheels[@]} wheels ($(du -sh "$site" | cut -f1)) into $site"
export PYTHONPATH="$site:$PWD"
export JGH_GPU_OUT="$out"
if [ "$simulate" != 0 ]; then
  export JGH_GPU_SIMULATE="$simulate"
  say "REHEARSAL: $simulate simulated GPUs (fake NVML, SIMULATED nvidia-smi)"
fi

say "running the tier (at most $limit s)"
timeout --signal=INT --kill-after=20 "$limit" "$python" -m pytest -c tests/gpu/pytest.ini \
  --rootdir=. tests/gpu -v --junitxml="$out/junit.xml"
status=$?
say "pytest exited $status; the report is $out/real-gpu.md"
exit "$status"
