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
            if not store[key].broken:
                return store[key]
            store.pop(key).close()  # a rank of it died or hung in an earlier test: later ones get a new world
        world = World(size, config, **kw)
        opened.append(world)
        if store is not None:
            store[key] = world
        return world
    return make


@pytest.fixture
def erdma_world() -> Iterator[WorldFactory]:
    """A factory ``erdma_world(size, config=None, *, init_method=None, timeout=None)`` (``timeout`` bounds each
    call: None, 120 s or ``PYTEST_ERDMA_TIMEOUT``; set-up gets at least ``world.INIT_TIMEOUT``); worlds close
    after the test. Use it for tests that break their world (kill a rank, abort)."""
    opened: list[World] = []
    yield _factory(None, opened)
    for w in opened:
        w.close()


@pytest.fixture(scope="session")
def erdma_shared_world() -> Iterator[WorldFactory]:
    """Like ``erdma_world`` but worlds are kept for the session and reused for equal arguments. Only for
    tests that leave their world healthy; one whose rank died or did not answer is replaced for the next test
    (its failure stays its own test's, not every later one's)."""
    opened: list[World] = []
    yield _factory({}, opened)
    for w in opened:
        w.close()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup``: a test with no ``xdist_group`` mark of its own goes with the
    rest of its file (as ``--dist loadfile`` sends it), except that a test on ``erdma_shared_world`` with a
    ``size`` parameter goes with its file's tests of that size: those share their worlds (kept per worker, and
    costly to set up over QUIC), and a file's sizes spread over the workers. An explicit
    ``@pytest.mark.xdist_group(name)`` wins: a file's long tests can run beside each other."""
    if not getattr(config.option, "loadgroup", False):  # what pytest-xdist sets for --dist loadgroup, on workers too
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        group = item.nodeid.split("::", 1)[0]
        size = getattr(getattr(item, "callspec", None), "params", {}).get("size")
        if size is not None and "erdma_shared_world" in getattr(item, "fixturenames", ()):
            group += f":{size}"
        item.add_marker(pytest.mark.xdist_group(group))
