"""A real etcd cluster for tests and benchmarks: ``n`` members of Debian's ``etcd`` on loopback ports, their data
in memory (/dev/shm: a member's fsync costs nothing there), each one killed, restarted or asked who leads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..cli.launcher import free_ports


def missing() -> str | None:
    """Why no cluster can start here (None: it can)."""
    if shutil.which("etcd") is None:
        return "etcd is not installed (scripts/system-deps.sh test installs Debian's etcd-server)"
    return None


def make_tls(folder: Path) -> dict[str, Path]:
    """A CA and, signed by it, a certificate for 127.0.0.1 (the members') and a client's, as PEM files in
    ``folder``: ``ca``, ``server_cert``, ``server_key``, ``client_cert``, ``client_key``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "erdma test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    out = {"ca": folder / "ca.pem"}
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    # the members' certificate is a client's too: etcd's JSON gateway calls its own gRPC server with it
    for who, usage in (("server", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       ("client", [ExtendedKeyUsageOID.CLIENT_AUTH])):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                # no common name on the client's: etcd's gateway refuses one when users are on (it would be
                # taken for a user name)
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "erdma test members")]
                                        if who == "server" else []))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
                .sign(ca_key, hashes.SHA256()))
        out[f"{who}_cert"], out[f"{who}_key"] = folder / f"{who}.pem", folder / f"{who}-key.pem"
        out[f"{who}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{who}_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                        serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    return out


class EtcdCluster:
    """``n`` members started together (``url(prefix)`` names them all); ``kill(i)`` (SIGKILL), ``start(i)``
    (again, on its data), ``stop(i)``/``cont(i)`` (SIGSTOP/SIGCONT), ``leader()``. Members log to
    ``folder``. ``tls`` (``make_tls``'s files): clients reach the members over https and must show a
    certificate the CA signed. ``hosts``: each member's address (default 127.0.0.1); ``command(i, argv)``: the
    command line that runs ``argv`` where member ``i`` lives (e.g. a network namespace's ``ip netns exec``)."""

    def __init__(self, n: int = 3, folder: Path | None = None, *, ready_s: float = 60.0,
                 tls: dict[str, Path] | None = None, hosts: Sequence[str] | None = None,
                 command: Callable[[int, list[str]], list[str]] | None = None) -> None:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.data = Path(tempfile.mkdtemp(prefix="erdma-etcd-", dir=shm))
        self.folder = Path(folder) if folder is not None else self.data
        self.tls = tls
        self._context: ssl.SSLContext | None = None
        if tls is not None:
            self._context = ssl.create_default_context(cafile=str(tls["ca"]))
            self._context.load_cert_chain(str(tls["client_cert"]), str(tls["client_key"]))
        self.hosts = list(hosts) if hosts is not None else ["127.0.0.1"] * n
        if len(self.hosts) != n:
            raise ValueError(f"hosts={self.hosts!r}: one address for each of the {n} members")
        self._command = command or (lambda i, argv: argv)
        ports = free_ports(2 * n)  # all different: members that share a URL refuse to start ("duplicate url")
        self.client, self.peer = ports[:n], ports[n:]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self._ids: dict[int, str] = {}
        self._initial = ",".join(f"m{i}=http://{self.hosts[i]}:{p}" for i, p in enumerate(self.peer))
        try:
            for i in range(n):
                self.start(i)
            self.wait_ready(ready_s)
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [f"{h}:{p}" for h, p in zip(self.hosts, self.client, strict=True)]

    def order(self, first: int = 0) -> list[int]:
        """The members from ``first`` on, in a ring."""
        n = len(self.procs)
        return [(first + k) % n for k in range(n)]

    def url(self, prefix: str, first: int = 0) -> str:
        """The cluster's URL for a job under ``prefix``, member ``first`` first (a client tries it first)."""
        return f"etcd://{','.join(self.endpoints[i] for i in self.order(first))}/{prefix}"

    def _client_url(self, i: int) -> str:
        return f"{'https' if self.tls else 'http'}://{self.hosts[i]}:{self.client[i]}"

    def _open(self, i: int, path: str, body: bytes, timeout: float) -> Any:
        req = urllib.request.Request(self._client_url(i) + path, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout, context=self._context) as resp:
            return json.loads(resp.read())

    def start(self, i: int) -> None:
        c, p = self._client_url(i), f"http://{self.hosts[i]}:{self.peer[i]}"
        tls = [] if self.tls is None else [
            "--cert-file", str(self.tls["server_cert"]), "--key-file", str(self.tls["server_key"]),
            "--trusted-ca-file", str(self.tls["ca"]), "--client-cert-auth"]
        log = open(self.folder / f"etcd-m{i}.log", "ab")
        self.procs[i] = subprocess.Popen(self._command(i, [
            "etcd", "--name", f"m{i}", "--data-dir", str(self.data / f"m{i}"), "--listen-client-urls", c,
            "--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
            "--initial-cluster", self._initial, "--initial-cluster-state", "new",
            "--initial-cluster-token", self.data.name, "--logger", "zap", "--log-level", "warn", *tls]),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def stop(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)

    def cont(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        os.kill(proc.pid, signal.SIGCONT)

    def alive(self, i: int) -> bool:
        proc = self.procs[i]
        return proc is not None and proc.poll() is None

    def status(self, i: int, timeout: float = 2.0) -> dict[str, Any] | None:
        """Member ``i``'s own view (``/v3/maintenance/status``), or None when it does not answer."""
        try:
            return self._open(i, "/v3/maintenance/status", b"{}", timeout)  # type: ignore[no-any-return]
        except (OSError, ValueError, urllib.error.URLError):
            return None

    def member_id(self, i: int) -> str:
        """Member ``i``'s raft id, as the others' status names their leader (asked once, while it answers)."""
        if i not in self._ids:
            st = self.status(i)
            if st is None:
                raise RuntimeError(f"etcd member m{i} does not answer")
            self._ids[i] = str(st["header"]["member_id"])
        return self._ids[i]

    def leader(self, timeout: float = 30.0) -> int:
        """The index of the member that leads now (waiting up to ``timeout`` for a leader)."""
        end = time.monotonic() + timeout
        while True:
            ids: dict[str, int] = {}
            lead = None
            for i in range(len(self.procs)):
                st = self.status(i) if self.alive(i) else None
                if st is not None:
                    ids[str(st["header"]["member_id"])] = i
                    lead = str(st.get("leader", "0"))
            if lead in ids:
                return ids[lead]
            if time.monotonic() > end:
                raise TimeoutError(f"no etcd member leads after {timeout:.0f}s (logs in {self.folder})")
            time.sleep(0.1)

    def wait_ready(self, timeout: float) -> None:
        """Until a write commits (a leader, a majority)."""
        end = time.monotonic() + timeout
        body = json.dumps({"key": "cmVhZHk=", "value": "MQ=="}).encode()  # "ready" = "1"
        while True:
            for i in range(len(self.client)):
                try:
                    if "error" not in self._open(i, "/v3/kv/put", body, 2.0):
                        return
                except (OSError, ValueError, urllib.error.URLError):
                    pass
            if time.monotonic() > end:
                raise TimeoutError(f"the etcd cluster took no write within {timeout:.0f}s (logs in {self.folder})")
            time.sleep(0.1)

    def close(self) -> None:
        for i in range(len(self.procs)):
            proc = self.procs[i]
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
            self.kill(i)
        shutil.rmtree(self.data, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
