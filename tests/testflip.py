"""A traversal for the tests, installed by ``install_plugin("testflip", "testflip")``: peers dial each rank
through a proxy in that rank's own process, which changes one byte of one frame on the way, as a faulty NIC,
a middlebox or someone on the path would.

``[traversal.flip]``: ``toward`` ("listener": the bytes the dialling rank sends; "dialler": the answers),
``frame`` (which frame, counting only those with a payload of at least ``min_payload`` bytes, from 0) and
``offset`` (the byte in that frame: 0-63 its header, 64-87 its seal, then its payload and the payload's
16-byte tag; negative: from the frame's end). The proxy follows the TCP transport's framing after the
handshake (``auth``)."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

from erdma_core import hookimpl
from erdma_core.config import Option
from erdma_core.security import auth, integrity
from erdma_core.wire import FRAME

_HANDSHAKE = {"listener": auth.HELLO.size + auth.MAC, "dialler": 2 * auth.HELLO.size + auth.MAC}
_HEAD = FRAME.size + integrity.SEAL.size
_NBYTES = struct.Struct("<Q")  # the header's last field


class _Flipper:
    """Bytes of one direction, passed on as they come, with one byte of the chosen frame inverted."""

    def __init__(self, skip: int, frame: int, offset: int, min_payload: int) -> None:
        self.skip, self.frame, self.offset, self.min_payload = skip, frame, offset, min_payload
        self.buf = bytearray()  # bytes of the frame being parsed, up to its header and seal
        self.left = 0  # payload bytes of the current frame still to pass
        self.index = -1  # which frame (of those counted) the current one is
        self.at = 0  # bytes of the current frame passed so far
        self.target = -1  # the current frame's byte to flip (-1: none)
        self.done = False

    def feed(self, data: bytearray) -> bytearray:
        out = bytearray()
        i = 0
        while i < len(data):
            if self.skip:
                n = min(self.skip, len(data) - i)
                out += data[i:i + n]
                self.skip -= n
                i += n
            elif self.done:
                out += data[i:]
                break
            elif self.left:
                n = min(self.left, len(data) - i)
                piece = data[i:i + n]
                if 0 <= self.target - self.at < n:
                    piece[self.target - self.at] ^= 0xFF
                    self.done = True
                out += piece
                self.left -= n
                self.at += n
                i += n
            else:
                n = min(_HEAD - len(self.buf), len(data) - i)
                self.buf += data[i:i + n]
                i += n
                if len(self.buf) < _HEAD:
                    continue
                nbytes = _NBYTES.unpack_from(self.buf, FRAME.size - 8)[0]
                self.at, self.left, self.target = 0, nbytes + integrity.trailer(nbytes), -1
                if nbytes >= self.min_payload:
                    self.index += 1
                    if self.index == self.frame:
                        self.target = self.offset if self.offset >= 0 else _HEAD + self.left + self.offset
                if 0 <= self.target < _HEAD:
                    self.buf[self.target] ^= 0xFF
                    self.done = True
                self.at = _HEAD
                out += self.buf  # a target in the payload is flipped as it passes
                self.buf = bytearray()
        return out


def _pump(src: socket.socket, dst: socket.socket, flipper: _Flipper | None) -> None:
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(flipper.feed(bytearray(data)) if flipper is not None else data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class FlipTraversal:
    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        self.opts = section

    def advertise(self, host: str, port: int) -> tuple[str, int]:
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, args=(listener, (host, port)), daemon=True).start()
        return "127.0.0.1", listener.getsockname()[1]

    def _serve(self, listener: socket.socket, target: tuple[str, int]) -> None:
        o = self.opts
        while True:
            inbound, _ = listener.accept()
            outbound = socket.create_connection(target)
            flip = _Flipper(_HANDSHAKE[o["toward"]], o["frame"], o["offset"], o["min_payload"])
            to_listener = flip if o["toward"] == "listener" else None
            to_dialler = flip if o["toward"] == "dialler" else None
            threading.Thread(target=_pump, args=(inbound, outbound, to_listener), daemon=True).start()
            threading.Thread(target=_pump, args=(outbound, inbound, to_dialler), daemon=True).start()


@hookimpl
def erdma_register_traversals(register: Any) -> None:
    register("flip", FlipTraversal, description="tests: a proxy that changes one byte of one frame", options={
        "toward": Option(str, "listener", "which direction's bytes", choices=("listener", "dialler")),
        "frame": Option(int, 0, "which frame, counting those with at least min_payload bytes", minimum=0),
        "offset": Option(int, 0, "which byte of it (negative: from its end)"),
        "min_payload": Option(int, 4096, "frames with smaller payloads are not counted", minimum=0),
    })
