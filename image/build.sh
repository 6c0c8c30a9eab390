#!/usr/bin/env bash
# Build the node agent's image from this source tree, with no registry:
#
#   bash image/build.sh [--tag TAG] [--save ARCHIVE] [--sbom FILE]
#
# 1. the base: Debian (the suite below) made by mmdebstrap from the host's apt mirror, python3
#    and python3-venv only, docs and locales left out; the tarball is cached under
#    $JGH_IMAGE_CACHE (default ~/.cache/jupyter-gpu-hotplug/image) and `podman import`ed;
# 2. the wheel of this tree (python -m build, which builds the JupyterLab extension) and the
#    wheels pinned by image/requirements.lock (the agent's runtime only: no notebook-side
#    packages), every file checked against the lock's hashes, chosen by pip for the base's own
#    Python (its exact version, read from the base's dpkg status) and platform;
# 3. `podman build` of image/Containerfile over those wheels, with no network;
# 4. with --save, an OCI archive of the image (for `ctr images import` on a node);
# 5. the SBOM (CycloneDX JSON, image/sbom.py): the base's Debian packages and every wheel
#    installed, with its SHA-256; written to --sbom FILE (default: ARCHIVE.cdx.json with --save,
#    else $JGH_IMAGE_CACHE/jupyter-gpu-hotplug-agent-<version>.cdx.json).
#
# PODMAN (default: podman) may carry storage options, e.g. "podman --root /tmp/x --runroot /tmp/y".
# PYTHON (default: python3) builds the wheels. Prints the image's tag on its last line.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
suite=bookworm
python=${PYTHON:-python3}
read -r -a podman <<<"${PODMAN:-podman}"
cache=${JGH_IMAGE_CACHE:-$HOME/.cache/jupyter-gpu-hotplug/image}
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/jupyter_gpu_hotplug/_version.py")
tag=localhost/jupyter-gpu-hotplug-agent:$version
save=""
sbom=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag=$2; shift 2 ;;
    --save) save=$2; shift 2 ;;
    --sbom) sbom=$2; shift 2 ;;
    *) echo "usage: $0 [--tag TAG] [--save ARCHIVE] [--sbom FILE]" >&2; exit 2 ;;
  esac
done
if [ -z "$sbom" ]; then
  if [ -n "$save" ]; then sbom=$save.cdx.json; else sbom=$cache/jupyter-gpu-hotplug-agent-$version.cdx.json; fi
fi

log() { echo "[image $(date +%T)] $*" >&2; }

# The base is cached under a key of what it is made of: the suite, the package list, the date of
# the suite's Release on the mirror as the host's apt lists last saw it (a point release
# changes it) and the versions apt would install of the packages asked for. A Debian update
# therefore makes a new base instead of reusing an old one under the same name; where the host
# has no apt lists (never `apt-get update`d) the key says "unknown" for what it cannot read.
packages=python3,python3-venv
base_key() {
  local release date versions
  release=$(ls /var/lib/apt/lists/*_dists_"$suite"_InRelease 2>/dev/null | head -n 1 || true)
  date=$( [ -n "$release" ] && sed -n 's/^Date: //p' "$release" | head -n 1 || true)
  versions=$(apt-cache show --no-all-versions ${packages//,/ } 2>/dev/null |
    sed -n 's/^Package: //p; s/^Version: //p' | paste -sd' ' || true)
  printf '%s\n' "$suite" "$packages" "${date:-unknown}" "${versions:-unknown}"
}
base_id=$(base_key | sha256sum | cut -c1-12)
base_tar=$cache/debian-$suite-${packages//,/-}-$base_id.tar
base=localhost/jupyter-gpu-hotplug/debian-python:$suite-$base_id
if [ ! -f "$base_tar" ] || [ ! -s "$base_tar" ]; then
  command -v mmdebstrap >/dev/null || { echo "image/build.sh: apt-get install mmdebstrap" >&2; exit 1; }
  log "base: mmdebstrap $suite ($packages; $(base_key | tail -n 2 | paste -sd' '))"
  mkdir -p "$cache"
  # What an interrupted build left, and bases of older keys (nothing reads them any more).
  rm -rf "$base_tar" "$base_tar.partial" "$cache/debian-$suite-${packages//,/-}".tar \
    "$cache/debian-$suite-${packages//,/-}"-*.tar
  # --format: mmdebstrap otherwise picks the format from the file's name, and `.partial` is
  # none it knows — it would write a directory.
  nice mmdebstrap --quiet --format=tar --variant=minbase --include="$packages" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$suite" "$base_tar.partial"
  mv "$base_tar.partial" "$base_tar"
fi
if ! "${podman[@]}" image exists "$base"; then
  log "base: podman import $base_tar"
  "${podman[@]}" import --quiet --change 'CMD ["/bin/bash"]' "$base_tar" "$base" >/dev/null
fi

# The base's Python, e.g. 3.11.2 (from the Debian version 3.11.2-6+deb12u9).
# awk reads to the end: an early exit would kill tar with SIGPIPE, and pipefail would stop
# the build there without a word.
base_python=$(tar -xOf "$base_tar" ./var/lib/dpkg/status |
  awk '/^Package: python3\.[0-9]+-minimal$/ { found = 1 } found && !done && /^Version:/ { print $2; done = 1 }')
base_python=${base_python%%-*}
base_abi=cp$(echo "$base_python" | cut -d. -f1,2 | tr -d .)

work=$(mktemp -d /tmp/jgh-image.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir "$work/wheels"
log "wheel: python -m build"
nice "$python" -m build --wheel --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 || {
  cat "$work/build.log" >&2
  exit 1
}
wheel=$(ls "$work"/dist/jupyter_gpu_hotplug-*.whl)
cp "$wheel" "$work/wheels/"
log "wheels of image/requirements.lock (hashes checked), for Python $base_python ($base_abi)"
cp "$here/requirements.lock" "$work/wheels/"
nice "$python" -m pip download --quiet --dest "$work/wheels" --only-binary=:all: \
  --require-hashes --no-deps \
  --python-version "$base_python" --implementation cp --abi "$base_abi" --abi abi3 --abi none \
  --platform manylinux_2_36_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -r "$here/requirements.lock"
log "podman build $tag"
"${podman[@]}" build --quiet --network none --build-arg "BASE=$base" \
  -f "$here/Containerfile" -t "$tag" "$work" >/dev/null
if [ -n "$save" ]; then
  log "saving $save"
  rm -f "$save"
  "${podman[@]}" save --format oci-archive -o "$save" "$tag"
fi
log "SBOM $sbom"
mkdir -p "$(dirname "$sbom")"
tar -xOf "$base_tar" ./var/lib/dpkg/status >"$work/dpkg-status"
"$python" "$here/sbom.py" --image "$tag" --wheels "$work/wheels" --dpkg-status "$work/dpkg-status" \
  --out "$sbom"
echo "$tag"
