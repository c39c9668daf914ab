"""Slow links, as the algorithms see them: pairs of ranks whose transport reaches each other the slow way
(erdma-quic through a TURN relay). The ranks agree on them at set-up, through the discovery store, and again
in each round of ``ProcessGroup.agree_paths`` (an elastic group runs one at the step boundary after a member's
paths changed); a ring allreduce then runs in an order that puts as few of them as it can between ring
neighbours (``ring_order``). Every rank computes the same order from the same links, so no further agreement
is needed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

Links = frozenset[frozenset[int]]
EXHAUSTIVE = 8  # up to this many ranks every ring is tried; above, a greedy ring improved by 2-opt


def agree(store: Any, rank: int, world: int, mine: Iterable[int], timeout: float, round_: int = 0) -> Links:
    """Publish this rank's slow peers (``erdma/slow/RANK``; in a later round ``erdma/slow/ROUND/RANK``) and read
    every rank's; a pair counts as slow when either end says so, so every rank ends with the same set."""
    key = "erdma/slow/" + (f"{round_}/" if round_ else "")
    store.set(f"{key}{rank}", ",".join(str(p) for p in sorted(set(mine))).encode())
    links: set[frozenset[int]] = set()
    for r in range(world):
        value = store.get(f"{key}{r}", timeout).decode()
        links.update(frozenset({r, int(p)}) for p in value.split(",") if p and int(p) != r and 0 <= int(p) < world)
    return frozenset(links)


def slow_edges(order: tuple[int, ...], slow: Links) -> int:
    """How many ring neighbours in ``order`` (three ranks or more) are joined by a slow link."""
    n = len(order)
    return sum(frozenset({order[i], order[(i + 1) % n]}) in slow for i in range(n))


def ring_order(size: int, slow: Links) -> tuple[int, ...]:
    """A ring of ranks ``0..size-1`` with as few slow links between neighbours as this finds: the identity
    when it has none (or when nothing beats it), else the first best ring starting at rank 0 (every ring up to
    ``EXHAUSTIVE`` ranks; above, greedy then 2-opt). Deterministic: every rank gets the same ring."""
    identity = tuple(range(size))
    if size <= 3 or not slow or slow_edges(identity, slow) == 0:
        return identity
    if size <= EXHAUSTIVE:
        best = min((identity[:1] + rest for rest in itertools.permutations(identity[1:])),
                   key=lambda order: slow_edges(order, slow))
    else:
        best = _two_opt(_greedy(size, slow), slow)
    return best if slow_edges(best, slow) < slow_edges(identity, slow) else identity


def _greedy(size: int, slow: Links) -> tuple[int, ...]:
    """From rank 0, the lowest unvisited rank joined by a fast link, else the lowest unvisited one."""
    order, left = [0], set(range(1, size))
    while left:
        here = order[-1]
        nxt = min(left, key=lambda r: (frozenset({here, r}) in slow, r))
        order.append(nxt)
        left.remove(nxt)
    return tuple(order)


def _two_opt(order: tuple[int, ...], slow: Links) -> tuple[int, ...]:
    """Reverse stretches of the ring while that removes slow neighbours (a bounded number of passes)."""
    best, score = list(order), slow_edges(order, slow)
    for _ in range(4):
        improved = False
        for i in range(1, len(best) - 1):
            for j in range(i + 1, len(best)):
                cand = best[:i] + best[i:j + 1][::-1] + best[j + 1:]
                s = slow_edges(tuple(cand), slow)
                if s < score:
                    best, score, improved = cand, s, True
        if not improved or score == 0:
            break
    return tuple(best)
