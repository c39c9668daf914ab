"""What erdma-quic refuses before a rank contacts anyone (``register(..., check=)``, called on every rank when
the config is loaded): a datagram size QUIC or the engine cannot send, an engine that is not built, and
credentials that are not there (no CA files, no secret, not the insecure mode)."""

from __future__ import annotations

from typing import Any

from erdma_core.sdk import ConfigError

MIN_DATAGRAM = 1200  # RFC 9000 14: QUIC's smallest datagram
MAX_DATAGRAM = {"ngtcp2": 65527, "aioquic": 16000}  # UDP's largest payload; aioquic: a STREAM length in 2 bytes


def check(config: Any, section: dict[str, Any]) -> None:
    from .transport import engine_name

    engine = engine_name(section)
    if engine == "ngtcp2":
        from .ngtcp2.connection import require

        require()  # a PluginError naming what to install where it was chosen and not built
    size, most = section["datagram_size"], MAX_DATAGRAM[engine]
    if size and not MIN_DATAGRAM <= size <= most:
        raise ConfigError(f"config key 'transport.quic.datagram_size': value {size} is not valid on the {engine} "
                          f"engine; valid: 0 (the path MTU less IP and UDP headers) or {MIN_DATAGRAM}..{most}")
    if section["insecure_dev_mode"] or section["secret"] or config["security.secret"]:
        return
    from . import credentials as cred
    from .tls import _ca_files

    cert, key = _ca_files(section)  # a ConfigError saying how to make or name them, when there are none
    try:
        cred.read_authority(cert, key)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"transport.quic: cannot use the CA {cert} / {key}: {exc}") from None
