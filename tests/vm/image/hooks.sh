#!/bin/sh
# mmdebstrap hooks of build.sh: "essential ROOT" runs before the packages are installed,
# "customize ROOT PUBKEY" after.
set -eu
stage=$1 root=$2

if [ "$stage" = essential ]; then
  # A small initrd that mounts a virtio disk, and no documentation in the image.
  mkdir -p "$root/etc/initramfs-tools/conf.d" "$root/usr/share/initramfs-tools/modules.d"
  echo MODULES=list > "$root/etc/initramfs-tools/conf.d/gpu-hotplug-vm"
  printf '%s\n' virtio_pci virtio_blk ext4 crc32c_generic \
    > "$root/usr/share/initramfs-tools/modules.d/gpu-hotplug-vm"
  printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-exclude /usr/share/man/*' \
    'path-exclude /usr/share/locale/*' > "$root/etc/dpkg/dpkg.cfg.d/gpu-hotplug-vm-nodoc"
  exit 0
fi

pubkey=$3
echo gpu-hotplug-vm > "$root/etc/hostname"
echo "127.0.1.1 gpu-hotplug-vm" >> "$root/etc/hosts"
echo "/dev/vda / ext4 rw,errors=remount-ro 0 1" > "$root/etc/fstab"
install -d -m 700 "$root/root/.ssh"
install -m 600 "$pubkey" "$root/root/.ssh/authorized_keys"

# User-mode networking hands out an address by DHCP; nothing waits for it.
mkdir -p "$root/etc/systemd/network"
printf '[Match]\nName=en*\n[Network]\nDHCP=ipv4\n' > "$root/etc/systemd/network/10-vm.network"
chroot "$root" systemctl enable systemd-networkd >/dev/null
for unit in systemd-networkd-wait-online.service apt-daily.timer apt-daily-upgrade.timer \
    e2scrub_all.timer fstrim.timer man-db.timer; do
  chroot "$root" systemctl mask "$unit" >/dev/null 2>&1 || true
done

# containerd as kubeadm sets a node up: runc with the systemd cgroup driver. No registry is
# reachable, so the pause image is one the tests import from busybox.
mkdir -p "$root/etc/containerd"
chroot "$root" containerd config default \
  | sed -e 's/SystemdCgroup = false/SystemdCgroup = true/' \
        -e 's|sandbox_image = .*|sandbox_image = "localhost/pause:vm"|' \
  > "$root/etc/containerd/config.toml"
grep -q 'SystemdCgroup = true' "$root/etc/containerd/config.toml"

# podman: crun, the systemd cgroup manager (its default under systemd, written down here),
# no network stack needed.
mkdir -p "$root/etc/containers"
printf '[engine]\ncgroup_manager = "systemd"\nruntime = "crun"\nevents_logger = "file"\n' \
  > "$root/etc/containers/containers.conf"

# Kernel modules a virtio guest never loads (about 300 MB).
for tree in "$root"/usr/lib/modules/*/kernel; do
  for dir in sound drivers/gpu drivers/media drivers/infiniband drivers/staging \
      drivers/net/wireless drivers/net/ethernet drivers/usb drivers/bluetooth drivers/iio \
      drivers/isdn drivers/hid drivers/input/touchscreen drivers/scsi drivers/ata drivers/md \
      net/wireless net/mac80211 net/bluetooth fs/btrfs fs/xfs fs/ocfs2 fs/gfs2 fs/nfs fs/nfsd \
      fs/smb fs/cifs fs/ceph fs/f2fs; do
    rm -rf "${tree:?}/$dir"
  done
done
chroot "$root" sh -c 'depmod -a $(ls /usr/lib/modules)'
rm -rf "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/*_Packages*
