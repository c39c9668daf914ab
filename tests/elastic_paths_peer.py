"""A peer of ``test_elastic.py``'s moved-paths test: 4 members, ``STEPS`` ring allreduces (average) of one value
per member. The member of rank 1 says, from step ``MOVE_AT`` until step ``BACK_AT``, that its transport reaches
rank 2 through a relay (as erdma-quic's ``slow_peers`` does after a direct path failed over to the TURN
relay); before each allreduce every member prints the step, the epoch, the ring order it runs in, its own
value and, after, the result."""

from __future__ import annotations

import os
import sys

import numpy as np

from erdma_core import elastic


def main() -> int:
    steps, move_at, back_at = (int(os.environ[k]) for k in ("STEPS", "MOVE_AT", "BACK_AT"))
    group = elastic.join({"w": np.zeros(4, np.float32)}, {"collectives.allreduce": "ring"})
    mine = float(os.getpid() % 97 + 1)
    while group.step < steps:
        group.sync()
        assert group.pg is not None
        transport = group.pg.transport
        if group.rank() == 1:  # the path to rank 2 moves to the relay, then back (test instrumentation)
            relayed = move_at <= group.step + 1 < back_at
            transport.slow_peers = (lambda: {2}) if relayed else (lambda: set())
        ring = list(group.pg.ring)
        x = np.full(4, mine, np.float32)
        if group.allreduce(x) == 0:
            continue
        group.step += 1
        print(f"step {group.step} epoch {group.epoch} ring {ring} mine {mine!r} result {float(x[0])!r}", flush=True)
    group.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
