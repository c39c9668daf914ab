"""Transports: the Transport protocol and the built-in TCP transport."""
