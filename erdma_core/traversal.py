"""The traversal interface, and the built-in ``direct`` strategy (no NAT traversal)."""

from __future__ import annotations

from typing import Any, Protocol


class Traversal(Protocol):
    """``advertise`` is required. A strategy that prepares a UDP socket itself (binds it, learns its public
    mapping, punches holes through it) may also offer ``udp_socket() -> socket | None``: a datagram
    transport (QUIC) then runs on that socket instead of binding its own, so the mapping stays in use; and
    ``punch(host, port) -> bytes | None``: a datagram the transport sends from that socket to the advertised
    address of each peer that will dial this rank, as soon as the peer has published it, so that this rank's
    NAT lets the peer's first packets in (the transport must ignore such datagrams when they arrive); and
    ``udp_sockets(count) -> list[socket]``: that many more sockets prepared like ``udp_socket``'s, each with
    its own mapping (``advertise`` answers for each by its port), for a transport that stripes its traffic
    over several (one per lane); it raises ``ConfigError`` when it cannot.

    A strategy with more than one way to reach this rank (ICE-like: its NAT's mapping, a TURN relay) offers
    ``candidates(host, port) -> list[addresses.Candidate]``: every address, in the order peers should try
    them, published instead of ``advertise``'s one (``punch`` is then called for each candidate of a peer);
    and ``dial_plan(candidates) -> (list[Candidate], seconds)``: of a peer's candidates, those this rank dials,
    in order of preference, and how long the first has to answer before another is used. The decision is made
    by trying: a transport checks the plan's candidates one after another (the built-in TCP) or at once
    (erdma-quic: after the wait, the most preferred one that answered), and after an outage goes through the
    plan again.

    A strategy that prepares a TCP port offers ``tcp_socket() -> socket``: a TCP socket bound with
    SO_REUSEADDR and SO_REUSEPORT whose NAT mapping it learned (``candidates`` answers for its port). A stream
    transport (the built-in TCP) then listens on it and meets every peer of another host from that port,
    both ranks connecting at once (``erdma_core.net.meet``), so that each opens its own NAT; it raises
    ``ConfigError`` for settings it cannot keep over TCP."""

    def advertise(self, host: str, port: int) -> tuple[str, int]:
        """Given the address this rank listens on, return the address peers should dial."""
        ...


class DirectTraversal:
    """No NAT traversal: peers dial the address this rank listens on."""

    def __init__(self, config: Any = None, section: dict[str, Any] | None = None) -> None:
        pass

    def advertise(self, host: str, port: int) -> tuple[str, int]:
        return host, port
