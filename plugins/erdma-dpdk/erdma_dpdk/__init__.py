"""erdma-dpdk: the ``dpdk`` transport (DPDK userspace packet I/O: memif, af_packet)."""
