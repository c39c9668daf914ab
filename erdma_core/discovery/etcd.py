"""``etcd://HOST:PORT[,HOST:PORT...]/PREFIX``: a job's store on an etcd cluster, so that no process of the job
serves it: an elastic job goes on while a majority of the cluster's members is up, whoever started it.
It speaks etcd's v3 API through etcd's own JSON gateway (``/v3/kv/...``, ``/v3/watch``, ``/v3/lease/...``)
with the standard library's HTTP client: nothing to install on the peers. ``hold``/``renew`` keep a
key alive under a lease (an elastic member's sign of life: etcd deletes it once the member stops renewing),
``set_leased`` puts a new value under it, and ``changes`` watches every key under a prefix.

Keys live under ``PREFIX/``, one prefix per job. Every value is sealed with the job's secret (HMAC-SHA256 of
the key and the value, 16 bytes appended), so a value written by someone without the secret, or copied from
another key, is refused with AuthenticationError even where etcd is open to whoever reaches it. A sealed
value replayed into the same key by someone with write access to etcd is not detected: etcd's own TLS and
users (``[discovery.etcd]``) keep writers out.

The calls: ``set`` is a put; ``compare_set`` one transaction (the sealed expected value, or the key's
absence, then a put, else a read); ``add`` a read and a transaction on the key's revision, which also writes
the result under a key of its own for that call (with a lease of ``NONCE_TTL_S``), so that a call repeated
after its answer was lost finds what it did instead of adding twice; ``get`` reads, then watches the key from
the read's revision (no polling). A member that cannot be reached, or that says the cluster has no leader,
passes the call to the next member; while none can serve it (no quorum) the call waits, saying so once, up
to ``quorum_wait`` seconds, then fails naming each member's last error.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import logging
import math
import os
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from ..config.option import Option
from ..config.schema import MAX_TIMEOUT
from ..errors import AuthenticationError, CollectiveTimeoutError, ConfigError, ErdmaError
from ..security import auth

log = logging.getLogger("erdma.discovery")

TAG = 16  # bytes of a value's seal
REQUEST_S = 1.0  # one HTTP request's bound: then the next member (etcd answers a proposal made while it had no
# leader only after 7 s, "request timed out"; an election takes ~1 s; what timed out is retried safely)
SUSPECT_S = 0.3  # the bound after a member failed a call, a quarter longer with each round of members that fails
# too, up to REQUEST_S: etcd drops a proposal made before the others elected a new leader, so while they may be
# electing, a call is sent again soon instead of waiting for an answer that never comes
QUIET_S = 3.0  # no member served a call for this long: said as a warning (a leader's death costs an election,
# 1-2 s with etcd's defaults, which every peer would otherwise report as an outage)
NONCE_TTL_S = 600  # seconds an add's own record lives (a retry comes within quorum_wait)
RETRYABLE = {4, 14}  # gRPC codes in the gateway's answers that another member, or later, may serve:
# DEADLINE_EXCEEDED ("request timed out"), UNAVAILABLE ("no leader")

OPTIONS = {
    "quorum_wait": Option(float, 120.0, "seconds a store call waits while no etcd member can serve it (a "
                          "majority is down, or none is reachable) before it fails; it says once that it "
                          "waits", minimum=0.1, maximum=MAX_TIMEOUT),
    "ca_file": Option(str, "", "CA certificates to verify the members' TLS certificates with; set (or "
                      "cert_file set): the members are reached over https"),
    "cert_file": Option(str, "", "client certificate (PEM) for etcd's TLS client authentication"),
    "key_file": Option(str, "", "the client certificate's private key (PEM); empty: it is in cert_file"),
    "user": Option(str, "", "etcd user (etcd's own authentication); empty: none"),
    "password": Option(str, "", "that etcd user's password", secret=True),
}


class _Retry(Exception):
    """This member cannot serve the call now; another may, or this one later."""


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _get(d: dict[str, Any], name: str) -> Any:
    """A field of the gateway's answer, under its proto name or its JSON (lowerCamelCase) name."""
    if name in d:
        return d[name]
    head, *rest = name.split("_")
    return d.get(head + "".join(w.title() for w in rest))


class EtcdStore:
    """A job's store under ``prefix`` on the etcd members at ``endpoints`` (see the module's docstring)."""

    def __init__(self, endpoints: list[tuple[str, int]], prefix: str, *, secret: bytes, quorum_wait: float,
                 tls: ssl.SSLContext | None = None, user: str = "", password: str = "") -> None:
        self.endpoints, self.quorum_wait, self._tls = endpoints, quorum_wait, tls
        self.host = endpoints[0][0]  # the TCP transport advertises the address that routes towards the store
        self._prefix = prefix.strip("/") + "/"
        self._seal_key = auth.derive(secret, b"etcd-record")
        self._user, self._password = user, password
        self._lock = threading.Lock()  # one call at a time on the shared connections (a get's watch has its own)
        self._conns: dict[int, http.client.HTTPConnection] = {}
        self._tokens: dict[int, str] = {}
        self._at = 0  # the member tried first
        self._lease = (0, 0.0)  # (id, renew after): the lease an add's own record lives under
        self._bound = REQUEST_S  # one request's bound now (SUSPECT_S and up after a member failed a call)
        self.where = ",".join(f"{h}:{p}" for h, p in endpoints)

    # ---- the calls ----------------------------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        k = self._key(key)
        self._call("/v3/kv/put", {"key": _b64(k), "value": _b64(self._seal(k, value))})

    def get(self, key: str, timeout: float) -> bytes:
        k = self._key(key)
        deadline = time.monotonic() + timeout
        while True:
            out = self._call("/v3/kv/range", {"key": _b64(k)})
            kvs = out.get("kvs")
            if kvs:
                return self._open(k, kvs[0].get("value", ""))
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"discovery: key {key!r} did not appear in etcd at {self.where} (prefix {self._prefix!r}) "
                    f"within {timeout:.1f}s (are all ranks started with the same init_method and world size?)")
            found = self._watch(k, int(_get(out["header"], "revision")) + 1, deadline)
            if found is not None:
                return found

    def add(self, key: str, amount: int) -> int:
        k = self._key(key)
        mine = self._key(f".add/{os.urandom(12).hex()}")
        while True:
            out = self._call("/v3/kv/range", {"key": _b64(k)})
            kvs = out.get("kvs")
            held = self._open(k, kvs[0].get("value", "")) if kvs else b"0"
            try:
                n = int(held) + amount
            except ValueError:
                raise ErdmaError(f"discovery: the store refused {key!r}: it does not hold a number") from None
            same = ({"key": _b64(k), "target": "MOD", "mod_revision": _get(kvs[0], "mod_revision")} if kvs
                    else {"key": _b64(k), "target": "CREATE", "create_revision": "0"})
            value = _b64(self._seal(k, str(n).encode()))
            out = self._call("/v3/kv/txn", {
                "compare": [same],
                "success": [{"request_put": {"key": _b64(k), "value": value}},
                            {"request_put": {"key": _b64(mine), "value": value, "lease": self._add_lease()}}],
                "failure": [{"request_range": {"key": _b64(mine)}}]})
            if out.get("succeeded"):
                return n
            done = _get(out["responses"][0], "response_range").get("kvs")
            if done:  # an earlier try of this very call took effect, and its answer was lost
                return int(self._open(k, done[0].get("value", "")))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        k = self._key(key)
        put = [{"request_put": {"key": _b64(k), "value": _b64(self._seal(k, desired))}}]
        read = [{"request_range": {"key": _b64(k)}}]
        holds = {"key": _b64(k), "target": "VALUE", "value": _b64(self._seal(k, expected))}
        held = b""  # an absent key compares as empty, and so does a key that holds b""
        for same in ([holds] if expected else [{"key": _b64(k), "target": "CREATE", "create_revision": "0"}, holds]):
            out = self._call("/v3/kv/txn", {"compare": [same], "success": put, "failure": read})
            if out.get("succeeded"):
                return desired
            kvs = _get(out["responses"][0], "response_range").get("kvs")
            held = self._open(k, kvs[0].get("value", "")) if kvs else b""
            if held != expected:
                break
        return held

    # ---- leases: a key that lives while its holder renews it --------------------------------------------
    def hold(self, key: str, value: bytes, ttl: float) -> int:
        """Put ``key`` under a lease of its own of ``ttl`` seconds (rounded up; etcd grants at least its
        minimum, about 1.5 election timeouts) and return the lease. Once nobody renews the lease (``renew``)
        for its TTL, as etcd's leader counts it, etcd deletes the key: a reader then finds it gone."""
        asked = max(1, math.ceil(ttl))
        granted = self._call("/v3/lease/grant", {"TTL": str(asked)})
        lease = int(granted["ID"])
        if int(granted.get("TTL") or asked) > asked:
            log.warning("discovery: etcd at %s granted a lease of %ss where %ss was asked (its minimum TTL): a "
                        "holder that stops is found that much later", self.where, granted["TTL"], asked)
        k = self._key(key)
        self._call("/v3/kv/put", {"key": _b64(k), "value": _b64(self._seal(k, value)), "lease": str(lease)})
        return lease

    def renew(self, lease: int) -> bool:
        """Renew ``lease`` for its whole TTL; False when it had already expired (its keys are gone)."""
        out = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(_get(out.get("result", out), "TTL") or 0) > 0

    def set_leased(self, key: str, value: bytes, lease: int) -> None:
        """Put ``key`` under ``lease`` (from ``hold``): a new value that goes with the lease."""
        k = self._key(key)
        self._call("/v3/kv/put", {"key": _b64(k), "value": _b64(self._seal(k, value)), "lease": str(lease)})

    def changes(self, prefix: str, revision: int, timeout: float) -> tuple[list[tuple[str, bytes | None]], int]:
        """What happened under ``prefix`` from ``revision`` on, as it comes for ``timeout`` seconds: (key under
        the prefix, value) for a put, (key, None) for a deletion (a lease that ran out), and the revision to
        go on from. ``revision`` 0, or one etcd compacted away: the keys there now, as puts, first. A watch
        that a member ends is taken up on the next member from the same revision, so nothing is missed; when
        no member served any of the time, ErdmaError. A value not sealed with the job's secret is left out."""
        start = self._key(prefix)
        end = start[:-1] + bytes([start[-1] + 1])
        out: list[tuple[str, bytes | None]] = []
        if revision <= 0:
            revision = self._scan(start, end, out)
        deadline = time.monotonic() + timeout
        served = False
        while (left := deadline - time.monotonic()) > 0:
            try:
                revision, compacted = self._watch_range(start, end, revision, left, out)
                served = True
            except _Retry:
                self._at = (self._at + 1) % len(self.endpoints)  # take the watch up on the next member
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            if compacted:
                revision = self._scan(start, end, out)
        if not served:
            raise ErdmaError(f"discovery: no etcd member of {self.where} served a watch of {prefix!r} for "
                             f"{timeout:.2f}s")
        return out, revision

    def _scan(self, start: bytes, end: bytes, out: list[tuple[str, bytes | None]]) -> int:
        """The keys in [start, end) now, as puts onto ``out``; the revision to watch from after them."""
        got = self._call("/v3/kv/range", {"key": _b64(start), "range_end": _b64(end)})
        for kv in got.get("kvs") or ():
            self._keep(start, kv, out, deleted=False)
        return int(_get(got["header"], "revision")) + 1

    def _keep(self, start: bytes, kv: dict[str, Any], out: list[tuple[str, bytes | None]], *, deleted: bool) -> None:
        k = base64.b64decode(kv.get("key", ""))
        if deleted:
            out.append((k[len(start):].decode(errors="replace"), None))
            return
        try:
            out.append((k[len(start):].decode(errors="replace"), self._open(k, kv.get("value", ""))))
        except AuthenticationError as exc:
            log.warning("%s", exc)

    def _watch_range(self, start: bytes, end: bytes, revision: int, timeout: float,
                     out: list[tuple[str, bytes | None]]) -> tuple[int, bool]:
        """Events in [start, end) from ``revision`` onto ``out`` for ``timeout`` seconds on the member tried
        first: (the revision after the last one seen, whether etcd compacted ``revision`` away). _Retry when
        the member could not be reached or ended the watch."""
        i = self._at
        try:
            conn = self._connect(i, timeout)
            with self._lock:
                headers = self._headers(i)
            body = {"create_request": {"key": _b64(start), "range_end": _b64(end), "start_revision": str(revision)}}
            conn.request("POST", "/v3/watch", json.dumps(body).encode(), headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException, _Stale) as exc:
            raise _Retry(str(exc)) from None
        deadline = time.monotonic() + timeout
        try:
            if resp.status != 200:
                raise _Retry(f"HTTP {resp.status}")
            for msg in _stream(conn, resp, deadline):
                result = msg.get("result") or {}
                if int(_get(result, "compact_revision") or 0) > 0:
                    return revision, True
                if "error" in msg or result.get("canceled"):
                    raise _Retry(str(msg.get("error") or result.get("cancel_reason") or "watch canceled"))
                for event in result.get("events") or ():
                    kv = event.get("kv") or {}
                    self._keep(start, kv, out, deleted=event.get("type", "PUT") == "DELETE")
                    revision = max(revision, int(_get(kv, "mod_revision") or 0) + 1)
            return revision, False
        except TimeoutError:  # nothing more before the deadline
            return revision, False
        except EOFError:
            raise _Retry("the member ended the watch") from None
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from None
        finally:
            conn.close()

    def close(self) -> None:
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()

    def cleanup(self) -> None:
        """Delete every key of the job (rank 0 at the end of a job that is not elastic)."""
        start = self._prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        self._call("/v3/kv/deleterange", {"key": _b64(start), "range_end": _b64(end)})

    # ---- sealing ------------------------------------------------------------------------------------------
    def _key(self, key: str) -> bytes:
        return (self._prefix + key).encode()

    def _tag(self, k: bytes, value: bytes) -> bytes:
        return hmac.new(self._seal_key, len(k).to_bytes(4, "big") + k + value, hashlib.sha256).digest()[:TAG]

    def _seal(self, k: bytes, value: bytes) -> bytes:
        return value + self._tag(k, value)

    def _open(self, k: bytes, sealed: str) -> bytes:
        raw = base64.b64decode(sealed)
        value, tag = raw[:-TAG], raw[-TAG:]
        if len(raw) < TAG or not hmac.compare_digest(tag, self._tag(k, value)):
            raise AuthenticationError(f"discovery: the value of {k.decode(errors='replace')!r} in etcd at "
                                      f"{self.where} is not sealed with this job's secret (written by a client "
                                      "without security.secret, or copied from another key); refused")
        return value

    # ---- requests -----------------------------------------------------------------------------------------
    def _add_lease(self) -> str:
        lease, renew = self._lease
        if time.monotonic() >= renew:
            lease = int(self._call("/v3/lease/grant", {"TTL": str(NONCE_TTL_S)})["ID"])
            self._lease = lease, time.monotonic() + NONCE_TTL_S / 2
        return str(lease)

    def reach(self, timeout: float) -> None:
        """Raise ErdmaError unless a member answers within ``timeout`` (set-up: a wrong address fails in
        ``timeouts.connect``, not after ``quorum_wait``)."""
        self._call("/v3/kv/range", {"key": _b64(self._key(".reach"))}, min(timeout, self.quorum_wait))

    def _call(self, path: str, body: dict[str, Any], wait: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``path`` on the first member that serves it; while none does, wait up to ``wait``
        (``quorum_wait``), saying so once."""
        data = json.dumps(body).encode()
        wait = self.quorum_wait if wait is None else wait
        started = time.monotonic()
        until = started + wait
        errors: dict[int, str] = {}
        pause, said = 0.05, False
        with self._lock:
            while True:
                for _ in range(len(self.endpoints)):
                    i = self._at
                    try:
                        out = self._post(i, path, data)
                        self._bound = REQUEST_S
                        return out
                    except _Retry as exc:
                        errors[i] = str(exc)
                        self._drop(i)
                        self._at = (i + 1) % len(self.endpoints)
                        self._bound = min(self._bound, SUSPECT_S)
                self._bound = min(1.25 * self._bound, REQUEST_S)
                left = until - time.monotonic()
                if left <= 0:
                    raise ErdmaError(f"discovery: no etcd member served the store within {wait:.1f}s "
                                     "(discovery.etcd.quorum_wait, or timeouts.connect at set-up): " + "; ".join(
                                         f"{h}:{p}: {errors.get(i, '?')}" for i, (h, p) in enumerate(self.endpoints)))
                if not said and time.monotonic() - started >= min(QUIET_S, wait / 2):
                    said = True
                    log.warning("discovery: no etcd member of %s has served the store for %.1fs (%s); waiting up to "
                                "%.0fs more for a majority of them", self.where, time.monotonic() - started,
                                "; ".join(errors.values()), left)
                time.sleep(min(pause, left))
                pause = min(2 * pause, 1.0)

    def _connect(self, i: int, timeout: float) -> http.client.HTTPConnection:
        host, port = self.endpoints[i]
        if self._tls is not None:
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=self._tls)
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _drop(self, i: int) -> None:
        conn = self._conns.pop(i, None)
        if conn is not None:
            conn.close()

    def _headers(self, i: int) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._user:
            if i not in self._tokens:
                out = self._request(i, "/v3/auth/authenticate",
                                    json.dumps({"name": self._user, "password": self._password}).encode(), {})
                self._tokens[i] = out["token"]
            headers["Authorization"] = self._tokens[i]
        return headers

    def _post(self, i: int, path: str, data: bytes) -> dict[str, Any]:
        try:
            return self._request(i, path, data, self._headers(i))
        except _Stale:
            self._tokens.pop(i, None)
            return self._request(i, path, data, self._headers(i))

    def _request(self, i: int, path: str, data: bytes, headers: dict[str, str]) -> dict[str, Any]:
        conn = self._conns.get(i)
        if conn is None:
            conn = self._conns[i] = self._connect(i, self._bound)
        conn.timeout = self._bound
        if conn.sock is not None:
            conn.sock.settimeout(self._bound)
        try:
            conn.request("POST", path, data, headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from None
        try:
            out = json.loads(raw)
        except ValueError:
            if resp.status >= 500:
                raise _Retry(f"HTTP {resp.status}: {raw[:200]!r}") from None
            host, port = self.endpoints[i]
            raise ErdmaError(f"discovery: etcd at {host}:{port} answered {path} with HTTP {resp.status}: "
                             f"{raw[:300].decode(errors='replace').strip()}") from None
        if resp.status == 200 and "error" not in out:
            return out  # type: ignore[no-any-return]
        text = str(out.get("error") or out.get("message") or raw[:200])
        if "invalid auth token" in text:
            raise _Stale(text)
        if resp.status >= 500 or out.get("code") in RETRYABLE:
            raise _Retry(f"HTTP {resp.status}: {text}")
        host, port = self.endpoints[i]
        hint = ""
        if any(w in text for w in ("user name is empty", "authentication failed", "permission denied")):
            hint = (f" ([discovery.etcd] user is {self._user!r}: the cluster's user and password go there, and that "
                    f"user needs read and write on the prefix {self._prefix!r})")
        raise ErdmaError(f"discovery: etcd at {host}:{port} refused {path}: {text}{hint}")

    def _watch(self, k: bytes, revision: int, deadline: float) -> bytes | None:
        """The key's value once a put of it is seen from ``revision`` on, or None at the deadline or when
        the watch ends (the member went away, the revision was compacted): the caller reads again."""
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        i = self._at
        conn = self._connect(i, left)
        try:
            with self._lock:
                headers = self._headers(i)
            body = {"create_request": {"key": _b64(k), "start_revision": str(revision)}}
            conn.request("POST", "/v3/watch", json.dumps(body).encode(), headers)
            resp = conn.getresponse()
            if resp.status != 200:
                return None
            for msg in _stream(conn, resp, deadline):
                result = msg.get("result") or {}
                if "error" in msg or result.get("canceled"):
                    return None
                for event in result.get("events") or ():
                    if event.get("type", "PUT") == "PUT":
                        return self._open(k, event["kv"].get("value", ""))
            return None
        except (TimeoutError, EOFError):  # nothing came before the deadline, or the watch ended: no sign
            # against this member
            return None
        except (OSError, http.client.HTTPException, _Retry, _Stale):
            self._at = (i + 1) % len(self.endpoints)  # this member may be gone: the next read tries another
            return None
        finally:
            conn.close()


def _stream(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
            deadline: float) -> Iterator[dict[str, Any]]:
    """The JSON messages of a watch's answer as they come, until ``deadline``; TimeoutError when nothing
    more came by then, EOFError when the member ended the answer."""
    decoder, buf = json.JSONDecoder(), ""
    while (left := deadline - time.monotonic()) > 0:
        if conn.sock is not None:
            conn.sock.settimeout(left)
        chunk = resp.read1(65536)
        if not chunk:
            raise EOFError
        buf += chunk.decode()
        while buf.strip():
            try:
                msg, end = decoder.raw_decode(buf.lstrip())
            except ValueError:
                break
            buf = buf.lstrip()[end:]
            yield msg


class _Stale(Exception):
    """etcd no longer takes this connection's auth token (it expired): authenticate again."""


def etcd_store(url: str, rank: int, world_size: int, timeout: float, config: Any) -> EtcdStore:
    """``etcd://HOST:PORT[,HOST:PORT...]/PREFIX``: the job's store under PREFIX on that etcd cluster."""
    parsed = urlparse(url)
    endpoints = []
    for part in parsed.netloc.split(","):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"config key 'discovery.init_method': {url!r}: {part!r} is not HOST:PORT; valid: "
                              "etcd://HOST:PORT[,HOST:PORT...]/PREFIX")
        endpoints.append((host.strip("[]"), int(port)))
    prefix = parsed.path.strip("/")
    if not prefix:
        raise ConfigError(f"config key 'discovery.init_method': {url!r} names no prefix for the job's keys; "
                          "valid: etcd://HOST:PORT[,HOST:PORT...]/PREFIX")
    section = config.section("discovery.etcd") if config is not None else {k: o.default for k, o in OPTIONS.items()}
    secret = config["security.secret"] if config is not None else ""
    if not secret:
        log.warning("discovery: security.secret is empty: the job's records in etcd at %s are sealed with a key "
                    "anyone can derive", parsed.netloc)
    tls = None
    if section["ca_file"] or section["cert_file"]:
        try:
            tls = ssl.create_default_context(cafile=section["ca_file"] or None)
            if section["cert_file"]:
                tls.load_cert_chain(section["cert_file"], section["key_file"] or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"config section [discovery.etcd]: ca_file {section['ca_file']!r} / cert_file "
                              f"{section['cert_file']!r} / key_file {section['key_file']!r}: {exc}") from None
    store = EtcdStore(endpoints, prefix, secret=secret.encode(), quorum_wait=section["quorum_wait"], tls=tls,
                      user=section["user"], password=section["password"])
    try:
        store.reach(timeout)
    except BaseException:
        store.close()
        raise
    return store
