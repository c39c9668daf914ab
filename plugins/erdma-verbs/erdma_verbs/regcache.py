"""Registration cache: a send from user memory needs that memory registered (pinned, translated by the
device), which costs a system call and a page walk; registering each message's memory once and keeping it
makes repeated collectives on the same tensors free of it. An entry covers the whole buffer a message's
memory belongs to (so the chunks of one tensor share one region) and keeps that buffer alive while cached:
memory cannot be freed and handed out again under a region that still points at the old pages. Entries in
use by work requests in flight are never evicted; the rest go least recently used first once the cache holds
more than ``limit`` bytes. No verbs here: ``register``/``release`` are the device's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from erdma_core.toolkit import address_of


class Region:
    __slots__ = ("base", "end", "keep", "lkey", "mr", "users")

    def __init__(self, base: int, end: int, keep: Any, mr: Any) -> None:
        self.base, self.end, self.keep, self.mr = base, end, keep, mr
        self.lkey = mr.lkey
        self.users = 0  # work requests in flight that read it


def _whole(view: memoryview) -> memoryview:
    """The whole buffer ``view`` is part of (the exporter's), or ``view`` itself when that is not contiguous."""
    try:
        whole = memoryview(view.obj).cast("B")
    except (TypeError, ValueError):
        return view
    base, mine = address_of(whole), address_of(view)
    return whole if base <= mine and mine + view.nbytes <= base + whole.nbytes else view


class RegistrationCache:
    def __init__(self, register: Callable[[memoryview], Any], release: Callable[[Any], None], limit: int) -> None:
        self.register, self.release, self.limit = register, release, limit
        self.bytes = 0
        self.hits = self.misses = 0
        self._regions: OrderedDict[int, Region] = OrderedDict()  # base address -> region, oldest use first

    def lookup(self, view: memoryview) -> tuple[Region, int]:
        """The region holding ``view`` and ``view``'s address; the caller adds one to ``users`` per work
        request and calls ``done`` when each completes."""
        addr = address_of(view)
        for base, region in reversed(self._regions.items()):  # the most recent first
            if region.base <= addr and addr + view.nbytes <= region.end:
                self._regions.move_to_end(base)
                self.hits += 1
                return region, addr
        self.misses += 1
        whole = _whole(view)
        base = address_of(whole)
        region = Region(base, base + whole.nbytes, whole, self.register(whole))
        old = self._regions.pop(base, None)
        if old is not None:  # a smaller region at the same address (a view first, its whole buffer later)
            self._drop(old)
        self._regions[base] = region
        self.bytes += whole.nbytes
        self._evict()
        return region, addr

    def done(self, region: Region) -> None:
        region.users -= 1
        if region.users == 0 and region.keep is None:  # evicted while in use: release now
            self.release(region.mr)
        elif self.bytes > self.limit:
            self._evict()

    def _evict(self) -> None:
        for base in list(self._regions)[:-1]:  # never the one just used
            if self.bytes <= self.limit:
                return
            region = self._regions[base]
            if region.users == 0:
                del self._regions[base]
                self._drop(region)

    def _drop(self, region: Region) -> None:
        self.bytes -= region.end - region.base
        region.keep = None
        if region.users == 0:
            self.release(region.mr)

    def clear(self) -> None:
        """Forget every region (the device releases them all when it closes)."""
        self._regions.clear()
        self.bytes = 0
