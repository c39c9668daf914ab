"""A model-based congestion controller for aioquic (``congestion_control = "bbr"``), in the spirit of BBR v1:
it estimates the path's bottleneck bandwidth (windowed max of delivery-rate samples) and its minimum RTT,
and keeps about one bandwidth-delay product in flight. Random loss does not shrink the window, so a link
that drops 1% of packets for reasons other than congestion stays full; reno and cubic halve on every loss.

aioquic paces at ``congestion_window / smoothed_rtt``, so the window is the only control: a window of
``gain * BDP`` paces at ``gain * bw * min_rtt / srtt``, which settles with a queue of ``(gain - 1) * BDP``.
States: STARTUP (window grows by what is acknowledged, until the bandwidth stops growing 25% per round for
three rounds), DRAIN (one BDP, until the queue it built is gone), PROBE_BW (gains cycling around 1.2,
one phase per min RTT). A guard for real congestion: a round that loses more than ``LOSS_GUARD`` of what it
sent cuts the window to 0.8x (the model's next estimate restores it if the loss was not congestion).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from aioquic.quic.congestion.base import QuicCongestionControl, register_congestion_control
from aioquic.quic.packet_builder import QuicSentPacket

STARTUP, DRAIN, PROBE_BW = "startup", "drain", "probe_bw"
BW_WINDOW_ROUNDS = 10
MIN_RTT_WINDOW = 10.0  # seconds
PROBE_GAINS = (1.5, 0.9, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2)
FULL_BW_GROWTH = 1.25
FULL_BW_ROUNDS = 3
LOSS_GUARD = 0.2
MIN_PACKETS = 4


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

    # ---- the model ------------------------------------------------------------------------------------
    @property
    def bandwidth(self) -> float:
        return max((b for _, b in self._bw), default=0.0)

    def bdp(self) -> float:
        if not self._bw or math.isinf(self.min_rtt):
            return float(self.congestion_window)
        return self.bandwidth * self.min_rtt

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
            self.congestion_window = max(int(self.congestion_window * 0.8), MIN_PACKETS * self.mss)
        self._round_lost = self._round_acked = 0
        if self.state == STARTUP:
            bw = self.bandwidth
            if bw >= self._full_bw * FULL_BW_GROWTH:
                self._full_bw, self._full_bw_rounds = bw, 0
            else:
                self._full_bw_rounds += 1
                if self._full_bw_rounds >= FULL_BW_ROUNDS:
                    self.state = DRAIN

    def _set_window(self, now: float) -> None:
        bdp = self.bdp()
        floor = MIN_PACKETS * self.mss
        if self.state == DRAIN:
            self.congestion_window = max(int(bdp), floor)
            if self.bytes_in_flight <= bdp:
                self.state, self._cycle, self._cycle_stamp = PROBE_BW, 2, now
        if self.state == PROBE_BW:
            if now - self._cycle_stamp > self.min_rtt:
                self._cycle, self._cycle_stamp = (self._cycle + 1) % len(PROBE_GAINS), now
            self.congestion_window = max(int(PROBE_GAINS[self._cycle] * bdp), floor)

    # ---- aioquic's interface ---------------------------------------------------------------------------
    def on_packet_sent(self, *, packet: QuicSentPacket) -> None:
        if self.bytes_in_flight == 0:  # leaving idle: measure from now, not from the last ack
            self.delivered_time = self._first_sent = packet.sent_time or self.delivered_time
        self.bytes_in_flight += packet.sent_bytes
        self._sent[packet.packet_number] = (self.delivered, self.delivered_time, self._first_sent)

    def on_packet_acked(self, *, now: float, packet: QuicSentPacket) -> None:
        self.bytes_in_flight -= packet.sent_bytes
        self._round_acked += packet.sent_bytes
        if self._sample(now, packet):
            self._on_round(now)
        if self.state == STARTUP:
            self.congestion_window += packet.sent_bytes
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
        if rtt < self.min_rtt or now - self._min_rtt_stamp > MIN_RTT_WINDOW:
            self.min_rtt, self._min_rtt_stamp = rtt, now

    def get_log_data(self) -> dict[str, object]:
        return {**super().get_log_data(), "state": self.state, "bw": self.bandwidth, "min_rtt": self.min_rtt}


register_congestion_control("bbr", ModelBasedCongestionControl)
