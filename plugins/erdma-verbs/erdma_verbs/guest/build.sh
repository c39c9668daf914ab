#!/usr/bin/env bash
# Build the test guest once per machine: a Debian bookworm root (Debian's kernel, which ships rdma_rxe, its
# initramfs with virtio and 9p, rdma-core with libibverbs, numpy, pytest) as an ext4 image, and a PID 1 that runs the
# shared folder's .guest-cmd and writes its exit status back. Needs root, mmdebstrap and e2fsprogs.
#   build.sh DIR     writes DIR/root.ext4, DIR/vmlinuz, DIR/initrd.img (DIR/.done when complete)
#   build.sh         the same into the cache folder guest.image() reads: $ERDMA_GUEST_CACHE (/var/cache/erdma-guest)
#                    / the first 16 hex digits of this script's SHA-256 (`make test` starts it beside its installs)
# One build at a time per DIR (a lock beside it); a build that finds DIR/.done has nothing to do.
set -euo pipefail
out=${1:-${ERDMA_GUEST_CACHE:-/var/cache/erdma-guest}/$(sha256sum "$0" | cut -c1-16)}
mkdir -p "$out"
exec 9> "$out.lock"
flock 9
[[ -f $out/.done ]] && exit 0
rm -rf "$out/root" "$out/rootfs.tar"
mmdebstrap --variant=minbase \
    --include=linux-image-amd64,initramfs-tools,kmod,iproute2,rdma-core,ibverbs-providers,ibverbs-utils,libibverbs1,python3,python3-numpy,python3-pytest,openmpi-bin \
    --customize-hook='printf "9p\n9pnet\n9pnet_virtio\nvirtio_pci\nvirtio_blk\n" >> "$1/etc/initramfs-tools/modules"' \
    --customize-hook='chroot "$1" update-initramfs -u -k all' \
    bookworm "$out/rootfs.tar"
mkdir "$out/root"
tar -C "$out/root" -xf "$out/rootfs.tar"
cat > "$out/root/sbin/erdma-init" <<'INIT'
#!/bin/sh
# PID 1 of the test guest: mount the host's shared folder, run its .guest-cmd, write the status back; the
# kernel then panics on PID 1's exit and, booted with panic=-1 and qemu's -no-reboot, the guest is gone.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null; mount -t tmpfs tmp /tmp
mkdir -p /mnt/host
mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576 host /mnt/host
cd /mnt/host && sh ./.guest-cmd > ./.guest-out 2>&1; echo $? > ./.guest-rc
sync
INIT
chmod +x "$out/root/sbin/erdma-init"
cp "$out"/root/boot/vmlinuz-* "$out/vmlinuz"
cp "$out"/root/boot/initrd.img-* "$out/initrd.img"
mkfs.ext4 -q -F -d "$out/root" -L erdma "$out/root.ext4" 3G
rm -rf "$out/root" "$out/rootfs.tar"
touch "$out/.done"
