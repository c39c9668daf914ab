"""The registration cache, on the host with a stand-in for the device's register/release: a buffer is
registered once whatever slice of it is sent, kept alive while cached, never released while a work request
reads it, and the least recently used go first once the cache is over its limit."""

from __future__ import annotations

import gc
import weakref

import numpy as np
from erdma_verbs.regcache import RegistrationCache, address_of


class FakeDevice:
    def __init__(self) -> None:
        self.live: dict[int, tuple[int, int]] = {}
        self.registered = 0

    def register(self, view: memoryview) -> object:
        self.registered += 1
        mr = type("MR", (), {"lkey": self.registered})()
        self.live[id(mr)] = (address_of(view), view.nbytes)
        return mr

    def release(self, mr: object) -> None:
        del self.live[id(mr)]


def test_slices_of_one_buffer_share_one_registration():
    dev = FakeDevice()
    cache = RegistrationCache(dev.register, dev.release, 1 << 30)
    arr = np.zeros(1 << 16, np.float32)
    whole = memoryview(arr).cast("B")
    first, addr = cache.lookup(whole[4096:8192])
    second, addr2 = cache.lookup(whole[100_000:200_000])
    assert first is second and dev.registered == 1
    assert (addr, addr2) == (arr.ctypes.data + 4096, arr.ctypes.data + 100_000)
    assert (first.base, first.end) == (arr.ctypes.data, arr.ctypes.data + arr.nbytes)
    assert (cache.hits, cache.misses) == (1, 1)


def test_a_cached_buffer_stays_alive_until_it_is_dropped():
    dev = FakeDevice()
    cache = RegistrationCache(dev.register, dev.release, 1 << 30)
    arr = np.ones(1000)
    alive = weakref.ref(arr)
    cache.lookup(memoryview(arr).cast("B"))
    del arr
    gc.collect()
    assert alive() is not None  # its memory cannot be handed out again under the registration
    cache.clear()
    gc.collect()
    assert alive() is None


def test_least_recently_used_go_first_but_never_one_in_use():
    dev = FakeDevice()
    cache = RegistrationCache(dev.register, dev.release, 3 * 4096)
    bufs = [np.zeros(4096, np.uint8) for _ in range(5)]
    regions = [cache.lookup(memoryview(b))[0] for b in bufs[:3]]
    regions[0].users += 1  # a write in flight reads it
    cache.lookup(memoryview(bufs[1]))  # used again: now the most recent but one
    cache.lookup(memoryview(bufs[3]))  # over the limit: the oldest not in use (bufs[2]) goes
    assert len(dev.live) == 3 and cache.bytes == 3 * 4096
    assert {v[0] for v in dev.live.values()} == {b.ctypes.data for b in (bufs[0], bufs[1], bufs[3])}
    cache.lookup(memoryview(bufs[4]))  # bufs[0] is in use, so bufs[1] goes
    assert {v[0] for v in dev.live.values()} == {b.ctypes.data for b in (bufs[0], bufs[3], bufs[4])}
    cache.done(regions[0])  # its write completed: it stays cached (the cache is at its limit, not over)
    assert cache.bytes == 3 * 4096 and len(dev.live) == 3


def test_a_region_evicted_while_in_use_is_released_when_its_last_write_completes():
    dev = FakeDevice()
    cache = RegistrationCache(dev.register, dev.release, 0)
    a, b = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    region = cache.lookup(memoryview(a))[0]
    region.users += 1
    cache.lookup(memoryview(b))
    cache.lookup(memoryview(np.zeros(10, np.uint8)))
    assert len(dev.live) == 2  # a (in use) and the newest; b went
    cache.done(region)
    assert len(dev.live) == 1
