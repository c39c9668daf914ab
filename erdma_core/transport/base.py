"""What a transport provides. Algorithms never see a transport; the executor drives it with these calls."""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from ..discovery.store import Store
from .mailbox import Request
from .wire import Header


@attrs.frozen
class TransportContext:
    """Everything a transport needs at set-up."""

    rank: int
    world_size: int
    store: Store
    job: int
    connect_timeout: float
    advertise: Any = None  # traversal: ``advertise(host, port) -> (host, port)``
    udp_socket: Any = None  # a bound UDP socket handed over by the traversal (``Traversal.udp_socket``), or None


class Transport(Protocol):
    """A full mesh of reliable, ordered message channels between the ranks of one job.

    Contract: ``connect`` returns once every peer is reachable or raises (within ``connect_timeout``).
    ``isend``/``irecv`` never block for long and return a ``Request``; frames between two ranks are
    delivered in order; a receive matches a send by (peer, ``header.key``); a receive whose header
    disagrees with the sender's (opcode, dtype, numel, nbytes) fails with ``MismatchError``. A lost
    peer fails every pending and later request with ``PeerLostError``. ``abort`` fails everything and
    tells the peers (they fail with ``AbortedError`` carrying the reason). ``close`` is idempotent.

    ``devices`` names the device types whose memory the transport moves without a host copy ("cpu" for
    host memory). Front ends (the torch backend) stage tensors of any other device through host memory,
    and must not when the transport names that device.
    """

    rank: int
    world_size: int
    devices: frozenset[str]

    def connect(self, ctx: TransportContext) -> None: ...

    def isend(self, peer: int, header: Header, data: memoryview, deadline: float) -> Request: ...

    def irecv(self, peer: int, header: Header, out: memoryview) -> Request: ...

    def begin(self, group: int, seq: int) -> None: ...

    def abort(self, error: BaseException) -> None: ...

    def close(self) -> None: ...
