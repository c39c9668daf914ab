"""pytest plugin (entry point ``pytest11: erdma``): fixtures that start N-rank worlds in real processes.

    def test_mine(erdma_world):
        world = erdma_world(4, {"transport.name": "quic"})
        assert world.run(my_check) == [True] * 4
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from .world import World

WorldFactory = Callable[..., World]


def _factory(store: dict[Any, World] | None, opened: list[World]) -> WorldFactory:
    def make(size: int, config: Mapping[str, Any] | None = None, **kw: Any) -> World:
        key = (size, tuple(sorted((config or {}).items())), tuple(sorted(kw.items())))
        if store is not None and key in store:
            return store[key]
        world = World(size, config, **kw)
        opened.append(world)
        if store is not None:
            store[key] = world
        return world
    return make


@pytest.fixture
def erdma_world() -> Iterator[WorldFactory]:
    """A factory ``erdma_world(size, config=None, *, init_method=None, timeout=120)`` (``timeout`` bounds each
    call; set-up gets at least ``world.INIT_TIMEOUT``); worlds close after the test. Use it for tests that
    break their world (kill a rank, abort)."""
    opened: list[World] = []
    yield _factory(None, opened)
    for w in opened:
        w.close()


@pytest.fixture(scope="session")
def erdma_shared_world() -> Iterator[WorldFactory]:
    """Like ``erdma_world`` but worlds are kept for the session and reused for equal arguments. Only for
    tests that leave their world healthy."""
    opened: list[World] = []
    yield _factory({}, opened)
    for w in opened:
        w.close()
