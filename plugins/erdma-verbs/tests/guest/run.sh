# The guest's command (sh, in the plugin's folder): SoftRoCE on a dummy device, then the guest tests.
set -e
modprobe rdma_rxe
ip link add erdma0 type dummy
ip addr add 10.77.0.1/24 dev erdma0
ip link set erdma0 up
rdma link add rxe0 type rxe netdev erdma0
python3 -m pytest -q -p no:cacheprovider tests/guest
