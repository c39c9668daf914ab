"""Networking the transports and the discovery stores both stand on: socket helpers (``sockets``), a
selector's wake-up pipe (``wakeup``), the addresses a rank advertises and dials (``addresses``) and the
meeting of two ranks through one socket each (``meet``). Nothing here knows the wire format or the job."""
