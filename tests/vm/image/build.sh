#!/usr/bin/env bash
# Build the systemd node's VM image from Debian packages only (mmdebstrap), into OUT:
#   rootfs.ext4          sparse raw ext4, root=/dev/vda; always booted with snapshot=on
#   vmlinuz, initrd.img  for qemu -kernel/-initrd (no bootloader)
#   id_ed25519[.pub]     the key root logs in with over ssh
#
# Usage: build.sh OUT MIRROR SECURITY_MIRROR SUITE   (run as root; tests/vm/image.py calls it
# with the mirror of the host's apt sources and caches OUT under a hash of this directory).
#
# What the node is: the production default of a GPU node today — systemd as pid 1, pure
# cgroup v2, containerd with the systemd cgroup driver (runc), podman with crun — plus what the
# tests need inside: python3 (the test venv's packages are shared in read-only), gcc for the
# simulated NVML library, bpftool for the operator checks the docs describe, busybox-static
# for the test images, sshd for the host's test driver, iptables for kube-proxy on the
# production node (tests/realnode/vm_node.py; Debian 13 no longer pulls it in with podman).
set -euo pipefail
out=$1 mirror=$2 security=$3 suite=$4
here=$(cd "$(dirname "$0")" && pwd)
rootfs="$out/rootfs"

packages=(
  systemd systemd-sysv udev dbus kmod linux-image-amd64 initramfs-tools
  containerd runc podman crun conmon golang-github-containers-common
  bpftool iproute2 iptables openssh-server busybox-static procps util-linux
  python3 gcc libc6-dev
)

ssh-keygen -q -t ed25519 -N '' -C gpu-hotplug-vm -f "$out/id_ed25519"

mmdebstrap --variant=apt --include="$(IFS=,; echo "${packages[*]}")" \
  --aptopt='Apt::Install-Recommends "false"' \
  --aptopt='Acquire::Check-Valid-Until "false"' \
  --essential-hook="sh '$here/hooks.sh' essential \"\$1\"" \
  --customize-hook="sh '$here/hooks.sh' customize \"\$1\" '$out/id_ed25519.pub'" \
  "$suite" "$rootfs" \
  "deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security $suite-security main"

cp "$(readlink -f "$rootfs/vmlinuz")" "$out/vmlinuz"
cp "$(readlink -f "$rootfs/initrd.img")" "$out/initrd.img"
mkfs.ext4 -q -F -L gpu-hotplug-vm -d "$rootfs" "$out/rootfs.ext4" 3G
rm -rf "$rootfs"
