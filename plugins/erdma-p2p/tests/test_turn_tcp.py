"""TURN over TCP and TLS (``erdma_p2p.turn_tcp.TcpDatagrams``) against a local stream server: messages come out
whole, one per ``recvfrom``, however the stream or TLS records cut them; a certificate from another CA is
refused. No network beyond loopback, no coturn (the NAT bed's tests run coturn: test_nat.py)."""

from __future__ import annotations

import select
import socket
import ssl
import struct
import threading
import time
from pathlib import Path

import pytest
from erdma_p2p.lab import certs
from erdma_p2p.turn_tcp import TcpDatagrams

STUN_MSG = struct.pack("!HHI12s", 0x0101, 8, 0x2112A442, b"x" * 12) + b"attrdata"  # 28 bytes
CHANNEL = struct.pack("!HH", 0x4000, 5) + b"hello"  # ChannelData of 5 bytes, padded to 8 on a stream


def _server(tmp: Path, tls: bool, pieces: list[bytes], gap: float = 0.05) -> tuple[tuple[str, int], threading.Thread]:
    """A listener on loopback that, once a client connects, writes ``pieces`` one by one (``gap`` apart)."""
    listener = socket.create_server(("127.0.0.1", 0))
    context = None
    if tls:
        certs.write(tmp, "127.0.0.1")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tmp / "turn-cert.pem", tmp / "turn-key.pem")

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            if context is not None:
                conn = context.wrap_socket(conn, server_side=True)
            for piece in pieces:
                conn.sendall(piece)
                time.sleep(gap)
            time.sleep(0.5)
        except (OSError, ssl.SSLError):
            pass
        finally:
            conn.close()
            listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname(), thread


def _read_all(stream: TcpDatagrams, want: int, timeout: float = 30.0) -> list[bytes]:
    """Messages as the transport's loop reads them: non-blocking reads after the descriptor is readable."""
    stream.setblocking(False)
    got: list[bytes] = []
    end = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < end:
        select.select([stream], [], [], 0.05)
        while True:
            try:
                got.append(stream.recvfrom(65536)[0])
            except BlockingIOError:
                break
    return got


@pytest.mark.parametrize("tls", [False, True])
def test_messages_come_whole_however_the_stream_cuts_them(tmp_path, tls):
    padded = CHANNEL + b"\0" * 3
    whole = STUN_MSG + padded + STUN_MSG
    pieces = [whole[:3], whole[3:30], whole[30:31], whole[31:]]  # a header cut, a frame across pieces
    server, thread = _server(tmp_path, tls, pieces)
    context = ssl.create_default_context(cafile=str(tmp_path / "turn-ca.pem")) if tls else None
    stream = TcpDatagrams.connect(server, 5.0, context)
    try:
        assert _read_all(stream, 3) == [STUN_MSG, CHANNEL, STUN_MSG]  # ChannelData without its padding
    finally:
        stream.close()
        thread.join(5)


@pytest.mark.parametrize("records", [1, 10])
def test_over_tls_every_message_is_read_before_a_read_says_nothing(tmp_path, records):
    """Ten messages in one TLS record, or in ten records written back to back: all ten are read, and only then
    does a read say there is nothing."""
    pieces = [STUN_MSG * 10] if records == 1 else [STUN_MSG] * 10
    server, thread = _server(tmp_path, True, pieces, gap=0.0)
    stream = TcpDatagrams.connect(server, 5.0, ssl.create_default_context(cafile=str(tmp_path / "turn-ca.pem")))
    try:
        assert _read_all(stream, 10) == [STUN_MSG] * 10
        with pytest.raises(BlockingIOError):
            stream.recvfrom(65536)
    finally:
        stream.close()
        thread.join(5)


def test_over_tls_a_server_certificate_from_another_ca_is_refused(tmp_path):
    server, thread = _server(tmp_path, True, [STUN_MSG])
    certs.authority(tmp_path, "other-ca")
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        TcpDatagrams.connect(server, 5.0, ssl.create_default_context(cafile=str(tmp_path / "other-ca.pem")))
    thread.join(5)


def test_a_write_reaches_only_the_server(tmp_path):
    server, thread = _server(tmp_path, False, [])
    stream = TcpDatagrams.connect(server, 5.0)
    try:
        with pytest.raises(OSError, match="reaches only its server"):
            stream.sendto(STUN_MSG, ("127.0.0.1", 9))
    finally:
        stream.close()
        thread.join(5)
