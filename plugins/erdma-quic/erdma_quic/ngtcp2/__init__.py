"""The compiled QUIC engine (ngtcp2 with GnuTLS, through a C shim built at install): see ``connection``."""
