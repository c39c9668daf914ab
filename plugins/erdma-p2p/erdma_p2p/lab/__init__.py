"""The NAT test bed (``natlab``: network namespaces, nftables NATs, coturn, stund) and a job run on it (``jobs``,
``job``): what erdma-p2p's tests and benchmarks build on. Needs root, iproute2, nftables and coturn."""
