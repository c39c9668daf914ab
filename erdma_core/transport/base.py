"""What a transport provides, and ``MessageTransport``, the base every message transport builds on.

Algorithms never see a transport; the executor drives it through ``Transport``'s calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from ..errors import AbortedError, PeerLostError, gone_ranks
from ..protocol.store import Store
from ..wire import ABORT, BYE, DATA, Header, abort_body, control
from .frames import FrameInbox
from .mailbox import DEFAULT_EARLY_BYTES, Mailbox
from .request import Request

log = logging.getLogger("erdma.transport")
_CONTROL_WAIT = 2.0  # seconds ABORT and BYE frames may take to leave


@attrs.frozen(kw_only=True)
class TransportContext:
    """Everything a transport needs at set-up."""

    rank: int
    world_size: int
    store: Store
    job: int
    connect_timeout: float
    advertise: Callable[[str, int], tuple[str, int]] | None = None  # traversal: the address peers should dial
    udp_socket: Any = None  # a bound UDP socket handed over by the traversal (``Traversal.udp_socket``), or None
    punch: Callable[[str, int], bytes | None] | None = None  # traversal: a datagram to send from ``udp_socket``
    # to a peer's advertised address before that peer dials this rank (opens this rank's NAT to it), or None
    udp_sockets: Callable[[int], list[Any]] | None = None  # traversal: ``count`` more sockets prepared like
    # ``udp_socket`` (each its own mapping), for a transport that stripes over several; None when it has none
    tcp_socket: Callable[[], Any] | None = None  # traversal: a TCP socket bound with SO_REUSEADDR and SO_REUSEPORT
    # whose NAT mapping it learned (``Traversal.tcp_socket``), where a stream transport meets its peers; or None
    candidates: Callable[[str, int], list[Any]] | None = None  # traversal: every address peers may try for this
    # rank (``addresses.Candidate``), published instead of ``advertise``'s one; None: that one
    dial_plan: Callable[[list[Any]], tuple[list[Any], float]] | None = None  # traversal: of a peer's published
    # candidates, those to dial in order, and the seconds to wait for an answer from each before the next
    secret: bytes = b""  # the job's secret (``security.secret``): every connection accepted must prove it
    max_early_bytes: int = DEFAULT_EARLY_BYTES  # per peer, for frames ahead of their receives (the mailbox's)
    collective_timeout: float = 300.0  # ``timeouts.collective``: also how long close waits for the peers to
    # acknowledge what this rank sent (``MessageTransport.linger``)
    peers: frozenset[int] | None = None  # the ranks to connect to (``paired``: the pairs another transport
    # could not connect); None: every other rank of the job
    settle: Callable[[set[int]], set[int]] | None = None  # ``paired``: the transport connects to whichever peers it
    # can within one check of their candidates (no error for the rest), then calls ``settle(connected)``, which
    # returns the peers both ends connected; it keeps those and closes the rest. None: every peer is required
    taken: Callable[[], frozenset[int] | None] | None = None  # ``paired``, both transports checking at once: the
    # peers of ``peers`` another transport took in this set-up, once it knows (None until then; it raises when
    # that transport failed). The transport connects to every peer of ``peers`` meanwhile, asks now and then,
    # drops what it has of those taken without a word (their ends do the same: ``forget``) and needs only the rest
    open_udp: Callable[[], Any] | None = None  # the traversal's ``udp_socket``, not yet called: for a transport that
    # needs the datagram socket only for some pairs (``paired``), which calls it when it does
    publish_paths: bool | Callable[[], None] = True  # publish ``paths/RANK`` for erdma doctor; False: not; a
    # callable (``paired``, which publishes the job's): not, but call it when a peer's path changes mid-job


FAILED_PREFIX = "erdma/failed/"  # a store that cleans up what it wrote at close keeps these: the others read them


def failure_key(job: int) -> str:
    """The store key a rank that cannot take part in job ``job`` writes its reason to."""
    return f"{FAILED_PREFIX}{job & 0xFFFFFFFFFFFFFFFF:016x}"


def failed_elsewhere(store: Store, job: int) -> str | None:
    """Why another rank gave up during set-up (a world size or secret that differs), or None. Transports
    look while they wait for peers, so that the others fail at once instead of at the connect timeout. A
    store that raises ``AbortedError`` (the set-up was called off here) ends the set-up the same way."""
    try:
        return store.get(failure_key(job), 0.001).decode(errors="replace")
    except AbortedError:  # this rank's own set-up was called off (an elastic epoch's: a member lapsed)
        raise
    except Exception:  # not there (a timeout), or the store is gone: nothing to report
        return None


def await_key(ctx: TransportContext, key: str, deadline: float, gave_up: Callable[[str], Exception]) -> bytes:
    """The store entry ``key``, which another rank writes during set-up (its address, "ready"), waiting until
    ``deadline``; looks now and then whether a rank gave up (``failed_elsewhere``) and fails at once if so.
    ``gave_up(why)`` makes the error, for another rank's reason or for the deadline."""
    while True:
        left = deadline - time.monotonic()
        try:
            return ctx.store.get(key, max(0.01, min(0.5, left)))
        except TimeoutError:
            why = failed_elsewhere(ctx.store, ctx.job)
            if why is not None:
                raise gave_up(f"another rank gave up: {why}") from None
            if left <= 0:
                raise gave_up(f"nothing under {key} within {ctx.connect_timeout:.0f}s") from None


class Transport(Protocol):
    """A full mesh of reliable message channels between the ranks of one job.

    Contract: ``connect`` returns once every peer is reachable or raises (within ``connect_timeout``).
    ``isend``/``irecv`` never block for long and return a ``Request``; a send is done once its payload's
    memory may be written again (the executor receives into it next). ``wait(req, deadline)`` waits for one
    (True; raises its error) or until ``deadline`` (False), and may move bytes meanwhile on the waiting thread
    (the socket transports do; a transport with an I/O thread of its own just waits). A receive matches a
    send by (peer,
    ``header.key``); a receive whose header disagrees with the sender's (opcode, reduce op, dtype, numel,
    count, root) fails with ``MismatchError``, and so does ``begin`` when a message of an earlier collective
    was never received (the ranks ran different collectives, or the same with different roots or sizes, and
    the peers are told). A lost peer fails every pending and later request with
    ``PeerLostError``. ``abort`` fails everything and tells the peers (they fail with an error carrying the
    reason). ``close`` is idempotent.

    ``devices`` names the device types whose memory the transport moves without a host copy ("cpu" for
    host memory). Front ends (the torch backend) stage tensors of any other device through host memory,
    and must not when the transport names that device.

    ``stripes``, known once ``connect`` returned and the same on every rank: how many messages to one peer
    travel side by side (a pool of connections, the TCP transport's ``connections``); the engine then cuts
    a collective's messages into chunks of at most ``collectives.chunk_bytes / stripes`` (256 KiB at least,
    ``engine.program.chunk_bytes``), so that every one of them carries data. 1 for a transport without pools.

    ``run_program(program, buffers, op)`` (optional): run a whole collective on the transport's own data path
    (compiled code, say) instead of the executor's calls per message. It returns False at once, having done
    nothing, for a program it does not take, and must decide that from what every rank of the collective has
    alike (the program's shape, ``op``'s identity), so that either every rank takes it or none. Taken, it
    returns True once the collective is done on this rank, or raises as the executor would: a
    ``CollectiveError`` naming this rank, the op and the peer, after ``abort``. It honours ``op.deadline``,
    fails at once when the transport is aborted, and detects a peer that ran another collective at that
    sequence number (``MismatchError``). Called once per collective, on uncompressed programs only.
    """

    rank: int
    world_size: int
    devices: frozenset[str]
    stripes: int

    def connect(self, ctx: TransportContext) -> None: ...

    def isend(self, peer: int, header: Header, data: memoryview, deadline: float) -> Request: ...

    def irecv(self, peer: int, header: Header, out: memoryview) -> Request: ...

    def wait(self, req: Request, deadline: float) -> bool: ...

    def begin(self, group: int, seq: int) -> None: ...

    def abort(self, error: BaseException) -> None: ...

    def failure(self) -> BaseException | None:
        """What aborted this transport (a lost peer, a peer's ABORT, ``abort``): every request fails with it
        from then on. None while it is whole."""
        ...

    def heard(self, peer: int, group: int, seq: int) -> bool:
        """Whether a message of collective ``seq`` of ``group`` (or a later one) came from ``peer`` (a
        timeout's error says whether the rank it waited on had called the collective at all)."""
        ...

    def close(self) -> None: ...

    def run_program(self, program: Any, buffers: Any, op: Any) -> bool:
        """See the class docstring: False leaves ``program`` to the executor."""
        ...


class MessageTransport:
    """What message transports have in common, so that a transport plugin writes only connection set-up
    and byte movement. The base owns the mailbox that matches frames to receives, ``isend``/``irecv``,
    ABORT (a rank that gives up tells every peer why), BYE at close (sent after the data, carrying how many
    data frames went before it) and turning a lost peer into ``PeerLostError`` on every pending and later
    request, on this rank and, through ABORT, on every other.

    A subclass sets ``name`` (how errors name it: "TCP", "QUIC") and implements:

    * ``open(ctx)``: connect to every other rank; return once all are reachable, or raise within
      ``ctx.connect_timeout``. ``self.rank``, ``self.world_size``, ``self.job`` and ``self.mailbox`` are set.
    * ``post(peer, header, payload, deadline, req, urgent)``: send one frame to ``peer``, after every frame
      posted to it before (unless ``urgent``: an ABORT may overtake queued data). Complete ``req`` once the
      bytes are handed to the network, or fail it (``self.peer_lost`` makes the error). May block, never past
      ``deadline``.
    * ``shutdown()``: close every connection; called once, after the BYE frames were posted (also after a
      failed ``open``). Unless the rank aborted, it first waits until the peers have acknowledged what was
      sent, up to ``self.linger`` seconds (the collective timeout): a rank that closes must not take its
      last messages with it.

    and may override ``wait(req, deadline)`` to move bytes on the waiting thread (``SocketTransport`` does)
    and ``fail_sends(error)`` to fail frames queued but not yet on their way when the rank aborts, and
    ``link_rate(peer)`` to report the bytes per second it measured towards ``peer``, and ``slow_peers()``: after
    ``open``, the peers it reaches the slow way (through a relay), or None when it never tells; the ranks
    agree on these links at set-up and a ring allreduce keeps them out of its ring where it can
    (``erdma_core.engine.topology``).

    What arrives from a peer goes through ``self.inbox(peer)`` (``FrameInbox``: a frame's header, then its
    payload), for a byte stream through a ``StreamReader`` over it. A connection that fails calls
    ``self.peer_lost(peer, why)``.
    """

    name = "?"
    devices: frozenset[str] = frozenset({"cpu"})
    stripes = 1

    def __init__(self) -> None:
        self.rank = -1
        self.world_size = 0
        self.job = 0
        self.mailbox: Mailbox = None  # type: ignore[assignment]  # set by connect
        self.closing = False
        self.linger = 300.0  # seconds close waits for what was sent to be acknowledged (ctx.collective_timeout)
        self._inboxes: dict[int, FrameInbox] = {}
        self._sent: dict[int, int] = {}  # DATA frames posted to each peer (a BYE says how many)
        self._count_lock = threading.Lock()

    # ---- for subclasses ---------------------------------------------------------------------------------
    def open(self, ctx: TransportContext) -> None:
        raise NotImplementedError

    def post(self, peer: int, header: Header, payload: memoryview, deadline: float, req: Request,
             urgent: bool = False) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def wait(self, req: Request, deadline: float) -> bool:
        """Wait for ``req``: True when it is done (raises its error), False at ``deadline``."""
        return req.wait(deadline)

    def fail_sends(self, error: BaseException) -> None:
        """Fail frames queued and not yet on their way (the rank is aborting)."""

    def link_rate(self, peer: int) -> float | None:
        """Bytes per second the path to ``peer`` has been measured to carry (``compression.policy = "auto"``
        weighs a codec's cost against it), or None when the transport does not know."""
        return None

    def inbox(self, peer: int) -> FrameInbox:
        """Where frames from ``peer`` go."""
        return self._inboxes[peer]

    def peers(self) -> list[int]:
        """The ranks this transport connects to, ascending (set before ``open`` is called): every other rank of
        the job, or ``ctx.peers``."""
        return list(self._inboxes)

    def peer_lost(self, peer: int, why: object) -> PeerLostError:
        """A connection to ``peer`` failed: fail everything pending here and tell the other peers (unless
        this rank is closing). Returns the error, for a caller that must also raise it."""
        err = PeerLostError(f"rank {self.rank}: lost rank {peer} over {self.name}: {why}", peer=peer, rank=self.rank)
        if self.closing or self.mailbox is None:
            return err
        if self.mailbox.aborted is None:
            log.warning("%s", err)
        self.abort(err, wait=False)
        return err

    # ---- the Transport calls ------------------------------------------------------------------------------
    def connect(self, ctx: TransportContext) -> None:
        self.rank, self.world_size, self.job = ctx.rank, ctx.world_size, ctx.job
        self.linger = ctx.collective_timeout
        self.mailbox = Mailbox(ctx.rank, ctx.job, ctx.max_early_bytes, on_mismatch=self._mismatch)
        peers = sorted(ctx.peers) if ctx.peers is not None else [p for p in range(ctx.world_size) if p != ctx.rank]
        self._inboxes = {p: FrameInbox(ctx.rank, p, self.mailbox) for p in peers}
        self._sent = dict.fromkeys(peers, 0)
        try:
            self.open(ctx)
        except BaseException:
            self.closing = True
            self.shutdown()
            raise

    def heard(self, peer: int, group: int, seq: int) -> bool:
        return self.mailbox.heard(peer, group, seq)

    def failure(self) -> BaseException | None:
        return self.mailbox.aborted if self.mailbox is not None else None  # no mailbox before connect

    def begin(self, group: int, seq: int) -> None:
        err = self.mailbox.begin(group, seq)
        if err is not None:
            self._mismatch(err)
            raise err

    def _mismatch(self, error: BaseException) -> None:
        """A peer ran a collective differently (another op, root or size at the same sequence number): every
        rank fails with the error, now, rather than finishing with different results."""
        if self.mailbox.aborted is None:
            log.error("%s", error)
        self.abort(error, wait=False)

    def irecv(self, peer: int, header: Header, out: memoryview) -> Request:
        return self.mailbox.post_recv(peer, header, out)

    def isend(self, peer: int, header: Header, data: memoryview, deadline: float) -> Request:
        req = Request()
        if self.mailbox.aborted is not None:
            req.complete(self.mailbox.aborted)
            return req
        if header.kind == DATA:
            with self._count_lock:
                self._sent[peer] += 1
        self.post(peer, header, data, deadline, req)
        return req

    def abort(self, error: BaseException, wait: bool = True) -> None:
        """Fail everything pending here and tell every reachable peer why (first cause wins; bounded).
        ``wait=False`` from the transport's own I/O threads, which must not wait on themselves."""
        first = self.mailbox.aborted is None
        self.mailbox.abort(error)
        if not first or self.closing:
            return
        self.fail_sends(self.mailbox.aborted or error)
        body = memoryview(abort_body(error))
        head = control(ABORT, self.job, nbytes=len(body))
        skip = gone_ranks(error)
        self._to_all([p for p in self._sent if p not in skip], lambda p: head, body, urgent=True, wait=wait)

    def run_program(self, program: Any, buffers: Any, op: Any) -> bool:
        """No path of its own: every collective runs through the executor (``Transport.run_program``)."""
        return False

    def forget(self, peers: set[int]) -> None:
        """During ``open``: ``peers`` are not this transport's after all (``ctx.settle`` or ``ctx.taken`` gave
        them to another): no frame, ABORT or BYE goes to them."""
        for peer in peers:
            self._inboxes.pop(peer, None)
            self._sent.pop(peer, None)

    def close(self) -> None:
        """BYE to every peer, after everything sent before it (waiting up to ``linger`` for it to leave, or
        ``_CONTROL_WAIT`` when the rank aborted), then ``shutdown``."""
        if self.closing:
            return
        self.closing = True
        if self.mailbox is not None:
            with self._count_lock:
                sent = dict(self._sent)
            within = _CONTROL_WAIT if self.mailbox.aborted is not None else self.linger
            self._to_all(list(sent), lambda p: control(BYE, self.job, seq=sent[p]), memoryview(b""), urgent=False,
                         wait=True, within=within)
        self.shutdown()

    @property
    def settling(self) -> bool:
        """Whether ``shutdown`` should wait for the peers to acknowledge what was sent (the rank did not abort)."""
        return self.mailbox is not None and self.mailbox.aborted is None

    def _to_all(self, peers: list[int], head: Callable[[int], Header], body: memoryview, *, urgent: bool,
                wait: bool, within: float = _CONTROL_WAIT) -> None:
        deadline = time.monotonic() + within
        reqs = []
        for peer in peers:
            r = Request()
            try:
                self.post(peer, head(peer), body, deadline, r, urgent)
            except Exception as exc:  # best effort: that peer is unreachable
                log.debug("rank %d: control frame to rank %d not sent: %s", self.rank, peer, exc)
                continue
            reqs.append(r)
        if wait:
            for r in reqs:
                try:
                    self.wait(r, deadline)
                except Exception:  # that peer is gone; the others still get theirs
                    pass
