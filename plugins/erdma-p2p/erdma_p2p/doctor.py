"""``erdma doctor``, through the ``erdma_doctor`` hook: what this host's NAT does to a UDP socket, asked
the way the ``stun`` traversal asks, from one socket: of ``traversal.stun.server`` and, when set, of
``traversal.stun.check_server`` (another address; RFC 5780's mapping test). The same mapping for both means
the NAT maps the socket endpoint-independently (hole punching works); a different one means it maps per
destination ("symmetric": only a relay joins such a rank to a peer behind another NAT). No NAT is told too.
"""

from __future__ import annotations

import socket

from . import stun
from .traversal import server_address

VERDICTS = {
    "none": "no NAT: the socket's own address is what peers see",
    "independent": "endpoint-independent mapping: hole punching works (traversal = \"stun\")",
    "dependent": "the mapping changes with the destination (symmetric NAT): hole punching cannot work; a peer "
                 "behind another NAT needs a relay",
}


def diagnose(server: tuple[str, int], check: tuple[str, int] | None, timeout: float,
             bind: str = "0.0.0.0") -> dict[str, str]:
    """The socket's local address, its mappings towards both servers, and the verdict (``VERDICTS``; ""
    when there is no NAT to judge without ``check``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((bind, 0))
        first = stun.query(sock, server, timeout)
        second = stun.query(sock, check, timeout) if check is not None else first
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.connect(server)  # the local address that routes to the server (no packet is sent)
        local = (probe.getsockname()[0], sock.getsockname()[1])
        probe.close()
    finally:
        sock.close()
    if first != second:
        verdict = "dependent"
    elif (first.host, first.port) == local:
        verdict = "none"
    else:
        verdict = "independent" if check is not None else ""
    return {"local": f"{local[0]}:{local[1]}", "mapped": f"{first.host}:{first.port}",
            "mapped_alt": f"{second.host}:{second.port}", "verdict": verdict}


def report(server_text: str, check_text: str, timeout: float) -> list[str]:
    """``erdma doctor``'s lines; one starting "problem: " when a server does not answer."""
    if not server_text:
        return ["NAT: not probed (set traversal.stun.server, e.g. ERDMA_TRAVERSAL_STUN_SERVER=HOST:3478)"]
    try:
        server = server_address(server_text)
        check = server_address(check_text, "config key 'traversal.stun.check_server'") if check_text else None
        found = diagnose(server, check, timeout)
    except (stun.StunError, OSError, ValueError) as exc:
        return [f"problem: NAT probe through {server_text}: {exc}"]
    asked = f"{server_text} and {check_text}" if check else server_text
    return [f"NAT, asked of {asked} from one socket:",
            f"  local address {found['local']}, mapped to {found['mapped']}"
            + (f" and {found['mapped_alt']}" if check else ""),
            "  " + (VERDICTS[found["verdict"]] if found["verdict"] else
                    "mapping behaviour not tested (set traversal.stun.check_server to a second STUN server)")]
