"""Mutual TLS between ranks: who gets in, who is refused, and what each side says about it."""

from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest
from erdma_quic import credentials as cred
from erdma_quic.mesh import REFUSED
from erdma_quic.streams import hello_stream
from helpers import MemoryStore, options, raw_dial, start, wait_for

from erdma_core.cli.main import main as erdma_main
from erdma_core.sdk import CollectiveTimeoutError, ConfigError, Header, ProtocolError
from erdma_core.toolkit import DATA, HELLO_REQUEST, Hello

JOB = 0x1234_5678_9ABC_DEF0


@pytest.fixture
def ca(ca_files: tuple[Path, Path]) -> cred.Authority:
    return cred.read_authority(*ca_files)


@pytest.fixture
def rank0(ca_files: tuple[Path, Path]):
    """Rank 0 of a 2-rank job, listening and waiting for rank 1."""
    store = MemoryStore()
    t, th, errors = start(0, 2, store, JOB, options(ca_cert=str(ca_files[0]), ca_key=str(ca_files[1])), timeout=20)
    addr = store.get("quic/addr/0", 5).decode()
    yield store, t, th, errors, addr
    t.close()


def _exchange(a, b) -> bool:
    """rank a sends 3 MiB to rank b over the connected pair; True when the bytes arrive intact."""
    import time

    src = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    h = Header(kind=DATA, job=JOB, dtype=9, opcode=1, numel=src.size, count=src.size, nbytes=src.size)
    r = b.irecv(0, h, memoryview(dst))
    s = a.isend(1, h, memoryview(src), time.monotonic() + 30)
    return s.wait(time.monotonic() + 30) and r.wait(time.monotonic() + 30) and bool((src == dst).all())


def test_ranks_with_the_cluster_ca_connect_and_exchange(rank0, ca_files):
    store, t0, th0, errors0, _ = rank0
    t1, th1, errors1 = start(1, 2, store, JOB, options(ca_cert=str(ca_files[0]), ca_key=str(ca_files[1])))
    th0.join(15)
    th1.join(15)
    assert errors0 == [] and errors1 == []
    try:
        assert _exchange(t0, t1)
    finally:
        t1.close()


def test_client_without_certificate_is_refused_and_logged(rank0, caplog):
    _store, t0, th0, _errors0, addr = rank0
    caplog.set_level(logging.WARNING, logger="erdma.quic")
    closed = raw_dial(addr, hello=hello_stream(Hello(status=HELLO_REQUEST, job=JOB, rank=1, world=2)))
    assert closed is not None and closed.error_code == REFUSED
    assert closed.reason_phrase == "it presented no certificate"
    assert wait_for(lambda: "refused the QUIC connection of a peer" in caplog.text)
    assert 1 not in t0.mesh.links and th0.is_alive()  # still waiting for the real rank 1


def test_certificate_from_another_ca_is_refused(rank0, caplog):
    _store, t0, _, _, addr = rank0
    caplog.set_level(logging.WARNING, logger="erdma.quic")
    outsider = cred.issue(cred.new_authority("someone else"), 1, JOB)  # (whose names are another key's)
    closed = raw_dial(addr, outsider.cert, outsider.key, hello_stream(Hello(status=HELLO_REQUEST, job=JOB, rank=1, world=2)))
    assert closed is not None and closed.error_code == REFUSED
    assert "its certificate names none of the ranks [1] of this job" in closed.reason_phrase
    assert 1 not in t0.mesh.links


def test_certificate_of_another_job_is_refused(rank0, ca, caplog):
    """Signed by the right CA, but for another job: the listener refuses it before reading anything."""
    _store, t0, _, _, addr = rank0
    caplog.set_level(logging.WARNING, logger="erdma.quic")
    other = cred.issue(ca, 1, JOB + 1)
    closed = raw_dial(addr, other.cert, other.key, hello_stream(Hello(status=HELLO_REQUEST, job=JOB + 1, rank=1, world=2)))
    assert closed is not None and closed.error_code == REFUSED
    assert closed.reason_phrase.startswith(f"its certificate names none of the ranks [1] of this job (subjectAltName "
                                           f"['{other.name}']"), closed.reason_phrase
    assert wait_for(lambda: "names none of the ranks [1] of this job" in caplog.text)
    assert 1 not in t0.mesh.links


def test_rank_of_another_job_fails_with_a_clear_error(rank0, ca, ca_files):
    """An honest rank that dials into the wrong job refuses the listener's certificate itself."""
    store, t0, _, _, _ = rank0
    t1, th1, errors1 = start(1, 2, store, JOB + 1, options(ca_cert=str(ca_files[0]), ca_key=str(ca_files[1])))
    th1.join(15)
    t1.close()
    assert len(errors1) == 1 and isinstance(errors1[0], ProtocolError), errors1
    assert "QUIC connection to rank 0" in str(errors1[0])
    assert cred.identity(ca.names_key, 0, JOB + 1) in str(errors1[0])  # the name it expected and did not get
    assert 1 not in t0.mesh.links


def test_certificate_naming_an_unexpected_rank_is_refused(rank0, ca):
    _, _t0, _, _, addr = rank0
    lower = cred.issue(ca, 0, JOB)  # rank 0 never dials rank 0
    closed = raw_dial(addr, lower.cert, lower.key)
    assert closed is not None and closed.reason_phrase == (f"its certificate names none of the ranks [1] of this job "
                                                           f"(subjectAltName ['{lower.name}']: a rank of another job, "
                                                           "another rank, or another CA's)")


def test_listener_times_out_naming_the_missing_rank(rank0):
    _, _, th0, errors0, _ = rank0
    th0.join(30)
    assert len(errors0) == 1 and isinstance(errors0[0], CollectiveTimeoutError)
    assert str(errors0[0]) == "rank 0: ranks [1] did not connect over QUIC within 20.0s"


def test_shared_secret_derives_one_ca_per_job():
    a = cred.derived_authority(b"s3cret", JOB)
    assert a.pem != cred.derived_authority(b"s3cret", JOB + 1).pem
    leaf = cred.issue(a, 1, JOB)
    same = cred.derived_authority(b"s3cret", JOB)  # what another rank of the job derives
    assert cred.check_peer(leaf.cert, [], same.pem, JOB, {1}, same.names_key) == 1
    for other in (cred.derived_authority(b"s3cret", JOB + 1), cred.derived_authority(b"other", JOB)):
        with pytest.raises(cred.CredentialError, match="names none of the ranks"):  # names made with another key
            cred.check_peer(leaf.cert, [], other.pem, JOB, {1}, other.names_key)
        with pytest.raises(cred.CredentialError, match="does not verify against this job's CA"):
            cred.check_peer(leaf.cert, [], other.pem, JOB, {1}, a.names_key)  # the right name, another CA


def test_a_rank_certificate_tells_a_stranger_neither_job_nor_rank(ca):
    """What a listener shows whoever starts a handshake: its name is an HMAC under the CA's key, the same on
    every rank that holds the CA, and neither it nor the issuer (a CA derived from a secret) spells the job id
    or the rank."""
    shown = [cred.issue(ca, 0, JOB), cred.issue(cred.derived_authority(b"s", JOB), 3, JOB)]
    for leaf in shown:
        text = (leaf.cert.subject.rfc4514_string() + leaf.cert.issuer.rfc4514_string()
                + str(leaf.cert.extensions.get_extension_for_class(cred.x509.SubjectAlternativeName).value))
        assert f"{JOB:016x}" not in text and f"{JOB:x}" not in text and "r0." not in text and "r3." not in text, text
        assert re.fullmatch(r"n[0-9a-f]{32}\.erdma", leaf.name), leaf.name
    again = cred.read_authority(*cred.write_authority(ca, Path(tempfile.mkdtemp())))  # another host's copy
    assert cred.identity(again.names_key, 0, JOB) == shown[0].name != cred.identity(ca.names_key, 0, JOB + 1)


def _connect_and_exchange(opts: dict, secret: bytes = b"") -> None:
    """Two ranks with ``opts`` (and the job's ``secret``) connect, and 3 MiB cross intact."""
    store = MemoryStore()
    ranks = [start(r, 2, store, JOB, opts, secret=secret) for r in range(2)]
    for _, th, _ in ranks:
        th.join(15)
    try:
        assert [e for _, _, e in ranks] == [[], []]
        assert _exchange(ranks[0][0], ranks[1][0])
    finally:
        for t, _, _ in ranks:
            t.close()


def test_secret_mode_ranks_connect():
    _connect_and_exchange(options(secret="s3cret"))


def test_ranks_with_different_secrets_both_name_the_secret():
    store = MemoryStore()
    r0 = start(0, 2, store, JOB, options(secret="one"), timeout=4.0)
    r1 = start(1, 2, store, JOB, options(secret="two"), timeout=4.0)
    for _, th, _ in (r0, r1):
        th.join(15)
    try:
        (err0,), (err1,) = r0[2], r1[2]
        assert isinstance(err1, ProtocolError) and "QUIC connection to rank 0" in str(err1)
        assert "the ranks hold different secrets or CA files" in str(err1)
        assert isinstance(err0, CollectiveTimeoutError) and "ranks [1] did not connect over QUIC" in str(err0)
        assert "refused: " in str(err0) and "the ranks hold different secrets or CA files" in str(err0)
    finally:
        for t, _, _ in (r0, r1):
            t.close()


def test_the_jobs_secret_stands_for_quics_own():
    """With no secret or CA of its own, QUIC derives its CA from security.secret (``ctx.secret``)."""
    _connect_and_exchange(options(), secret=b"the job's")


def test_insecure_dev_mode_says_so(caplog):
    store = MemoryStore()
    caplog.set_level(logging.WARNING, logger="erdma.quic")
    with pytest.warns(UserWarning, match="insecure_dev_mode is on: peers are NOT authenticated"):
        ranks = [start(r, 2, store, JOB, options(insecure_dev_mode=True)) for r in range(2)]
        for _, th, _ in ranks:
            th.join(15)
    try:
        assert [e for _, _, e in ranks] == [[], []]
        assert caplog.text.count("Development only") == 2
    finally:
        for t, _, _ in ranks:
            t.close()


def test_no_credentials_is_a_config_error_naming_the_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("ERDMA_KEYS_DIR", str(tmp_path))
    _t, th, errors = start(0, 1, MemoryStore(), JOB, options())
    th.join(10)
    assert len(errors) == 1 and isinstance(errors[0], ConfigError)
    msg = str(errors[0])
    for needle in ("erdma keys init", "transport.quic.ca_cert", "transport.quic.secret", "insecure_dev_mode",
                   "security.secret", "ERDMA_SECRET", "ERDMA_TRANSPORT_QUIC_SECRET"):
        assert needle in msg


def test_half_a_ca_is_a_config_error(ca_files):
    _t, th, errors = start(0, 1, MemoryStore(), JOB, options(ca_cert=str(ca_files[0])))
    th.join(10)
    assert isinstance(errors[0], ConfigError)
    assert str(errors[0]) == ("transport.quic.ca_cert and transport.quic.ca_key go together; got "
                              f"ca_cert={str(ca_files[0])!r}, ca_key=''")


def test_keys_init_writes_a_usable_ca(tmp_path, capsys):
    assert erdma_main(["keys", "init", "--out", str(tmp_path)]) == 0
    assert stat.S_IMODE(os.stat(tmp_path / "ca.key").st_mode) == 0o600
    ca = cred.read_authority(tmp_path / "ca.pem", tmp_path / "ca.key")
    leaf = cred.issue(ca, 3, JOB)
    assert cred.check_peer(leaf.cert, [], ca.pem, JOB, {3}, ca.names_key) == 3
    assert erdma_main(["keys", "init", "--out", str(tmp_path)]) == 1
    assert "already holds a CA" in capsys.readouterr().out


def test_runs_on_a_udp_socket_handed_over_by_the_traversal():
    """A traversal that punched a hole hands its socket over; peers are told that socket's address."""
    import socket

    store = MemoryStore()
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ranks = [start(r, 2, store, JOB, options(secret="s3cret"), udp_socket=socks[r]) for r in range(2)]
    for _, th, _ in ranks:
        th.join(15)
    try:
        assert [e for _, _, e in ranks] == [[], []]
        for r in range(2):
            assert store.data[f"quic/addr/{r}"].decode() == f"127.0.0.1:{socks[r].getsockname()[1]}"
        assert _exchange(ranks[0][0], ranks[1][0])
    finally:
        for t, _, _ in ranks:
            t.close()
