"""erdma-quic: the QUIC transport for eRDMA (aioquic), with mutual TLS 1.3 between the ranks of a job."""
