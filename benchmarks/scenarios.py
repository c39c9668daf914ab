"""The lab's named, reproducible network scenarios (issue 4). ``loopback`` uses no lab at all."""

from __future__ import annotations

import attrs

from benchmarks.netlab.topology import LinkSpec

SCENARIOS: dict[str, LinkSpec | None] = {
    "loopback": None,  # the host's loopback, no namespaces: the peers' best case
    "lan": LinkSpec(),  # through the relay, no impairment
    "metro": LinkSpec(rtt_ms=2, rate_mbit=10_000),
    "regional": LinkSpec(rtt_ms=20, rate_mbit=1_000, loss=0.0001),
    "continental": LinkSpec(rtt_ms=40, rate_mbit=100, loss=0.001),
    "lossy": LinkSpec(rtt_ms=40, rate_mbit=100, loss=0.01),
    # long and fat: one TCP flow with the hosts' default buffers (send buffer up to 4 MiB) carries under half
    # of the link; both directions of it stay under the emulator's ceiling (benchmarks.longfat measures both)
    "longfat": LinkSpec(rtt_ms=300, rate_mbit=150),
}


def scenario(name: str, cc: str = "bbr") -> LinkSpec | None:
    try:
        spec = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"scenario {name!r}: valid choices are {', '.join(SCENARIOS)}") from None
    return None if spec is None else attrs.evolve(spec, cc=cc)
