"""The model-based controller against aioquic's reno and cubic on a simulated bottleneck (no sockets, no
clock): a FIFO link of fixed rate and buffer, a fixed propagation delay and random loss; every packet acked
on arrival; loss declared by packet threshold as QUIC does."""

from __future__ import annotations

import heapq
import math
import random

import aioquic.quic.recovery  # noqa: F401  registers reno and cubic
import erdma_quic.congestion  # noqa: F401  registers "bbr"
import pytest
from aioquic.quic.congestion.base import create_congestion_control
from aioquic.quic.packet_builder import QuicSentPacket
from aioquic.tls import Epoch
from erdma_quic.congestion import (
    CWND_GAIN,
    DRAIN,
    MIN_PACKETS,
    PROBE_BW,
    STARTUP,
    ModelBasedCongestionControl,
)

MSS = 1200


def simulate(name: str, *, rate: float, rtt: float, loss: float, seconds: float, buffer_bdp: float = 1.0,
             seed: int = 1, ack_delay: float = 0.0) -> tuple[float, object]:
    """Goodput (bytes/s delivered) of one bulk flow under controller ``name``; with ``ack_delay`` the
    receiver acknowledges in batches that often, as a busy or ACK-delaying receiver does."""
    rng = random.Random(seed)
    cc = create_congestion_control(name, max_datagram_size=MSS)
    buffer = buffer_bdp * rate * rtt
    events: list[tuple[float, int, str, QuicSentPacket | None]] = []
    seq = 0
    link_free = 0.0  # when the bottleneck finishes its current backlog
    now = 0.0
    pn = 0
    outstanding: dict[int, QuicSentPacket] = {}
    delivered = 0
    srtt = rtt
    while now < seconds:
        while cc.bytes_in_flight + MSS <= cc.congestion_window:
            pkt = QuicSentPacket(epoch=Epoch.ONE_RTT, in_flight=True, is_ack_eliciting=True, is_crypto_packet=False,
                                 packet_number=pn, packet_type=0, sent_time=now, sent_bytes=MSS)
            pn += 1
            cc.on_packet_sent(packet=pkt)
            outstanding[pkt.packet_number] = pkt
            queued = max(0.0, link_free - now) * rate
            if queued + MSS > buffer or rng.random() < loss:
                continue  # dropped: at the full queue, or at random
            link_free = max(link_free, now) + MSS / rate
            seq += 1
            arrive = link_free + rtt
            if ack_delay:  # the receiver acknowledges in batches, every ack_delay seconds
                arrive = math.ceil(link_free / ack_delay) * ack_delay + rtt
            heapq.heappush(events, (arrive, seq, "ack", pkt))
        if not events:
            break
        now, _, _, pkt = heapq.heappop(events)
        assert pkt is not None
        if pkt.packet_number not in outstanding:
            continue
        del outstanding[pkt.packet_number]
        cc.on_packet_acked(now=now, packet=pkt)
        delivered += MSS
        srtt = 0.875 * srtt + 0.125 * (now - pkt.sent_time)
        cc.on_rtt_measurement(now=now, rtt=now - pkt.sent_time)
        lost = [p for n, p in outstanding.items() if n < pkt.packet_number - 3]
        if lost:
            for p in lost:
                del outstanding[p.packet_number]
            cc.on_packets_lost(now=now, packets=lost)
    return delivered / now, cc


@pytest.mark.parametrize("loss", [0.001, 0.01])
def test_random_loss_does_not_collapse_the_model(loss):
    """100 Mbit/s, 40 ms, one-BDP buffer: the model keeps the link nearly full at 0.1% and 1% loss;
    reno and cubic, which halve on every loss, fall far behind."""
    rate = 100e6 / 8
    goodput = {name: simulate(name, rate=rate, rtt=0.04, loss=loss, seconds=20)[0] for name in ("bbr", "cubic", "reno")}
    assert goodput["bbr"] >= 0.85 * rate * (1 - loss), goodput
    assert goodput["bbr"] >= 3 * max(goodput["cubic"], goodput["reno"]), goodput


def test_clean_link_is_filled_with_the_window_the_model_sets():
    rate = 50e6 / 8
    goodput, cc = simulate("bbr", rate=rate, rtt=0.02, loss=0.0, seconds=10)
    assert goodput >= 0.9 * rate
    assert isinstance(cc, ModelBasedCongestionControl)
    assert cc.state == PROBE_BW
    assert 0.8 * rate <= cc.bandwidth <= 1.1 * rate
    assert 0.02 <= cc.min_rtt <= 0.025
    assert cc.srtt <= 2.1 * 0.02  # the queue stays within the one-BDP buffer
    assert cc.congestion_window <= CWND_GAIN * 1.1 * rate * cc.srtt + MIN_PACKETS * MSS


def test_late_acks_on_a_short_path_do_not_starve_the_flow():
    """1 ms RTT, 800 Mbit/s, ACKs sent every 10 ms: the window follows bw x srtt, not bw x min_rtt."""
    rate = 800e6 / 8
    goodput, cc = simulate("bbr", rate=rate, rtt=0.001, loss=0.0, seconds=1.5, buffer_bdp=20, ack_delay=0.01)
    assert goodput >= 0.8 * rate, (goodput, cc.get_log_data())


def test_startup_leaves_when_bandwidth_stops_growing():
    _, cc = simulate("bbr", rate=10e6 / 8, rtt=0.01, loss=0.0, seconds=2)
    assert isinstance(cc, ModelBasedCongestionControl) and cc.state not in (STARTUP, DRAIN)


def test_heavy_loss_guard_shrinks_the_window():
    cc = ModelBasedCongestionControl(max_datagram_size=MSS)
    cc.congestion_window = 100 * MSS
    cc._round_lost, cc._round_acked = 30 * MSS, 70 * MSS
    cc._on_round(1.0)
    assert cc.congestion_window == 80 * MSS


def test_connections_with_the_model_pace_at_its_rate():
    """aioquic paces at window / srtt; a connection using the model gets a pacer that asks it instead."""
    from aioquic.quic.configuration import QuicConfiguration
    from erdma_quic.aioquic_engine import Quic as Connection
    from erdma_quic.congestion import ModelPacer

    conn = Connection(configuration=QuicConfiguration(is_client=True, congestion_control_algorithm="bbr",
                                                      max_datagram_size=MSS))
    pacer, cc = conn._loss._pacer, conn._loss._cc
    assert isinstance(pacer, ModelPacer) and pacer.cc is cc
    cc._bw.append((0, 1e6))
    cc.state = PROBE_BW
    cc._cycle = 0  # the 1.25 probing phase
    pacer.update_rate(congestion_window=10 * MSS, smoothed_rtt=0.5)  # aioquic's own rate would be 24 KB/s
    assert pacer.packet_time == pytest.approx(MSS / 1.25e6)
    plain = Connection(configuration=QuicConfiguration(is_client=True, congestion_control_algorithm="cubic"))
    assert not isinstance(plain._loss._pacer, ModelPacer)
