#!/usr/bin/env bash
# Build one of the project's images from this source tree, with no registry:
#
#   bash image/build.sh [--image agent|notebook|hub] [--tag TAG] [--save ARCHIVE] [--sbom FILE]
#                       [--wheel WHEEL]
#
#   agent     the node agent (image/Containerfile)          localhost/jupyter-gpu-hotplug-agent:<version>
#   notebook  a user's notebook server for JupyterHub       localhost/jupyter-gpu-hotplug-notebook:<version>
#             (image/notebook/): JupyterLab, jupyterhub-singleuser, the extension enabled, no NVIDIA
#             files (the node's agent brings the driver's at attach)
#   hub       JupyterHub with KubeSpawner and configurable-http-proxy (image/hub/)
#                                                           localhost/jupyter-gpu-hotplug-hub:<version>
#
# 1. the base: Debian (the suite below) made by mmdebstrap from the host's apt mirror, python3
#    and python3-venv (and, for the hub, nodejs) only, docs and locales left out; the tarball
#    is cached under $JGH_IMAGE_CACHE (default ~/.cache/jupyter-gpu-hotplug/image) and
#    `podman import`ed;
# 2. the wheel of this tree (python -m build, which builds the JupyterLab extension; --wheel
#    gives one already built from this tree, as the tests do to build it once for every image)
#    and the wheels pinned by the image's requirements.lock, every file checked against the lock's
#    hashes, chosen by pip for the base's own Python (its exact version, read from the base's
#    dpkg status) and platform; they are kept under $JGH_IMAGE_CACHE in a directory named by
#    the lock's hash, so an unchanged lock downloads nothing;
#    for the hub, configurable-http-proxy from image/hub/package-lock.json (`npm ci`, cached
#    the same way);
# 3. `podman build` of the image's Containerfile with no network; each Containerfile installs
#    the locked wheels in a layer of their own before it adds this tree's wheel, so that podman
#    storage kept between builds (PODMAN below) rebuilds only the layer of this tree's wheel
#    while the lock stays the same;
# 4. with --save, an OCI archive of the image (for `ctr images import` on a node);
# 5. the SBOM (CycloneDX JSON, image/sbom.py): the base's Debian packages, every wheel
#    installed, with its SHA-256, and the hub's npm packages, with their integrity hashes; written to --sbom FILE (default: ARCHIVE.cdx.json with --save,
#    else $JGH_IMAGE_CACHE/jupyter-gpu-hotplug-<image>-<version>.cdx.json).
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
usage="usage: $0 [--image agent|notebook|hub] [--tag TAG] [--save ARCHIVE] [--sbom FILE] [--wheel WHEEL]"
image=agent
tag=""
save=""
sbom=""
wheel=""
while [ $# -gt 0 ]; do
  case "$1" in
    --image) image=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --save) save=$2; shift 2 ;;
    --sbom) sbom=$2; shift 2 ;;
    --wheel) wheel=$2; shift 2 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
# Each image: its directory (Containerfile, requirements.in/.lock) and the Debian packages of
# its base.
case "$image" in
  agent) dir=$here; packages=python3,python3-venv ;;
  notebook) dir=$here/notebook; packages=python3,python3-venv ;;
  hub) dir=$here/hub; packages=python3,python3-venv,nodejs ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
tag=${tag:-localhost/jupyter-gpu-hotplug-$image:$version}
if [ -z "$sbom" ]; then
  if [ -n "$save" ]; then sbom=$save.cdx.json; else sbom=$cache/jupyter-gpu-hotplug-$image-$version.cdx.json; fi
fi

log() { echo "[image $(date +%T)] $*" >&2; }

# The name of a file's content in the cache: its SHA-256's first 12 digits, read from stdin.
short_hash() { sha256sum | cut -c1-12; }

# The base is cached under a key of what it is made of: the suite, the package list, the date of
# the suite's Release on the mirror as the host's apt lists last saw it (a point release
# changes it) and the versions apt would install of the packages asked for. A Debian update
# therefore makes a new base instead of reusing an old one under the same name; where the host
# has no apt lists (never `apt-get update`d) the key says "unknown" for what it cannot read.
base_key() {
  local release date versions
  release=$(ls /var/lib/apt/lists/*_dists_"$suite"_InRelease 2>/dev/null | head -n 1 || true)
  date=$( [ -n "$release" ] && sed -n 's/^Date: //p' "$release" | head -n 1 || true)
  versions=$(apt-cache show --no-all-versions ${packages//,/ } 2>/dev/null |
    sed -n 's/^Package: //p; s/^Version: //p' | paste -sd' ' || true)
  printf '%s\n' "$suite" "$packages" "${date:-unknown}" "${versions:-unknown}"
}

# Make (or reuse) the base tarball of $packages and import it; sets base_tar and base.
make_base() {
  local base_id
  base_id=$(base_key | short_hash)
  base_tar=$cache/debian-$suite-${packages//,/-}-$base_id.tar
  base=localhost/jupyter-gpu-hotplug/debian-${packages//,/-}:$suite-$base_id
  if [ ! -f "$base_tar" ] || [ ! -s "$base_tar" ]; then
    command -v mmdebstrap >/dev/null || { echo "image/build.sh: apt-get install mmdebstrap" >&2; exit 1; }
    log "base: mmdebstrap $suite ($packages; $(base_key | tail -n 2 | paste -sd' '))"
    mkdir -p "$cache"
    # What an interrupted build left, and bases of older keys (nothing reads them any more).
    rm -rf "$base_tar" "$base_tar.partial" "$cache/debian-$suite-${packages//,/-}".tar \
      "$cache/debian-$suite-${packages//,/-}"-????????????.tar
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
}

# The locked wheels for the base's Python ($1, e.g. 3.11.2) into the build context's deps/
# (with the lock), from a cache directory named by the lock and that Python: pip downloads
# (hashes checked) only where that directory is not complete yet.
locked_wheels() {
  local base_python=$1 abi wheels
  abi=cp$(echo "$base_python" | cut -d. -f1,2 | tr -d .)
  wheels=$cache/wheels/$image-$( (cat "$dir/requirements.lock"; echo "$base_python") | short_hash)
  if [ ! -f "$wheels/.complete" ]; then
    log "wheels of ${dir#"$repo"/}/requirements.lock (hashes checked), for Python $base_python ($abi)"
    rm -rf "$wheels" "$cache/wheels/$image"-*
    mkdir -p "$wheels"
    nice "$python" -m pip download --quiet --dest "$wheels" --only-binary=:all: \
      --require-hashes --no-deps \
      --python-version "$base_python" --implementation cp --abi "$abi" --abi abi3 --abi none \
      --platform manylinux_2_36_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
      -r "$dir/requirements.lock"
    touch "$wheels/.complete"
  else
    log "wheels of ${dir#"$repo"/}/requirements.lock: cached in $wheels"
  fi
  mkdir "$work/deps"
  cp "$dir/requirements.lock" "$work/deps/"
  # Hard links where the cache shares the context's file system; copies elsewhere.
  cp --link "$wheels"/*.whl "$work/deps/" 2>/dev/null || cp "$wheels"/*.whl "$work/deps/"
}

# configurable-http-proxy and its modules, as image/hub/package-lock.json pins them (npm checks
# each package's integrity), into the build context's chp/; `npm ci` runs only where the
# cache has no tree for this lock yet, and runs no package's scripts.
proxy_modules() {
  local modules
  modules=$cache/chp/$(cat "$dir/package.json" "$dir/package-lock.json" | short_hash)
  if [ ! -f "$modules/.complete" ]; then
    command -v npm >/dev/null || { echo "image/build.sh: apt-get install npm" >&2; exit 1; }
    log "configurable-http-proxy: npm ci of ${dir#"$repo"/}/package-lock.json"
    rm -rf "$cache/chp"
    mkdir -p "$modules"
    cp "$dir/package.json" "$dir/package-lock.json" "$modules/"
    (cd "$modules" && nice npm ci --omit=dev --ignore-scripts --no-audit --no-fund \
      --cache "$cache/npm" --loglevel=warn >&2)
    touch "$modules/.complete"
  fi
  cp -a "$modules" "$work/chp"
  rm "$work/chp/.complete"
}

make_base

# The base's Python, e.g. 3.11.2 (from the Debian version 3.11.2-6+deb12u9).
# awk reads to the end: an early exit would kill tar with SIGPIPE, and pipefail would stop
# the build there without a word.
base_python=$(tar -xOf "$base_tar" ./var/lib/dpkg/status |
  awk '/^Package: python3\.[0-9]+-minimal$/ { found = 1 } found && !done && /^Version:/ { print $2; done = 1 }')
base_python=${base_python%%-*}

# Under the cache, so that the cached wheels are hard-linked into the build context.
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
work=$tmp/context
mkdir "$work"
if [ -n "$wheel" ]; then
  mkdir "$work/wheel"
  cp "$wheel" "$work/wheel/"
else
  log "wheel: python -m build"
  nice "$python" -m build --wheel --outdir "$work/wheel" "$repo" >"$tmp/build.log" 2>&1 || {
    cat "$tmp/build.log" >&2
    exit 1
  }
fi
locked_wheels "$base_python"
if [ "$image" = hub ]; then proxy_modules; fi
log "podman build $tag"
"${podman[@]}" build --quiet --layers --network none --build-arg "BASE=$base" \
  -f "$dir/Containerfile" -t "$tag" "$work" >/dev/null
if [ -n "$save" ]; then
  log "saving $save"
  rm -f "$save"
  "${podman[@]}" save --format oci-archive -o "$save" "$tag"
fi
log "SBOM $sbom"
mkdir -p "$(dirname "$sbom")"
tar -xOf "$base_tar" ./var/lib/dpkg/status >"$tmp/dpkg-status"
npm=()
if [ -d "$work/chp" ]; then npm=(--npm-lock "$work/chp/node_modules/.package-lock.json"); fi
"$python" "$here/sbom.py" --image "$tag" --wheels "$work/deps" --wheels "$work/wheel" \
  --dpkg-status "$tmp/dpkg-status" "${npm[@]}" --out "$sbom"
echo "$tag"
