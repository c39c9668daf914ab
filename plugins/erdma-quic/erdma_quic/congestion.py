"""A model-based congestion controller for aioquic (``congestion_control = "bbr"``), in the spirit of BBR v1:
it estimates the path's bottleneck bandwidth (windowed max of delivery-rate samples) and its minimum RTT,
and keeps about one bandwidth-delay product in flight. Random loss does not shrink the window, so a link
that drops 1% of packets for reasons other than congestion stays full; reno and cubic halve on every loss.

Like BBR, it paces at ``gain * bw`` and caps what is in flight at ``2 * bw * srtt`` (``CWND_GAIN``):
aioquic's own pacer paces at ``window / srtt``, which ties the two together, so a connection using this
controller gets ``ModelPacer`` (``attach``), which asks the controller for its rate. ``srtt`` is this
controller's smoothed RTT over samples clamped to 1 ms, as aioquic's.
States: STARTUP (pacing 2.89 x bw, window growing by what is acknowledged up to 2.89 x bw x srtt, until the
bandwidth stops growing 25% per round for three rounds in which the window was full), DRAIN (pacing
bw / 2.89 until what is in flight is down to one BDP), PROBE_BW (pacing gains 1.25, 0.75, then 1, one phase
per smoothed RTT). A guard for real congestion: a round that loses more than ``LOSS_GUARD`` of what it sent
scales the window and the pacing rate by 0.8 (compounding); every round without heavy loss gives back 10%.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from aioquic.quic.congestion.base import (
    K_GRANULARITY,
    K_INITIAL_WINDOW,
    QuicCongestionControl,
    register_congestion_control,
)
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet_builder import QuicSentPacket
from aioquic.quic.recovery import QuicPacketPacer

STARTUP, DRAIN, PROBE_BW = "startup", "drain", "probe_bw"
BW_WINDOW_ROUNDS = 10
MIN_RTT_WINDOW = 10.0  # seconds
PROBE_GAINS = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
STARTUP_GAIN = 2.89  # 2/ln 2: doubles what is delivered every round
DRAIN_GAIN = 1 / STARTUP_GAIN
CWND_GAIN = 2.0
FULL_BW_GROWTH = 1.25
FULL_BW_ROUNDS = 3
LOSS_GUARD = 0.2
MIN_PACKETS = 10


class ModelBasedCongestionControl(QuicCongestionControl):
    def __init__(self, *, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self.mss = max_datagram_size
        self.state = STARTUP
        self.delivered = 0
        self.delivered_time = 0.0
        # packet number -> (delivered, delivered_time, first_sent) when it was sent
        self._sent: dict[int, tuple[int, float, float]] = {}
        self._first_sent = 0.0  # send time of the packet most recently acknowledged
        self._bw: deque[tuple[int, float]] = deque()  # (round, highest delivery rate in it), oldest first
        self.min_rtt = math.inf
        self._min_rtt_stamp = 0.0
        self.round = 0
        self._round_end = 0  # the round ends when a packet sent after `delivered` reached this is acked
        self._full_bw = 0.0
        self._full_bw_rounds = 0
        self._cycle = 0
        self._cycle_stamp = 0.0
        self._round_lost = 0
        self._round_acked = 0
        self._round_limited = False  # the window, not the application, held sending back in this round
        self.srtt = 0.0
        self._guard = 1.0  # window scale the loss guard imposes, back to 1 after clean rounds

    # ---- the model ------------------------------------------------------------------------------------
    @property
    def bandwidth(self) -> float:
        return max((b for _, b in self._bw), default=0.0)

    def bdp(self, rtt: float | None = None) -> float:
        """Bandwidth times ``rtt`` (default: the minimum RTT); the current window while nothing is known."""
        if not self._bw or math.isinf(self.min_rtt):
            return float(self.congestion_window)
        return self.bandwidth * (self.min_rtt if rtt is None else rtt)

    def _sample(self, now: float, packet: QuicSentPacket) -> bool:
        """Take the delivery-rate sample the acked packet gives; True when it starts a new round."""
        info = self._sent.pop(packet.packet_number, None)
        self.delivered += packet.sent_bytes
        self.delivered_time = now
        if info is None:
            return False
        delivered0, time0, first_sent0 = info
        self._first_sent = packet.sent_time or now
        # the slower of the send and ack rates over the interval: ack compression cannot inflate it
        interval = max(now - time0, (packet.sent_time or now) - first_sent0)
        if interval > 0 and interval >= self.min_rtt:
            rate = (self.delivered - delivered0) / interval
            if self._bw and self._bw[-1][0] == self.round:
                if rate > self._bw[-1][1]:
                    self._bw[-1] = (self.round, rate)
            else:
                self._bw.append((self.round, rate))
            while self._bw and self._bw[0][0] <= self.round - BW_WINDOW_ROUNDS:
                self._bw.popleft()
        if delivered0 >= self._round_end:
            self.round += 1
            self._round_end = self.delivered
            return True
        return False

    def _on_round(self, now: float) -> None:
        sent = self._round_acked + self._round_lost
        if sent and self._round_lost > LOSS_GUARD * sent:
            self._guard *= 0.8
            self.congestion_window = max(int(self.congestion_window * 0.8), MIN_PACKETS * self.mss)
        else:
            self._guard = min(1.0, self._guard * 1.1)
        self._round_lost = self._round_acked = 0
        limited, self._round_limited = self._round_limited, False
        if self.state == STARTUP:
            bw = self.bandwidth
            if bw >= self._full_bw * FULL_BW_GROWTH:
                self._full_bw, self._full_bw_rounds = bw, 0
            elif limited:  # a round the application left idle proves nothing about the path
                self._full_bw_rounds += 1
                if self._full_bw_rounds >= FULL_BW_ROUNDS:
                    self.state = DRAIN

    def pacing_rate(self) -> float | None:
        """Bytes per second to pace at; None until the model has a bandwidth."""
        bw = self.bandwidth
        if not bw:
            return None
        gain = {STARTUP: STARTUP_GAIN, DRAIN: DRAIN_GAIN}.get(self.state, PROBE_GAINS[self._cycle])
        return gain * bw * self._guard

    def _set_window(self, now: float) -> None:
        floor = MIN_PACKETS * self.mss
        self.congestion_window = max(int(CWND_GAIN * self.bdp(max(self.srtt, self.min_rtt)) * self._guard), floor)
        if self.state == DRAIN and self.bytes_in_flight <= self.bdp():
            self.state, self._cycle, self._cycle_stamp = PROBE_BW, 2, now
        if self.state == PROBE_BW and now - self._cycle_stamp > max(self.min_rtt, self.srtt):
            self._cycle, self._cycle_stamp = (self._cycle + 1) % len(PROBE_GAINS), now

    # ---- aioquic's interface ---------------------------------------------------------------------------
    def on_packet_sent(self, *, packet: QuicSentPacket) -> None:
        if self.bytes_in_flight == 0:  # leaving idle: measure from now, not from the last ack
            self.delivered_time = self._first_sent = packet.sent_time or self.delivered_time
        self.bytes_in_flight += packet.sent_bytes
        if self.bytes_in_flight + self.mss > self.congestion_window:
            self._round_limited = True
        self._sent[packet.packet_number] = (self.delivered, self.delivered_time, self._first_sent)

    def on_packet_acked(self, *, now: float, packet: QuicSentPacket) -> None:
        self.bytes_in_flight -= packet.sent_bytes
        self._round_acked += packet.sent_bytes
        if self._sample(now, packet):
            self._on_round(now)
        if self.state == STARTUP:
            # slow-start growth, but never beyond STARTUP_GAIN x the model: an application that leaves the
            # window unused would otherwise grow it without bound, and aioquic's pacer (window / srtt) with it
            cap = max(STARTUP_GAIN * self.bdp(max(self.srtt, self.min_rtt)), K_INITIAL_WINDOW * self.mss)
            self.congestion_window = int(min(self.congestion_window + packet.sent_bytes, max(cap, self.congestion_window)))
        else:
            self._set_window(now)

    def on_packets_expired(self, *, packets: Iterable[QuicSentPacket]) -> None:
        for packet in packets:
            self.bytes_in_flight -= packet.sent_bytes
            self._sent.pop(packet.packet_number, None)

    def on_packets_lost(self, *, now: float, packets: Iterable[QuicSentPacket]) -> None:
        for packet in packets:
            self.bytes_in_flight -= packet.sent_bytes
            self._round_lost += packet.sent_bytes
            self._sent.pop(packet.packet_number, None)

    def on_persistent_congestion(self) -> None:
        self.congestion_window = MIN_PACKETS * self.mss

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        clamped = max(rtt, K_GRANULARITY)  # as aioquic's own smoothed RTT, which its pacer divides by
        self.srtt = clamped if not self.srtt else 0.875 * self.srtt + 0.125 * clamped
        if rtt < self.min_rtt or now - self._min_rtt_stamp > MIN_RTT_WINDOW:
            self.min_rtt, self._min_rtt_stamp = rtt, now

    def get_log_data(self) -> dict[str, object]:
        return {**super().get_log_data(), "state": self.state, "bw": self.bandwidth, "min_rtt": self.min_rtt}


register_congestion_control("bbr", ModelBasedCongestionControl)


class ModelPacer(QuicPacketPacer):
    """aioquic's token-bucket pacer at the rate the model asks for (aioquic's own rate: window / srtt)."""

    def __init__(self, cc: ModelBasedCongestionControl, *, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self.cc = cc

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        rate = self.cc.pacing_rate()
        if rate is None:
            super().update_rate(congestion_window, smoothed_rtt)
            return
        # the parent derives its rate as window / rtt: hand it the window that gives ours
        super().update_rate(int(rate), 1.0)


def attach(conn: QuicConnection) -> None:
    """Give ``conn`` the model's pacer when its controller is this one (call right after creating it)."""
    loss = conn._loss
    if isinstance(loss._cc, ModelBasedCongestionControl):
        loss._pacer = ModelPacer(loss._cc, max_datagram_size=conn._max_datagram_size)
