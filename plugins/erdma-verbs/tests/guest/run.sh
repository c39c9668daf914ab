# The guest's command (sh, in the plugin's folder): SoftRoCE on a dummy device, then the command given ("$@"),
# in the host's Python (shared into the guest at its own path; its erdma-verbs' C side loads the guest's libibverbs).
set -e
hostname erdma-guest  # Open MPI refuses the kernel's "(none)"
mkdir -p /dev/shm && mount -t tmpfs shm /dev/shm  # POSIX semaphores and shared memory (multiprocessing, MPI)
modprobe rdma_rxe
ip link set lo up
ip link add erdma0 type dummy
ip addr add 10.77.0.1/24 dev erdma0
ip link set erdma0 mtu 9000 up  # jumbo frames, as RoCE fabrics run: 4096-byte RDMA MTU
rdma link add rxe0 type rxe netdev erdma0
export PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
"$@"
