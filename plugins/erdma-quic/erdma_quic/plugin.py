"""Entry point ``erdma.plugins: quic``: registers the ``quic`` transport, the ``erdma keys`` command and the
environment variable it reads (``ERDMA_KEYS_DIR``). Importing this module is cheap; aioquic and cryptography
load only when the transport or command runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from erdma_core.sdk import Config, Option, Register, RegisterEnvironment, hookimpl

CONGESTION = ("bbr", "cubic", "reno")
OPTIONS = {
    "bind_address": Option(str, "", "address to listen on; empty: the address that routes to the discovery host"),
    "interface": Option(str, "", "network interface whose IPv4 address to use (overrides bind_address)"),
    "port": Option(int, 0, "UDP port; 0 picks a free one", minimum=0, maximum=65535),
    "ca_cert": Option(str, "", "cluster CA certificate (PEM) made by `erdma keys init`; empty: "
                      "$ERDMA_KEYS_DIR or ~/.config/erdma/keys/ca.pem when present"),
    "ca_key": Option(str, "", "the CA's private key; every rank signs its own certificate with it"),
    "secret": Option(str, "", "shared secret instead of CA files: each job's CA is derived from it (empty: "
                     "security.secret, the job's secret, when no CA files are named)", secret=True),
    "insecure_dev_mode": Option(bool, False, "INSECURE: no peer authentication (development only; warns)"),
    "cipher": Option(str, "aes128gcm", "preferred TLS 1.3 cipher suite", choices=("aes128gcm", "aes256gcm", "chacha20")),
    "congestion_control": Option(str, "bbr", "congestion controller: bbr (model-based, ignores random loss; "
                                 "erdma_quic.congestion, or ngtcp2's BBR on that engine) or the engine's own cubic, "
                                 "reno", choices=CONGESTION),
    "datagram_size": Option(int, 0, "UDP payload per QUIC packet: 1200..65527 on the compiled engine, 1200..16000 "
                            "on aioquic; 0: the path MTU less headers, at most 16000", minimum=0, maximum=65527),
    "gso": Option(bool, True, "send runs of equal-size datagrams as one sendmsg each (Linux UDP GSO) on every "
                  "path where a probe the peer answers came back whole (erdma_quic.gso); false: never"),
    "part_bytes": Option(int, 4 << 20, "a message larger than this is split across several streams",
                         minimum=4096),
    "send_window_bytes": Option(int, 16 << 20, "bytes handed to QUIC per peer and not yet acknowledged",
                                minimum=65536),
    "idle_timeout": Option(float, 30.0, "seconds of silence after which a peer counts as lost", minimum=1.0),
    "keepalive_interval": Option(float, 5.0, "seconds between PINGs to every peer", minimum=0.1),
    "workers": Option(int, 0, "worker processes, each with a UDP socket and a QUIC connection to every peer, "
                      "that carry a share of every message larger than part_bytes (striping: one more core per "
                      "worker); 0: all traffic on the rank's own event loop", minimum=0),
    "engine": Option(str, "auto", "the QUIC implementation: ngtcp2 (compiled: erdma_quic/ngtcp2, built at "
                     "install against libngtcp2-dev and GnuTLS; where it was not built, choosing it is a "
                     "PluginError naming the packages), aioquic (Python: the reference, several times the CPU "
                     "per byte) or auto (ngtcp2 where it was built, else aioquic with a warning)",
                     choices=("auto", "ngtcp2", "aioquic")),
    "reconnect_timeout": Option(float, 30.0, "after a connection to a peer ends by idle timeout: seconds to "
                                "dial it again (resuming the TLS session with the peer's ticket, 0-RTT) and resend "
                                "what it had not acknowledged, before the peer counts as lost; 0: never reconnect",
                                minimum=0.0),
    "path_recheck": Option(float, 10.0, "seconds between checks, by the dialling rank of a pair whose connection runs "
                           "to a later candidate than the peer's first (its relay, say), whether an earlier one "
                           "answers now; one that completes a handshake carries the pair from then on, and what "
                           "was in flight goes again on it (the listening rank punches its NAT open towards the "
                           "dialler's candidates as often); 0: a pair stays where set-up or an outage put it. With "
                           "insecure_dev_mode no check is made (a trial's peer is proved by its certificate)",
                           minimum=0.0, maximum=3600.0),
}


def _factory(config: Config, section: dict[str, Any]) -> Any:
    from .transport import QuicTransport

    return QuicTransport(config, section)


_factory.takes_peers = True  # type: ignore[attr-defined]  # connects only ctx.peers: a paired job's fallback


def _check(config: Config, section: dict[str, Any]) -> None:
    from .checks import check

    check(config, section)


@hookimpl
def erdma_register_transports(register: Register) -> None:
    register("quic", _factory, options=OPTIONS,
             description="QUIC on the compiled ngtcp2 engine (aioquic where not built): mutual TLS 1.3, each message on "
                      "streams of its own (parts of part_bytes), one UDP socket per rank (and per worker lane)", sdk=2,
             check=_check)


@hookimpl
def erdma_register_environment(register: RegisterEnvironment) -> None:
    register("ERDMA_KEYS_DIR", "folder of the cluster CA (ca.pem, ca.key) that `erdma keys init` writes and the "
             "quic transport reads (default ~/.config/erdma/keys)")


def _keys_init(args: argparse.Namespace) -> int:
    from . import credentials as cred

    folder = Path(args.out) if args.out else cred.default_dir()
    try:
        cert, key = cred.write_authority(cred.new_authority(args.name), folder, force=args.force)
    except FileExistsError as exc:
        print(f"erdma keys init: {exc}")
        return 1
    print(f"wrote {cert} (CA certificate) and {key} (CA key, mode 0600).\n"
          "Copy both to every host of the cluster (or point transport.quic.ca_cert / ca_key at them).\n"
          "Whoever holds ca.key can join your jobs: keep it secret.")
    return 0


@hookimpl
def erdma_add_commands(subparsers: Any) -> None:
    keys = subparsers.add_parser("keys", help="credentials for the QUIC transport (erdma-quic)")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    init = ksub.add_parser("init", help="create a cluster CA (ca.pem, ca.key)")
    init.add_argument("--out", default="", help="folder (default: $ERDMA_KEYS_DIR or ~/.config/erdma/keys)")
    init.add_argument("--name", default="eRDMA cluster CA", help="the CA's common name")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(handler=_keys_init)
