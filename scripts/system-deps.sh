#!/usr/bin/env bash
# Debian packages the project needs beyond Python: installs only what is missing (no apt traffic otherwise).
#   scripts/system-deps.sh test    the network lab's tests: iproute2, ethtool, ping, a C compiler, nftables, conntrack,
#                                  coturn and stun-server (erdma-p2p's STUN/TURN servers); qemu, mmdebstrap and
#                                  e2fsprogs (erdma-verbs' test guest, built on first use under /var/cache/erdma-guest);
#                                  DPDK's headers and pkg-config (erdma-dpdk builds its C shim against them at install),
#                                  ngtcp2's and GnuTLS's headers (erdma-quic's compiled engine, built the same way);
#                                  libibverbs' headers (erdma-verbs' C side over verbs, built the same way);
#                                  etcd (the elastic tests' 3-member cluster: etcd-server, and etcdctl from etcd-client)
#   scripts/system-deps.sh bench   plus Open MPI (mpirun, headers for mpi4py) for the benchmark lab
set -euo pipefail
want=(ip:iproute2 ethtool:ethtool ping:iputils-ping cc:gcc tc:iproute2 nft:nftables conntrack:conntrack
      turnserver:coturn stund:stun-server qemu-system-x86_64:qemu-system-x86 mmdebstrap:mmdebstrap
      mkfs.ext4:e2fsprogs etcd:etcd-server etcdctl:etcd-client)
if [[ "${1:-test}" == bench ]]; then
    want+=(mpirun:openmpi-bin mpicc:libopenmpi-dev)
fi
missing=()
for pair in "${want[@]}"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
if ! command -v pkg-config >/dev/null 2>&1 || ! pkg-config --exists libdpdk; then
    missing+=(libdpdk-dev pkg-config)
fi
if ! command -v pkg-config >/dev/null 2>&1 || ! pkg-config --exists libngtcp2 libngtcp2_crypto_gnutls gnutls; then
    missing+=(libngtcp2-dev libngtcp2-crypto-gnutls-dev libgnutls28-dev pkg-config)
fi
if [[ ! -f /usr/include/infiniband/verbs.h ]]; then
    missing+=(libibverbs-dev)
fi
if ((${#missing[@]} == 0)); then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "system-deps: missing ${missing[*]} and not root; install them with apt-get" >&2
    [[ "${1:-test}" == bench ]] && exit 1
    exit 0  # the lab's tests skip without root anyway
fi
echo "system-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
