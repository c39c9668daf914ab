"""``PairedTransport``: a job whose pairs are split over two transports (built-in TCP and a fallback). A failure
of one is the other's too, also between collectives."""

from __future__ import annotations

from erdma_core.errors import PeerLostError
from erdma_core.transport.paired import PairedTransport


class _Part:
    """What PairedTransport asks of a part here: its failure, and an abort that records how it was asked."""

    def __init__(self, name: str) -> None:
        self.name, self.devices, self.stripes = name, frozenset({"cpu"}), 1
        self.error: BaseException | None = None
        self.aborts: list[tuple[BaseException, bool]] = []

    def failure(self) -> BaseException | None:
        return self.error

    def abort(self, error: BaseException, wait: bool = True) -> None:
        self.aborts.append((error, wait))
        self.error = self.error or error


def test_a_loss_on_one_transport_aborts_the_other_when_asked_between_collectives() -> None:
    """TCP lost rank 0; nothing is running. The first look at the job's failure (an elastic member's beat thread
    asks every round) aborts QUIC with the same error, without waiting on its peers, once; before the loss
    nothing is aborted."""
    tcp, quic = _Part("tcp"), _Part("quic")
    paired = PairedTransport(tcp, quic)  # type: ignore[arg-type]
    paired._used = [tcp, quic]  # type: ignore[list-item]
    assert paired.failure() is None and quic.aborts == [] and tcp.aborts == []
    lost = PeerLostError("rank 2: lost rank 0 over TCP: it closed the connection", peer=0, rank=2)
    tcp.error = lost
    assert paired.failure() is lost
    assert quic.aborts == [(lost, False)] and tcp.aborts == []
    assert paired.failure() is lost and len(quic.aborts) == 1
