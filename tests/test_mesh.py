"""The members' control mesh (``elastic.mesh``, ``elastic.mesh_wire``): the handshake and frames sans-IO, then
members deciding write-once registers over real loopback connections: through a member's death, on the
smaller side of a cut (pausing, with an error naming who answered), and against strangers that do not know
the job's secret or hold connections open without a word."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from erdma_core.elastic import mesh, mesh_wire
from erdma_core.elastic.registers import Registers
from erdma_core.errors import AuthenticationError, CollectiveTimeoutError, ProtocolError

SECRET = b"s" * 32
KEY = mesh_wire.mesh_key(SECRET)


def handshake(d_key: bytes = KEY, a_key: bytes = KEY) -> tuple[mesh_wire.Dialling, mesh_wire.Accepting]:
    d = mesh_wire.Dialling(d_key, "job", "m0", "m1")
    a = mesh_wire.Accepting(a_key, "job", "m1")
    hello = d.hello()
    assert a.hello_size(hello[:5]) is None and a.hello_size(hello) == len(hello)
    a.on_proof(d.on_challenge(a.on_hello(hello)))
    return d, a


def test_the_handshake_binds_both_ids_and_frames_pass_once_each_in_order():
    d, a = handshake()
    assert a.peer == "m0"
    assert d.session is not None and a.session is not None
    frames = [d.session.seal(b"x" * n) for n in (0, 1, 70_000)]
    reader = mesh_wire.FrameReader(a.session)
    stream = b"".join(frames)
    got = [p for i in range(0, len(stream), 999) for p in reader.feed(stream[i:i + 999])]
    assert got == [b"", b"x", b"x" * 70_000]
    back = mesh_wire.FrameReader(d.session)
    assert back.feed(a.session.seal(b"answer")) == [b"answer"]
    with pytest.raises(ProtocolError, match=r"frame 0 failed its check \(expected frame 3\)"):
        reader.feed(frames[0])  # replayed


def test_a_changed_frame_or_one_from_another_connection_fails_its_check():
    d, a = handshake()
    assert d.session is not None and a.session is not None
    frame = bytearray(d.session.seal(b"vote done"))
    frame[14] ^= 1
    with pytest.raises(ProtocolError, match="failed its check"):
        mesh_wire.FrameReader(a.session).feed(bytes(frame))
    d2, a2 = handshake()
    assert d2.session is not None and a2.session is not None
    with pytest.raises(ProtocolError, match="failed its check"):
        mesh_wire.FrameReader(a2.session).feed(d.session.seal(b"vote done"))


def test_a_frame_longer_than_the_bound_is_refused_from_its_length():
    _, a = handshake()
    assert a.session is not None
    with pytest.raises(ProtocolError, match="announced"):
        mesh_wire.FrameReader(a.session).feed((mesh_wire.MAX_FRAME + 100).to_bytes(4, "big"))


def test_either_side_without_the_secret_is_refused():
    with pytest.raises(AuthenticationError, match="'m1' could not prove"):
        handshake(a_key=mesh_wire.mesh_key(b"other"))
    d = mesh_wire.Dialling(KEY, "job", "m0", "m1")
    a = mesh_wire.Accepting(KEY, "job", "m1")
    challenge = a.on_hello(d.hello())
    with pytest.raises(AuthenticationError, match="calling itself 'm0' could not prove"):
        a.on_proof(challenge[16:])  # the acceptor's own answer reflected back


@pytest.mark.parametrize("job, peer", [("other", "m1"), ("job", "m2")])
def test_a_hello_for_another_job_or_member_is_refused(job, peer):
    a = mesh_wire.Accepting(KEY, "job", "m1")
    with pytest.raises(ProtocolError, match="reached 'm1' of 'job'"):
        a.on_hello(mesh_wire.Dialling(KEY, job, "m0", peer).hello())


# ---- members over loopback ----------------------------------------------------------------------------------

MEMBERS = ["m0", "m1", "m2"]


class Job:
    def __init__(self) -> None:
        self.addresses: dict[str, tuple[str, int]] = {}
        self.meshes: dict[str, mesh.Mesh] = {}
        self.regs: dict[str, Registers] = {}

    def start(self, m: str, secret: bytes = SECRET) -> Registers:
        box = mesh.Mesh(secret, "job", m, self.addresses.get)
        self.meshes[m] = box
        self.addresses[m] = box.address
        self.regs[m] = Registers(m, box.channel(0), retry_s=0.1, rng=random.Random(m))
        return self.regs[m]

    def stop(self, m: str) -> None:
        self.regs.pop(m).close()
        self.meshes.pop(m).close()

    def close(self) -> None:
        for m in list(self.regs):
            self.stop(m)


@pytest.fixture
def job():
    j = Job()
    yield j
    j.close()


def test_members_racing_over_the_mesh_all_get_one_value_and_messages_arrive_whole(job):
    for m in MEMBERS:
        job.start(m)
    got: dict[str, bytes] = {}

    def decide(m: str) -> None:
        got[m] = job.regs[m].decide("epoch/1", f"from {m}".encode(), MEMBERS, 20.0)

    threads = [threading.Thread(target=decide, args=(m,)) for m in MEMBERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 3 and len(set(got.values())) == 1, got
    assert got["m0"] in {b"from m0", b"from m1", b"from m2"}
    big = bytes(random.Random(1).randbytes(200_000))
    box = mesh.Mesh(SECRET, "job", "m9", job.addresses.get)
    try:
        job.addresses["m9"] = box.address
        seven, three = box.channel(7), box.channel(3)  # (a message on a channel not opened yet is dropped)
        job.meshes["m0"].send("m9", big, channel=7)
        job.meshes["m1"].send("m9", b"on 3", channel=3)
        assert seven.recv(10.0) == ("m0", big)
        assert three.recv(10.0) == ("m1", b"on 3")
        assert box.recv(0.0, channel=5) is None
    finally:
        box.close()


def test_a_dead_member_leaves_a_majority_that_decides_and_the_lone_side_pauses_saying_who_answered(job):
    for m in MEMBERS:
        job.start(m)
    job.stop("m2")
    assert job.regs["m0"].decide("vote/3/0", b"done", MEMBERS, 20.0) == b"done"
    assert job.regs["m1"].read("vote/3/0", MEMBERS, 20.0) == b"done"
    job.stop("m1")
    with pytest.raises(CollectiveTimeoutError, match=r"'vote/3/1' was not decided within 2.0s: 2 of its 3 acceptors "
                                                     r"\(m0, m1, m2\) must answer and 1 did \(m0\)"):
        job.regs["m0"].decide("vote/3/1", b"done", MEMBERS, 2.0)
    job.start("m1")  # back on another port: m0's link dials the new address
    assert job.regs["m0"].decide("vote/3/1", b"done", MEMBERS, 20.0) == b"done"


def test_a_member_with_another_secret_is_refused_and_changes_nothing(job):
    job.start("m0")
    job.start("m1")
    rogue = job.start("m2", secret=b"not the job's")
    with pytest.raises(CollectiveTimeoutError, match="1 did"):
        rogue.decide("epoch/5", b"rogue", MEMBERS, 2.0)
    assert job.meshes["m0"].refused >= 1 and job.meshes["m1"].refused >= 1
    assert job.regs["m0"].decide("epoch/5", b"members", ["m0", "m1"], 20.0) == b"members"


def test_strangers_holding_silent_connections_do_not_keep_a_member_out(job):
    job.start("m0")
    job.start("m1")
    strangers = [socket.create_connection(job.addresses["m1"]) for _ in range(mesh.MAX_PENDING + 10)]
    try:
        deadline = time.monotonic() + 10
        while job.meshes["m1"].refused < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.meshes["m1"].refused == 10  # the oldest, closed as more came
        # m1 must answer (2 of 2) well within the strangers' HANDSHAKE_S: m0's handshake closes the oldest
        assert job.regs["m0"].decide("epoch/7", b"x", ["m0", "m1"], mesh.HANDSHAKE_S / 2) == b"x"
        junk = socket.create_connection(job.addresses["m1"], timeout=10)
        junk.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert junk.recv(10) == b""  # not a hello: closed
        junk.close()
    finally:
        for s in strangers:
            s.close()


def test_a_member_that_proves_itself_then_never_reads_loses_its_connection_once_a_write_stalls(job):
    """A proven member that stops reading (stopped, or wedged) fills the socket's buffers: the write that
    stalls for SEND_S drops the connection (the link dials again later) rather than blocking its writer
    for good, which it did while the reader's wait for data took the socket's timeout off."""
    job.start("m0")
    stuck = socket.create_server(("127.0.0.1", 0))
    job.addresses["m1"] = stuck.getsockname()[:2]
    held: list[socket.socket] = []

    def accept_once() -> None:
        sock, _ = stuck.accept()
        held.append(sock)
        hs = mesh_wire.Accepting(KEY, "job", "m1")
        head = b""
        while (size := hs.hello_size(head)) is None or len(head) < size:
            head += sock.recv(1)
        sock.sendall(hs.on_hello(head))
        proof = b""
        while len(proof) < hs.PROOF:
            proof += sock.recv(hs.PROOF - len(proof))
        hs.on_proof(proof)  # proven; from now on it reads nothing

    t = threading.Thread(target=accept_once, daemon=True)
    t.start()
    m0 = job.meshes["m0"]
    try:
        m0.send("m1", b"hello")
        t.join(10)
        assert held, "m0 did not dial"
        deadline = time.monotonic() + 10
        while "m1" not in m0.connected():
            assert time.monotonic() < deadline, "m0 never held the connection"
            time.sleep(0.05)
        deadline = time.monotonic() + 4 * mesh.SEND_S + 30
        while "m1" in m0.connected():  # 256 KiB frames until the buffers are full and a write stalls
            assert time.monotonic() < deadline, "a stalled write kept its connection (and its writer) for good"
            m0.send("m1", b"x" * (1 << 18))
            time.sleep(0.05)
    finally:
        stuck.close()
        for sock in held:
            sock.close()


def test_a_member_that_leaves_sends_what_it_queued_first(job, monkeypatch):
    """The last decisions' messages (a Chosen, an answer) are queued when a member leaves the job: ``close``
    sends them before it closes (a member still deciding the last step waited for them in vain, the others
    gone, and ended with JobFinishedError)."""
    monkeypatch.setattr(mesh, "FLUSH_S", 60.0)  # (its bound is not what this tests: a busy machine may be slow)
    job.start("m0")
    job.start("m1")
    m0, m1 = job.meshes["m0"], job.meshes["m1"]
    inbox = m1.channel(5)
    m0.send("m1", b"first", 5)
    assert inbox.recv(20) == ("m0", b"first")  # (connected)
    for i in range(mesh.QUEUE):  # (near 1 MiB each: the writer is still at it when close comes)
        m0.send("m1", b"%d" % i + b"x" * (mesh_wire.MAX_FRAME - 8192), 5)
    job.regs.pop("m0").close()
    job.meshes.pop("m0").close()
    end = time.monotonic() + 60
    got = [inbox.recv(max(0.0, end - time.monotonic())) for _ in range(mesh.QUEUE)]
    assert [g[1][:3].rstrip(b"x") if g else None for g in got] == [b"%d" % i for i in range(mesh.QUEUE)]


def test_forgetting_a_member_closes_its_connection(job):
    job.start("m0")
    job.start("m1")
    assert job.regs["m0"].decide("k", b"v", ["m0", "m1"], 20.0) == b"v"
    assert "m1" in job.meshes["m0"].connected()
    job.meshes["m0"].forget("m1")
    assert "m1" not in job.meshes["m0"].connected()


def test_signs_of_life_over_the_mesh_count_out_the_member_that_stopped_and_nobody_else(job):
    from erdma_core.elastic.liveness import Liveness, MeshSigns
    from erdma_core.elastic.membership import Keys

    boxes = {m: mesh.Mesh(SECRET, "job", m, job.addresses.get) for m in MEMBERS}
    for m, box in boxes.items():
        job.addresses[m] = box.address
    signs = {m: Liveness(MeshSigns(boxes[m].channel(1), lambda: tuple(MEMBERS)), Keys("job"), m, 3.0)  # type: ignore[arg-type]
             for m in MEMBERS}
    try:
        for m in MEMBERS:
            signs[m].watch(tuple(MEMBERS), lambda: None)
        time.sleep(4.0)  # past one timeout (3 s, four beats each): a member not heard from would have lapsed
        assert all(not signs[m].lapsed() for m in MEMBERS)
        signs["m2"].close()  # its beats stop (as a SIGSTOP would stop them); its mesh stays up
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(signs[m].lapsed() for m in ("m0", "m1")):
            time.sleep(0.05)
        assert signs["m0"].lapsed() == {"m2"} and signs["m1"].lapsed() == {"m2"}
    finally:
        for m in MEMBERS:
            signs[m].close()
            boxes[m].close()
