"""RDMA verbs for eRDMA: the ``verbs`` transport (``transport = "verbs"``) on libibverbs (a C side built at
install), and a qemu test guest with SoftRoCE (``erdma_verbs.guest``) for machines whose kernel has no RDMA."""
