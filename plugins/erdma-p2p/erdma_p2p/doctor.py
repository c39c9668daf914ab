"""``erdma doctor``, through the ``erdma_doctor`` hook: what this host's NAT does to a UDP socket, asked
the way the ``stun`` traversal asks, from one socket: of ``traversal.stun.server`` and, when set, of
``traversal.stun.check_server`` (another address; RFC 5780's mapping test). The same mapping for both means
the NAT maps the socket endpoint-independently (hole punching works); a different one means it maps per
destination ("symmetric": only a relay joins such a rank to a peer behind another NAT). No NAT is told too.
Nothing here decides a path: the ranks of a job do that by connecting. With ``discovery.init_method`` a
``dht://`` URL of a running job (and its ``security.secret``), the doctor also reads, as an observer that
claims no rank, the paths each rank published (``paths/RANK``, by erdma-quic or the built-in TCP): which
peers it reaches directly and which through a relay.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any

from erdma_core.toolkit import meet, route_source

from . import stun
from .relayed import allocate
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
    return _found(local, first, second, check is not None)


def _found(local: tuple[str, int], first: stun.Mapped, second: stun.Mapped, checked: bool) -> dict[str, str]:
    """The report of one probe: the local address, both mappings and the verdict (``VERDICTS``' keys)."""
    if first != second:
        verdict = "dependent"
    elif (first.host, first.port) == local:
        verdict = "none"
    else:
        verdict = "independent" if checked else ""
    return {"local": f"{local[0]}:{local[1]}", "mapped": f"{first.host}:{first.port}",
            "mapped_alt": f"{second.host}:{second.port}", "verdict": verdict}


TCP_VERDICTS = {
    "none": "no NAT on TCP either",
    "independent": "endpoint-independent: the built-in TCP meets peers through it (transport = \"tcp\", traversal = "
                   "\"stun\")",
    "dependent": "the mapping changes with the destination: TCP cannot meet a peer behind another NAT from here "
                 "(use transport = \"quic\" with a relay)",
}


def diagnose_tcp(server: tuple[str, int], check: tuple[str, int] | None, timeout: float) -> dict[str, str]:
    """What ``diagnose`` tells, for a TCP port: its mapping asked over TCP of both servers from that port."""
    held = meet.bound_to(("0.0.0.0", 0))
    try:
        port = held.getsockname()[1]
        first = stun.query_tcp(("0.0.0.0", port), server, timeout)
        second = stun.query_tcp(("0.0.0.0", port), check, timeout) if check is not None else first
    finally:
        held.close()
    return _found((route_source(server[0]), port), first, second, check is not None)


def _tcp(server: tuple[str, int], check: tuple[str, int] | None, timeout: float) -> list[str]:
    """The TCP lines of the report (a server that does not serve STUN over TCP is said, not a problem)."""
    try:
        found = diagnose_tcp(server, check, timeout)
    except (stun.StunError, OSError) as exc:
        return [f"TCP port: not probed: {exc}"]
    return [f"TCP port: local address {found['local']}, mapped to {found['mapped']}"
            + (f" and {found['mapped_alt']}" if check else ""),
            "  " + (TCP_VERDICTS[found["verdict"]] if found["verdict"] else "mapping behaviour not tested")]


def report(section: dict[str, Any]) -> list[str]:
    """``erdma doctor``'s lines (``section``: the ``[traversal.stun]`` options); one starting "problem: " when
    a server does not answer or the relay refuses this rank."""
    server_text, check_text, timeout = section["server"], section["check_server"], section["timeout"]
    if not server_text:
        return ["NAT: not probed (set traversal.stun.server, e.g. ERDMA_TRAVERSAL_STUN_SERVER=HOST:3478)"]
    try:
        server = server_address(server_text)
        check = server_address(check_text, "traversal.stun.check_server") if check_text else None
        found = diagnose(server, check, timeout)
    except (stun.StunError, OSError, ValueError) as exc:
        return [f"problem: NAT probe through {server_text}: {exc}"]
    asked = f"{server_text} and {check_text}" if check else server_text
    lines = [f"NAT, asked of {asked} from one socket:",
             f"  local address {found['local']}, mapped to {found['mapped']}"
             + (f" and {found['mapped_alt']}" if check else ""),
             "  " + (VERDICTS[found["verdict"]] if found["verdict"] else
                     "mapping behaviour not tested (set traversal.stun.check_server to a second STUN server)")]
    lines += _tcp(server, check, timeout)
    if section["classify_server"]:
        try:
            where = server_address(section["classify_server"], "traversal.stun.classify_server")
        except ValueError as exc:
            return [f"problem: {exc}"]
        lines.append(classify(where, max(CLASSIFY_S, section["timeout"])))
    return lines + _relay(section, found["verdict"])


CLASSIFY_S = 40.0  # pystun3 takes about 16 s against a two-address server, and can loop forever
_PYSTUN = ("import json, sys, stun; print(json.dumps(stun.get_ip_info(source_port=0, stun_host=sys.argv[1], "
           "stun_port=int(sys.argv[2]))))")


def classify(server: tuple[str, int], timeout: float) -> str:
    """pystun3's RFC 3489 classification through ``server``, run in a process of its own that is killed at
    ``timeout`` (it opens its own socket, and loops forever against some servers): a diagnostic line only,
    never used to decide anything."""
    head = "RFC 3489 classification (pystun3, from a socket of its own; diagnostic only): "
    try:
        out = subprocess.run([sys.executable, "-c", _PYSTUN, server[0], str(server[1])], capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return head + f"no result within {timeout:.0f}s (stopped)"
    try:
        nat, host, port = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError, TypeError):
        return head + f"failed: {(out.stderr.strip().splitlines() or ['no output'])[-1]}"
    return head + f"{nat}" + (f", external {host}:{port}" if host else "")


def _relay(section: dict[str, Any], verdict: str) -> list[str]:
    """Whether the TURN server (``relay``) grants this host an allocation, and whether a rank here relays."""
    if not section["relay"]:
        return ["relay: none (traversal.stun.relay)"]
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind(("0.0.0.0", 0))
        relayed = allocate(sock, server_address(section["relay"], "traversal.stun.relay"),
                           section["relay_user"], section["relay_password"], section["timeout"])
        addr = relayed.client.relayed
        relayed.close()
    except (stun.StunError, OSError, ValueError) as exc:
        return [f"problem: relay {section['relay']}: {exc}"]
    finally:
        sock.close()
    if section["relay_when"] == "always":
        use = "  a rank here relays all its traffic through it (relay_when = \"always\")"
    else:
        use = ("  a rank here offers it as its last candidate: peers that no direct path reaches within "
               f"{section['check_timeout']:.1f} s (traversal.stun.check_timeout) go through it")
        if verdict == "dependent":
            use += "; with this NAT, expect peers behind NATs to need it"
    return [f"relay {section['relay']}: granted relayed address {addr.host}:{addr.port}" if addr else
            f"relay {section['relay']}: granted", use]


def job_paths(init_method: str, secret: str, section: dict[str, Any], timeout: float) -> list[str]:
    """The paths the ranks of the running job at ``init_method`` (dht://) published, rank by rank until one
    has published none; one "problem: " line when the DHT cannot be joined."""
    from erdma_core.sdk import CollectiveTimeoutError, ErdmaError

    from .dht_store import DhtStore, parse_url

    try:
        bootstrap, job = parse_url(init_method)
    except ValueError as exc:
        return [f"problem: {exc}"]
    if not secret:
        return [f"job {job!r}: paths not read (set security.secret: the job's records are signed with it)"]
    try:
        store = DhtStore(bootstrap, job, secret.encode(), timeout=timeout, section=section)
    except ErdmaError as exc:
        return [f"problem: {exc}"]
    lines = [f"job {job!r}, paths as its ranks published them:"]
    try:
        rank = 0
        while True:
            try:
                value = store.get(f"paths/{rank}", timeout if rank == 0 else 1.0).decode()
            except CollectiveTimeoutError:
                break
            peers = [[*line.split(), ""][:4] for line in value.splitlines() if len(line.split()) in (3, 4)]
            lines.append(f"  rank {rank}: " + ", ".join(f"rank {peer} {how}" + (f" over {over}" if over else "")
                                                       + f" ({addr})" for peer, addr, how, over in peers))
            rank += 1
    finally:
        store.close()
    if rank == 0:
        lines.append(f"  none within {timeout:.1f}s (the job has not connected yet, has ended, or uses another "
                     "traversal than stun)")
    return lines
