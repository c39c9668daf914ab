"""Discovery stores: the ``Store`` interface, ``TCPStore`` (served by one rank) and ``FileStore`` (a shared folder).

Every call takes a timeout; ``get`` waits for the key to appear. Values are bytes.
"""

from __future__ import annotations

import fcntl
import os
import socket
import socketserver
import struct
import threading
import time
from pathlib import Path
from typing import Protocol

from ..errors import CollectiveTimeoutError, ErdmaError
from ..transport.sockets import dial, recv_exact

_SET, _GET, _ADD = 1, 2, 3
_REQ = struct.Struct("<BdII")  # op, timeout, key length, value length
_RESP = struct.Struct("<BI")  # status (0 ok, 1 timeout), value length


class Store(Protocol):
    """What a discovery method gives every rank of a job: the same key-value store. ``set`` publishes,
    ``get`` waits up to ``timeout`` seconds for a key to appear (else ``CollectiveTimeoutError``), ``add``
    is an atomic counter, ``close`` releases what this rank holds. Optional: ``host`` (the host ranks reach
    the store at; the TCP transport advertises the address that routes there) and ``cleanup()`` (called by
    rank 0 at the end of the job)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def close(self) -> None: ...


def _timeout(key: str, timeout: float, where: str) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(f"discovery: key {key!r} did not appear in {where} within {timeout:.1f}s "
                                  f"(are all ranks started with the same init_method and world size?)")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int]) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        super().__init__(addr, _Handler)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: _Server = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        try:
            while True:
                op, timeout, klen, vlen = _REQ.unpack(recv_exact(sock, _REQ.size))
                key = recv_exact(sock, klen).decode()
                value = recv_exact(sock, vlen)
                status, out = 0, b""
                with srv.cond:
                    if op == _SET:
                        srv.data[key] = value
                        srv.cond.notify_all()
                    elif op == _ADD:
                        n = int(srv.data.get(key, b"0")) + int(value)
                        srv.data[key] = str(n).encode()
                        out = srv.data[key]
                        srv.cond.notify_all()
                    elif op == _GET:
                        if srv.cond.wait_for(lambda k=key: k in srv.data, timeout=timeout):
                            out = srv.data[key]
                        else:
                            status = 1
                sock.sendall(_RESP.pack(status, len(out)) + out)
        except (ConnectionError, OSError, struct.error):
            return


class TCPStore:
    """A store served by the rank with ``is_server``; clients retry connecting until ``timeout``."""

    def __init__(self, host: str, port: int, *, is_server: bool, timeout: float) -> None:
        self.host, self.port = host, port
        self._server: _Server | None = None
        if is_server:
            self._server = _Server((_bindable(host), port))
            self.port = self._server.server_address[1]
            threading.Thread(target=self._server.serve_forever, name="erdma-store", daemon=True).start()
        self._lock = threading.Lock()
        self._sock = self._dial(timeout)

    def _dial(self, timeout: float) -> socket.socket:
        try:
            sock = dial(self.host, self.port, time.monotonic() + timeout)
        except OSError as exc:
            raise CollectiveTimeoutError(f"discovery: cannot reach the store at {self.host}:{self.port} "
                                         f"within {timeout:.1f}s: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _call(self, op: int, key: str, value: bytes, timeout: float) -> tuple[int, bytes]:
        k = key.encode()
        with self._lock:
            self._sock.settimeout(timeout + 5.0)
            try:
                self._sock.sendall(_REQ.pack(op, timeout, len(k), len(value)) + k + value)
                status, n = _RESP.unpack(recv_exact(self._sock, _RESP.size))
                return status, recv_exact(self._sock, n)
            except (OSError, ConnectionError) as exc:
                raise ErdmaError(f"discovery store at {self.host}:{self.port} failed: {exc}") from exc

    def set(self, key: str, value: bytes) -> None:
        self._call(_SET, key, value, 1.0)

    def get(self, key: str, timeout: float) -> bytes:
        status, value = self._call(_GET, key, b"", timeout)
        if status:
            raise _timeout(key, timeout, f"the store at {self.host}:{self.port}")
        return value

    def add(self, key: str, amount: int) -> int:
        return int(self._call(_ADD, key, str(amount).encode(), 1.0)[1])

    def close(self) -> None:
        self._sock.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _bindable(host: str) -> str:
    """Bind the store to ``host`` when it is an address of this machine, else to every interface."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
        return host
    except OSError:
        return ""


class FileStore:
    """A store in a folder every rank can reach (one file per key, written atomically). The folder must be
    new for each job: rank 0 empties it when the job's default group is destroyed (``cleanup``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def _file(self, key: str) -> Path:
        return self.path / key.replace("/", "%2F")

    def set(self, key: str, value: bytes) -> None:
        tmp = self.path / f".tmp.{os.getpid()}.{threading.get_ident()}"
        tmp.write_bytes(value)
        tmp.replace(self._file(key))

    def get(self, key: str, timeout: float) -> bytes:
        deadline, delay = time.monotonic() + timeout, 0.005
        while True:
            try:
                return self._file(key).read_bytes()
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise _timeout(key, timeout, f"the folder {self.path}") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.2)

    def add(self, key: str, amount: int) -> int:
        with open(self.path / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                n = int(self._file(key).read_bytes()) + amount
            except FileNotFoundError:
                n = amount
            self.set(key, str(n).encode())
            return n

    def close(self) -> None:
        pass

    def cleanup(self) -> None:
        for entry in self.path.iterdir():
            entry.unlink(missing_ok=True)
