"""The sans-IO stream layer: messages cut into parts, parts fed back in any order and in any slicing,
checked byte for byte; and two aioquic connections wired back to back in memory, no sockets."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from erdma_quic.streams import HEAD_BYTES, KIND_PART, PREFIX, Inbound, hello_stream, message_parts, numbered
from erdma_quic.tls import ALPN

from erdma_core.sdk import Header, PeerLostError, ProtocolError
from erdma_core.toolkit import BYE, DATA, HELLO_REQUEST, FrameInbox, Hello, Mailbox

JOB = 77


def _header(seq: int, n: int, kind: int = DATA) -> Header:
    return Header(kind=kind, job=JOB, dtype=9, opcode=1, seq=seq, numel=n, count=n, nbytes=n)


_NUMBERS = itertools.count(1)  # part numbers, unique across the module as a sender's are per peer


def _streams(h: Header, payload: bytes, part: int) -> list[bytes]:
    return [numbered(head, next(_NUMBERS)) + bytes(body) for head, body in message_parts(h, payload, part)]


def test_message_parts_cover_the_payload_exactly():
    payload = bytes(range(256)) * 40  # 10240 bytes
    parts = message_parts(_header(0, len(payload)), payload, 4096)
    assert [PREFIX.unpack_from(h)[2:] for h, _ in parts] == [(0, 3414), (3414, 3414), (6828, 3412)]
    assert b"".join(bytes(b) for _, b in parts) == payload
    (head, body), = message_parts(_header(1, 0), b"", 4096)
    assert PREFIX.unpack_from(head) == (KIND_PART, 0, 0, 0) and len(body) == 0
    assert PREFIX.unpack_from(numbered(head, 7)) == (KIND_PART, 7, 0, 0)
    with pytest.raises(ProtocolError, match="frame header says 5 payload bytes, the buffer holds 4"):
        message_parts(_header(2, 5), b"abcd", 4096)


@pytest.mark.parametrize("seed", range(6))
def test_parts_in_any_order_and_slicing_land_intact(seed):
    rng = random.Random(seed)
    box = Mailbox(0, JOB)
    inbound = Inbound(1, FrameInbox(0, 1, box), lambda h: None)
    payloads = [np.random.default_rng(seed * 10 + i).integers(0, 256, n, dtype=np.uint8).tobytes()
                for i, n in enumerate((0, 1, 5000, 70001))]
    outs = [np.zeros(len(p), np.uint8) for p in payloads]
    pairs = list(enumerate(zip(payloads, outs, strict=True)))  # half posted before the data, half after
    reqs = [box.post_recv(1, _header(i, len(p)), memoryview(o)) for i, (p, o) in pairs if i % 2 == 0]
    streams = [s for i, p in enumerate(payloads) for s in _streams(_header(i, len(p)), p, 8192)]
    order = list(range(len(streams)))
    rng.shuffle(order)
    cuts = {sid: sorted(rng.sample(range(1, len(streams[sid])), min(3, len(streams[sid]) - 1))) for sid in order}
    # interleave pieces of different streams, keeping each stream's own bytes in order (as QUIC does)
    pieces = {sid: [streams[sid][a:b] for a, b in itertools.pairwise([0, *cuts[sid], len(streams[sid])])]
              for sid in order}
    while pieces:
        sid = rng.choice(list(pieces))
        chunk = pieces[sid].pop(0)
        inbound.feed(sid, chunk, fin=not pieces[sid])
        if not pieces[sid]:
            del pieces[sid]
    reqs += [box.post_recv(1, _header(i, len(p)), memoryview(o)) for i, (p, o) in pairs if i % 2 == 1]
    assert all(r.done() and r.error is None for r in reqs)
    assert [o.tobytes() for o in outs] == payloads
    assert inbound.completed == 4


def test_a_part_placed_by_the_engine_lands_in_its_frame_and_a_duplicate_or_hello_gets_no_place():
    """An engine that puts a stream's rest where ``target`` says (``placed`` then) lands the same bytes as
    feeding them: into the posted buffer, or into the mailbox's own buffer for a receive posted later."""
    box = Mailbox(0, JOB)
    inbound = Inbound(1, FrameInbox(0, 1, box), lambda h: None)
    payloads = [bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 30]  # 10240 and 7680 bytes
    outs = [np.zeros(len(p), np.uint8) for p in payloads]
    early = box.post_recv(1, _header(0, len(payloads[0])), memoryview(outs[0]))
    sid, landed = 0, []
    for seq, payload in enumerate(payloads):
        for stream in _streams(_header(seq, len(payload)), payload, 4096):
            sid += 4
            landed.append(stream)
            inbound.feed(sid, stream[:HEAD_BYTES], fin=False)
            target = inbound.target(sid)
            assert target is not None and len(target) == len(stream) - HEAD_BYTES
            target[:] = stream[HEAD_BYTES:]
            inbound.placed(sid)
    late = box.post_recv(1, _header(1, len(payloads[1])), memoryview(outs[1]))
    assert early.done() and late.done() and early.error is None and late.error is None
    assert [o.tobytes() for o in outs] == payloads
    again = landed[0]  # sent again after a reconnection: dropped
    inbound.feed(99, again[:HEAD_BYTES], fin=False)
    assert inbound.target(99) is None
    inbound.feed(99, again[HEAD_BYTES:], fin=True)
    assert inbound.duplicates == 1
    hello = hello_stream(Hello(status=HELLO_REQUEST, job=JOB, rank=1, world=2))
    inbound.feed(103, hello[:10], fin=False)
    assert inbound.target(103) is None
    with pytest.raises(ProtocolError, match="stream 107 landed in place with no frame under way"):
        inbound.placed(107)


def test_bye_counts_as_gone_only_after_the_frames_it_announced():
    box = Mailbox(0, JOB)
    inbound = Inbound(1, FrameInbox(0, 1, box), lambda h: None)
    out = np.zeros(100, np.uint8)
    req = box.post_recv(1, _header(0, 100), memoryview(out))
    inbound.feed(8, _streams(_header(5, 0, BYE), b"", 4096)[0], fin=True)  # BYE overtook the data
    assert not req.done() and not inbound.closed_cleanly
    data = _streams(_header(0, 100), bytes(range(100)), 4096)[0]
    inbound.feed(4, data, fin=True)
    assert req.done() and out.tobytes() == bytes(range(100))
    # BYE said 5 frames and one landed: a receive posted now still waits
    assert not inbound.closed_cleanly
    inbound2 = Inbound(1, FrameInbox(0, 1, box), lambda h: None)
    inbound2.feed(0, _streams(_header(0, 0, BYE), b"", 4096)[0], fin=True)
    later = box.post_recv(1, _header(9, 4), memoryview(np.zeros(4, np.uint8)))
    assert later.done() and isinstance(later.error, PeerLostError)
    assert str(later.error) == "rank 0: rank 1 closed its process group"


def test_hello_stream_reaches_the_callback():
    seen: list[Hello] = []
    inbound = Inbound(1, FrameInbox(0, 1, Mailbox(0, JOB)), seen.append)
    data = hello_stream(Hello(status=HELLO_REQUEST, job=JOB, rank=3, world=4))
    inbound.feed(2, data[:5], fin=False)
    inbound.feed(2, data[5:], fin=True)
    assert seen == [Hello(status=HELLO_REQUEST, job=JOB, rank=3, world=4)]


@pytest.mark.parametrize(("data", "message"), [
    (bytes([9]) + bytes(60), "opened a stream of unknown kind 9"),
    (PREFIX.pack(KIND_PART, 1, 0, 10) + _header(0, 4).pack(), r"sent part \[0, 10\) of a 4-byte frame"),
    (PREFIX.pack(KIND_PART, 1, 0, 4) + _header(0, 4).pack() + b"abcdef", "sent 2 bytes past the end of a part"),
    (PREFIX.pack(KIND_PART, 1, 0, 4) + _header(0, 4).pack() + b"ab", "ended a stream after 2 of 4 bytes"),
    (PREFIX.pack(KIND_PART, 1, 0, 1), "ended a stream after 0 of 0 bytes"),
    (PREFIX.pack(KIND_PART, 0, 0, 4) + _header(0, 4).pack() + b"abcd", "sent a part without a number"),
])
def test_malformed_streams_are_protocol_errors(data, message):
    inbound = Inbound(1, FrameInbox(0, 1, Mailbox(0, JOB)), lambda h: None)
    with pytest.raises(ProtocolError, match=message):
        inbound.feed(0, data, fin=True)


def test_parts_sent_again_after_a_reconnection_land_once():
    """A connection ends with one part whole, one half-read and one unsent; the new connection brings all
    three again (the sender cannot know which landed). Each lands once, and a message that completed before
    the reconnection is not written again (its receiver may already be using the buffer)."""
    box = Mailbox(0, JOB)
    inbound = Inbound(1, FrameInbox(0, 1, box), lambda h: None)
    done_payload, payload = bytes(range(200)) * 5, bytes(range(256)) * 48  # 1000 and 12288 bytes
    done_out, out = np.zeros(len(done_payload), np.uint8), np.zeros(len(payload), np.uint8)
    r0 = box.post_recv(1, _header(0, len(done_payload)), memoryview(done_out))
    r1 = box.post_recv(1, _header(1, len(payload)), memoryview(out))
    first, = _streams(_header(0, len(done_payload)), done_payload, 4096)
    parts = _streams(_header(1, len(payload)), payload, 4096)
    inbound.feed(1, first, fin=True)
    assert r0.done() and done_out.tobytes() == done_payload
    done_out[:] = 0xEE  # the receiver has moved on and reuses its buffer
    inbound.feed(5, parts[0], fin=True)
    inbound.feed(9, parts[1][:2000], fin=False)
    inbound.reset()  # the connection ended
    for sid, data in zip((3, 7, 11, 15), [first, *parts], strict=True):  # a new connection: all again
        inbound.feed(sid, data[:100], fin=False)
        inbound.feed(sid, data[100:], fin=True)
    assert r1.done() and r1.error is None and out.tobytes() == payload
    assert (done_out == 0xEE).all()
    assert inbound.completed == 2 and inbound.duplicates == 2


def test_an_unidentified_peer_may_send_only_hello():
    seen: list[Hello] = []
    inbound = Inbound(-1, None, seen.append)
    inbound.feed(0, hello_stream(Hello(status=HELLO_REQUEST, job=JOB, rank=1, world=2)), fin=True)
    assert seen == [Hello(status=HELLO_REQUEST, job=JOB, rank=1, world=2)]
    with pytest.raises(ProtocolError, match="sent a message before it was identified"):
        inbound.feed(4, _streams(_header(0, 4), b"abcd", 4096)[0], fin=True)


def test_frame_of_another_job_is_refused():
    inbound = Inbound(1, FrameInbox(0, 1, Mailbox(0, JOB)), lambda h: None)
    stray = Header(kind=DATA, job=JOB + 1, dtype=9, opcode=1, numel=4, count=4, nbytes=4)
    with pytest.raises(ProtocolError, match="carries job 0x4e, this job is 0x4d"):
        inbound.feed(0, _streams(stray, b"abcd", 4096)[0], fin=True)


def test_two_connections_in_memory_move_a_message_over_many_streams():
    """aioquic's sans-IO connections back to back (datagrams handed over in memory), our framing on top."""
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection
    from aioquic.quic.events import StreamDataReceived
    from erdma_quic import credentials as cred

    ca = cred.new_authority()
    server_creds = cred.issue(ca, 0, JOB)
    client_cfg = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name=server_creds.name,
                                   max_datagram_size=1452)
    client_cfg.cadata = ca.pem
    server_cfg = QuicConfiguration(is_client=False, alpn_protocols=[ALPN], max_datagram_size=1452)
    server_cfg.certificate, server_cfg.private_key = server_creds.cert, server_creds.key
    client = QuicConnection(configuration=client_cfg)
    server = QuicConnection(configuration=server_cfg,
                            original_destination_connection_id=client.original_destination_connection_id)
    now = 0.0
    client.connect(("1.2.3.4", 1234), now=now)
    box = Mailbox(0, JOB)
    inbound = Inbound(1, FrameInbox(0, 1, box), lambda h: None)
    payload = np.random.default_rng(3).integers(0, 256, 300_000, dtype=np.uint8)
    out = np.zeros_like(payload)
    req = box.post_recv(1, _header(0, payload.size), memoryview(out))
    sent = False
    for _ in range(2000):
        now += 0.001
        for data, _ in client.datagrams_to_send(now=now):
            server.receive_datagram(data, ("1.2.3.5", 4321), now=now)
        for data, _ in server.datagrams_to_send(now=now):
            client.receive_datagram(data, ("1.2.3.4", 1234), now=now)
        while (ev := server.next_event()) is not None:
            if isinstance(ev, StreamDataReceived):
                inbound.feed(ev.stream_id, ev.data, ev.end_stream)
        while client.next_event() is not None:
            pass
        if not sent and client._handshake_complete:
            for head, body in message_parts(_header(0, payload.size), memoryview(payload), 65536):
                sid = client.get_next_available_stream_id(is_unidirectional=True)
                client.send_stream_data(sid, numbered(head, next(_NUMBERS)))
                client.send_stream_data(sid, body, end_stream=True)
            sent = True
        if req.done():
            break
    assert req.done() and req.error is None
    assert np.array_equal(out, payload)
