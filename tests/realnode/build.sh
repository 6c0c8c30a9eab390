#!/usr/bin/env bash
# Build the real node's components from their Go modules, once per version.
#
#   bash tests/realnode/build.sh            build what is missing, print the bin directory
#   bash tests/realnode/build.sh NAME...    only these components (runc, containerd, ...)
#   bash tests/realnode/build.sh --except NAME...   every component but these
#   bash tests/realnode/build.sh --list     say which components are cached
#
# Why a scratch module: k8s.io/kubernetes (and a few others) cannot be `go install`ed: its go.mod
# requires its staging modules at v0.0.0 and replaces them with ./staging paths, and replace
# directives are ignored outside the main module. A throwaway main module that requires the
# upstream module, pins each locally-replaced requirement to its released version and copies the
# upstream's other replaces builds the same packages upstream ships.
#
# Cache layout (JGH_NODE_CACHE, default ~/.cache/jupyter-gpu-hotplug/node):
#   bin/<name>-<version>/       the binaries, complete once bin/<name>-<version>/.built holds
#                               the recipe they were built with
#   gomod/ gocache/             Go's module and build caches, shared by every component
#   src/<name>-<version>/       the scratch module and the build's timing (build-time.txt)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
cache=${JGH_NODE_CACHE:-$HOME/.cache/jupyter-gpu-hotplug/node}
export GOMODCACHE=$cache/gomod GOCACHE=$cache/gocache GOTOOLCHAIN=local GOFLAGS=-mod=mod
export GOPATH=$cache/gopath
# A build beside other work yields to it (JGH_NODE_BUILD_NICE, default 5); .ci/test's real-node
# lane, whose tests wait for the build, runs it at 0.
nice_run=(nice -n "${JGH_NODE_BUILD_NICE:-5}")

log() { echo "[node-build $(date +%T)] $*" >&2; }

# build NAME VERSION MODULE@VERSION LOCAL_REPLACE_VERSION CGO TAGS LDFLAGS PACKAGE...
# LOCAL_REPLACE_VERSION: the version given to requirements the upstream replaces with a local
# path ("-" keeps the upstream's own required versions).
build() {
  local name=$1 version=$2 modver=$3 local_version=$4 cgo=$5 tags=$6 ldflags=$7
  shift 7
  if [ "${#only[@]}" -gt 0 ] && [[ " ${only[*]} " != *" $name "* ]]; then return 0; fi
  if [ "${#except[@]}" -gt 0 ] && [[ " ${except[*]} " == *" $name "* ]]; then return 0; fi
  local out=$cache/bin/$name-$version src=$cache/src/$name-$version
  # The stamp holds the recipe (packages, tags, flags): a changed recipe rebuilds.
  local recipe="$modver|$cgo|$tags|$ldflags|$*"
  if [ -e "$out/.built" ] && [ "$(cat "$out/.built")" = "$recipe" ]; then return 0; fi
  log "$name $version: building (${*})"
  rm -rf "$out" "$src"
  mkdir -p "$out" "$src"
  local t0=$SECONDS gomod
  gomod=$(go mod download -json "$modver" | jq -r .GoMod)
  (
    cd "$src"
    printf 'module scratch/%s\n\ngo %s\n' "$name" "$(go mod edit -json "$gomod" | jq -r .Go)" >go.mod
    local old new
    while IFS=$'\t' read -r old new; do
      case "$new" in
        ./* | ../*)
          if [ "$local_version" != - ]; then go mod edit -replace="$old=$old@$local_version"; fi ;;
        *) go mod edit -replace="$old=$new" ;;
      esac
    done < <(go mod edit -json "$gomod" |
      jq -r '.Replace[]? | [.Old.Path + (if .Old.Version then "@" + .Old.Version else "" end),
                           .New.Path + (if .New.Version then "@" + .New.Version else "" end)] | @tsv')
    go mod edit -require="$modver"
    "${nice_run[@]}" go mod download
    local pkgs=()
    for p in "$@"; do pkgs+=("$p"); done
    # The module at its exact version (a bare package path would ask the proxy for a version
    # list, which it refuses for some modules).
    "${nice_run[@]}" go get "$modver"
    CGO_ENABLED=$cgo /usr/bin/time -v "${nice_run[@]}" go build -p 2 -trimpath -tags "$tags" \
      -ldflags "-s -w $ldflags" -o "$out/" "${pkgs[@]}" 2>build-time.txt || {
      cat build-time.txt >&2
      exit 1
    }
  )
  echo "$((SECONDS - t0))" >"$out/.seconds"
  printf '%s' "$recipe" >"$out/.built"
  log "$name $version: built in $((SECONDS - t0)) s, $(du -sh "$out" | cut -f1)"
}

k8s_ldflags() {
  local v=$KUBERNETES_VERSION minor
  minor=${v#v1.}
  minor=${minor%%.*}
  local x=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    x="$x -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
    x="$x -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  echo "$x"
}

build_all() {
  # Helm first: the chart's tests need nothing else, and run while the rest builds (a test that
  # needs a component waits for its stamp while a build runs: components.py).
  build helm "$HELM_VERSION" "helm.sh/helm/v3@$HELM_VERSION" - 0 "" \
    "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" helm.sh/helm/v3/cmd/helm
  build runc "$RUNC_VERSION" "github.com/opencontainers/runc@$RUNC_VERSION" - 1 seccomp \
    "-X main.version=${RUNC_VERSION#v}" github.com/opencontainers/runc
  build containerd "$CONTAINERD_VERSION" "github.com/containerd/containerd/v2@$CONTAINERD_VERSION" - 0 \
    "no_btrfs no_devmapper no_zfs" \
    "-X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
    github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
    github.com/containerd/containerd/v2/cmd/ctr
  build crictl "$CRICTL_VERSION" "sigs.k8s.io/cri-tools@$CRICTL_VERSION" - 0 "" \
    "-X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" sigs.k8s.io/cri-tools/cmd/crictl
  build cni-plugins "$CNI_PLUGINS_VERSION" "github.com/containernetworking/plugins@$CNI_PLUGINS_VERSION" - 0 "" "" \
    github.com/containernetworking/plugins/plugins/main/bridge \
    github.com/containernetworking/plugins/plugins/main/loopback \
    github.com/containernetworking/plugins/plugins/ipam/host-local \
    github.com/containernetworking/plugins/plugins/meta/portmap
  build etcd "$ETCD_VERSION" "go.etcd.io/etcd/server/v3@$ETCD_VERSION" "$ETCD_VERSION" 0 "" "" \
    go.etcd.io/etcd/server/v3
  # go names the binary of .../server/v3 after "server".
  if [ -e "$cache/bin/etcd-$ETCD_VERSION/server" ]; then
    mv "$cache/bin/etcd-$ETCD_VERSION/server" "$cache/bin/etcd-$ETCD_VERSION/etcd"
  fi
  build kubernetes "$KUBERNETES_VERSION" "k8s.io/kubernetes@$KUBERNETES_VERSION" "v0.${KUBERNETES_VERSION#v1.}" 0 \
    "" "$(k8s_ldflags)" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
  build nvidia-device-plugin "$DEVICE_PLUGIN_VERSION" \
    "github.com/NVIDIA/k8s-device-plugin@$DEVICE_PLUGIN_VERSION" - 1 "" \
    "-X github.com/NVIDIA/k8s-device-plugin/internal/info.version=$DEVICE_PLUGIN_VERSION" \
    github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin
  # cgo: nvidia-ctk's `cdi generate --mode nvml` dlopen()s libnvidia-ml.so.1 through go-nvml.
  build nvidia-container-toolkit "$CONTAINER_TOOLKIT_VERSION" \
    "github.com/NVIDIA/nvidia-container-toolkit@$CONTAINER_TOOLKIT_VERSION" - 1 "" \
    "-X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version=${CONTAINER_TOOLKIT_VERSION#v}" \
    github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk \
    github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-container-runtime \
    github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook
  # promtool (not a node component): `promtool test rules` proves the alerts of k8s/monitoring
  # and the chart (tests/manifests/test_rules.py). Prometheus 3.x's Go module is v0.3MM.P for
  # release 3.MM.P.
  local minor_patch=${PROMETHEUS_VERSION#v0.}
  local prometheus_release="3.$((${minor_patch%%.*} - 300)).${minor_patch#*.}"
  build promtool "$PROMETHEUS_VERSION" "github.com/prometheus/prometheus@$PROMETHEUS_VERSION" - 0 "" \
    "-X github.com/prometheus/common/version.Version=$prometheus_release" \
    github.com/prometheus/prometheus/cmd/promtool
}

# One build at a time per cache: a second run waits for the first, then finds what it built
# (.ci/test builds promtool in the background while a test may ask for it).
locked_build_all() {
  command -v go >/dev/null || { echo "build.sh: no go on PATH (Go 1.26 is needed)" >&2; exit 1; }
  mkdir -p "$cache"
  exec 9>>"$cache/.build.lock"
  flock 9
  build_all
  echo "$cache/bin"
}

only=()
except=()
case "${1:-}" in
  --list)
    ls -1 "$cache/bin" 2>/dev/null || true ;;
  --except)
    shift
    except=("$@")
    locked_build_all ;;
  -*)
    echo "usage: $0 [--list | --except NAME... | NAME...]" >&2
    exit 2 ;;
  *)
    only=("$@")
    locked_build_all ;;
esac
