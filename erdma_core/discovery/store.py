"""Discovery stores: ``TCPStore`` (served by one rank) and ``FileStore`` (a shared folder); the ``Store``
protocol they implement is ``erdma_core.protocol.store``.

Every call takes a timeout; ``get`` waits for the key to appear. Values are bytes. The TCP store answers only
connections that proved the job's secret, and bounds every request before reading it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
import time
from pathlib import Path

from ..config.schema import MAX_TIMEOUT
from ..errors import AuthenticationError, CollectiveTimeoutError, ErdmaError, ProtocolError
from ..net.sockets import close_gently, dial, recv_exact
from ..security import auth
from ..security.admission import HANDSHAKE_S
from ..security.gate import POLL, Gate, Handshake

log = logging.getLogger("erdma.discovery")

_SET, _GET, _ADD, _CAS = 1, 2, 3, 4
_CAS_LEN = struct.Struct("<I")  # a compare_set value: length of the expected value, expected, desired
_REQ = struct.Struct("<BdII")  # op, timeout, key length, value length
_RESP = struct.Struct("<BI")  # status (0 ok, 1 timeout, 2 refused), value length
MAX_KEY = 4096  # bytes of a key
MAX_VALUE = 16 << 20  # bytes of a value
MAX_CLIENTS = 256  # proven connections at once (ranks, torch's helpers)
MAX_UNPROVEN = 512  # connections still in their handshake (``gate.Gate``; a client refused tries again)
PER_SOURCE = 32  # of them from one address (the ranks of a host start at once)


def cas_body(expected: bytes, desired: bytes) -> bytes:
    return _CAS_LEN.pack(len(expected)) + expected + desired


def cas_apply(data: dict[str, bytes], key: str, body: bytes) -> bytes:
    """``compare_set`` on a dict: set ``key`` to the desired value when it holds the expected one (an
    absent key holds b""); return what ``key`` holds afterwards."""
    (n,) = _CAS_LEN.unpack_from(body)
    if n > len(body) - _CAS_LEN.size:
        raise ProtocolError(f"compare_set: expected value of {n} bytes in a body of {len(body)}")
    expected, desired = body[_CAS_LEN.size:_CAS_LEN.size + n], body[_CAS_LEN.size + n:]
    if data.get(key, b"") == expected:
        data[key] = desired
    return data.get(key, b"")


def _timeout(key: str, timeout: float, where: str) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(f"discovery: key {key!r} did not appear in {where} within {timeout:.1f}s "
                                  f"(are all ranks started with the same init_method and world size?)")


def parse_request(head: bytes) -> tuple[int, float, int, int]:
    """``(op, timeout, key length, value length)`` of a store request header; ProtocolError when any is out
    of bounds (checked before anything is read or allocated)."""
    op, timeout, klen, vlen = _REQ.unpack(head)
    if op not in (_SET, _GET, _ADD, _CAS):
        raise ProtocolError(f"unknown store op {op}")
    if not 0.0 <= timeout <= MAX_TIMEOUT:  # also refuses nan
        raise ProtocolError(f"store request timeout {timeout!r} is not in [0, {MAX_TIMEOUT:.0f}] seconds")
    if klen > MAX_KEY:
        raise ProtocolError(f"store key of {klen} bytes exceeds {MAX_KEY}")
    limit = MAX_VALUE if op in (_SET, _CAS) else 32
    if vlen > limit:
        raise ProtocolError(f"store value of {vlen} bytes exceeds {limit}")
    if op == _CAS and vlen < _CAS_LEN.size:
        raise ProtocolError(f"store compare_set value of {vlen} bytes is shorter than its {_CAS_LEN.size}-byte length")
    return op, timeout, klen, vlen


class _Server:
    """The store's server: handshakes through a ``gate.Gate`` on one thread (bounded in time and number,
    in all and per address, so that connections that cannot prove the secret never keep a rank out), then a
    thread per proven client (at most ``MAX_CLIENTS``)."""

    def __init__(self, addr: tuple[str, int], key: bytes) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.clients = threading.BoundedSemaphore(MAX_CLIENTS)
        self.serving = 0  # proven clients connected now (under ``cond``)
        self.sock = socket.create_server(addr, backlog=1024)  # SO_REUSEADDR: a restarted store binds at once
        self.server_address = self.sock.getsockname()
        self.gate = Gate([self.sock], lambda sock: auth.StoreServer(key), self._proven, what="store", log=log,
                         limit=MAX_UNPROVEN, per_source=PER_SOURCE)
        self._thread = threading.Thread(target=self.gate.run, name="erdma-store", daemon=True)
        self._thread.start()

    def _proven(self, sock: socket.socket, hs: Handshake, where: str) -> None:
        assert isinstance(hs, auth.StoreServer)
        if not hs.proven:
            self.gate.refuse(sock, where, "it could not prove the job's secret")
            return
        if not self.clients.acquire(blocking=False):
            self.gate.refuse(sock, where, f"{MAX_CLIENTS} clients were connected already")
            return
        threading.Thread(target=self._client, args=(sock, where), name="erdma-store-client", daemon=True).start()

    def _client(self, sock: socket.socket, where: str) -> None:
        with self.cond:
            self.serving += 1
        try:
            sock.setblocking(True)
            self._serve(sock)
        except (ConnectionError, OSError, struct.error) as exc:
            log.debug("store: connection from %s ended: %s", where, exc)
        except ProtocolError as exc:
            log.warning("store: dropped the connection from %s: %s", where, exc)
        finally:
            self.clients.release()
            close_gently(sock)
            with self.cond:
                self.serving -= 1
                self.cond.notify_all()

    def _serve(self, sock: socket.socket) -> None:
        while True:
            op, timeout, klen, vlen = parse_request(recv_exact(sock, _REQ.size))
            key = recv_exact(sock, klen).decode(errors="replace")
            value = recv_exact(sock, vlen)
            status, out = 0, b""
            with self.cond:
                if op == _SET:
                    self.data[key] = value
                    self.cond.notify_all()
                elif op == _ADD:
                    try:
                        n = int(self.data.get(key, b"0")) + int(value)
                    except ValueError:
                        status = 2
                    else:
                        self.data[key] = out = str(n).encode()
                        self.cond.notify_all()
                elif op == _CAS:
                    out = cas_apply(self.data, key, value)
                    self.cond.notify_all()
                elif self.cond.wait_for(lambda k=key: k in self.data, timeout=timeout):  # type: ignore[misc]
                    out = self.data[key]
                else:
                    status = 1
            sock.sendall(_RESP.pack(status, len(out)) + out)

    def close(self) -> None:
        self.gate.stop = True
        self._thread.join(2 * POLL + 1.0)
        self.sock.close()

    def wait_served(self, clients: int, seconds: float) -> bool:
        """Until at most ``clients`` are connected (True) or ``seconds`` passed (False)."""
        with self.cond:
            return self.cond.wait_for(lambda: self.serving <= clients, seconds)


class TCPStore:
    """A store served by the rank with ``is_server``; clients retry connecting until ``timeout``, and wait for
    an answer up to a request's own wait plus ``timeout`` (at least 5 s: a lossy link retransmits slowly).
    Every connection proves it knows ``secret`` (both ways: ``auth.StoreClient``) before any request."""

    def __init__(self, host: str, port: int, *, is_server: bool, timeout: float, secret: bytes = b"",
                 served_by: str = "the process that serves it") -> None:
        """``served_by``: who serves the store, as a client's error names it when the store goes away."""
        self.host, self.port = host, port
        self.served_by = served_by
        self._key = auth.store_key(secret)
        self._server: _Server | None = None
        if is_server:
            bind = _bindable(host)
            auth.warn_if_exposed(bind or "0.0.0.0", secret, "the discovery store")
            try:
                self._server = _Server((bind, port), self._key)
            except OSError as exc:
                raise ErdmaError(f"discovery: rank 0 cannot serve the store on {host}:{port}: {exc} (is another "
                                 "rank 0 of this job running, or another program on that port?)") from None
            self.port = self._server.server_address[1]
        self._lock = threading.Lock()
        self._grace = max(5.0, timeout)  # seconds an answer may take beyond the request's own wait (a lossy link)
        self._sock = self._dial(timeout)

    def _dial(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        where = f"{self.host}:{self.port}"
        while True:
            try:
                sock = dial(self.host, self.port, deadline)
            except OSError as exc:
                raise CollectiveTimeoutError(f"discovery: cannot reach the store at {where} within {timeout:.1f}s: "
                                             f"{exc}") from None
            try:
                sock.settimeout(max(0.1, min(HANDSHAKE_S, deadline - time.monotonic())))
                hs = auth.StoreClient(self._key, where)
                sock.sendall(hs.first())
                sock.sendall(hs.on_challenge(recv_exact(sock, auth.NONCE + auth.MAC)))
                if recv_exact(sock, 1) != b"\0":
                    raise AuthenticationError(f"the store at {where} refused this rank: it does not know the "
                                              "job's secret (security.secret differs from rank 0's)")
            except (OSError, ConnectionError) as exc:  # dropped mid-handshake (a crowded store): try again
                sock.close()
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(f"discovery: the store at {where} did not complete the "
                                                 f"handshake within {timeout:.1f}s: {exc}") from None
                time.sleep(0.05)
                continue
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock

    def _call(self, op: int, key: str, value: bytes, timeout: float) -> tuple[int, bytes]:
        k = key.encode()
        if len(k) > MAX_KEY or len(value) > MAX_VALUE:
            raise ErdmaError(f"discovery: store key {key[:60]!r} ({len(k)} bytes) or its value ({len(value)} bytes) "
                             f"exceeds the store's limits ({MAX_KEY} and {MAX_VALUE} bytes)")
        with self._lock:
            self._sock.settimeout(timeout + self._grace)
            try:
                self._sock.sendall(_REQ.pack(op, timeout, len(k), len(value)) + k + value)
                status, n = _RESP.unpack(recv_exact(self._sock, _RESP.size))
                out = recv_exact(self._sock, n)
            except TimeoutError:  # (not a CollectiveTimeoutError: a wait for a key did not end, the store hangs)
                raise ErdmaError(f"discovery: the store at {self.host}:{self.port} did not answer within "
                                 f"{timeout + self._grace:.1f}s; {self.served_by} hangs or the path to it is "
                                 "down") from None
            except (OSError, ConnectionError) as exc:  # closed or reset: whoever serves it is gone
                raise ErdmaError(f"discovery: the store at {self.host}:{self.port} is gone ({exc}): {self.served_by} "
                                 f"has exited or failed, and this rank cannot go on without it (the cause is "
                                 f"{self.served_by}'s own error)") from None
        if status == 2:
            raise ErdmaError(f"discovery: the store refused {key!r}: it does not hold a number")
        return status, out

    def set(self, key: str, value: bytes) -> None:
        self._call(_SET, key, value, 1.0)

    def get(self, key: str, timeout: float) -> bytes:
        status, value = self._call(_GET, key, b"", timeout)
        if status:
            raise _timeout(key, timeout, f"the store at {self.host}:{self.port}")
        return value

    def add(self, key: str, amount: int) -> int:
        return int(self._call(_ADD, key, str(amount).encode(), 1.0)[1])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(_CAS, key, cas_body(expected, desired), 1.0)[1]

    def linger(self, seconds: float) -> None:
        """The serving rank, whose set-up failed: go on serving until the other ranks' clients have left (each
        read why in the store and gave up) or ``seconds`` passed, so that none finds the store gone instead."""
        if self._server is not None:
            self._server.wait_served(1, seconds)  # (1: this rank's own client)

    def close(self) -> None:
        self._sock.close()
        if self._server is not None:
            self._server.close()


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

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with open(self.path / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                held = self._file(key).read_bytes()
            except FileNotFoundError:
                held = b""
            if held != expected:
                return held
            self.set(key, desired)
            return desired

    def close(self) -> None:
        pass

    def cleanup(self) -> None:
        for entry in self.path.iterdir():
            entry.unlink(missing_ok=True)
