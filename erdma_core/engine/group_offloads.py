"""``Offloads``: one group's offloaded algorithms (``engine.offload``): each made once, on the first collective
that selects it, run for every collective that does, its fallbacks logged and counted, all closed with the
group."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..algorithms.schedule import Options
from ..errors import AbortedError, ErdmaError, PluginError
from ..transport.base import Transport
from .offload import Fallback, HostChannel, Offload, OffloadCall, OffloadContext

log = logging.getLogger("erdma.collectives")


class Offloads:
    """The offloads of group ``group`` (its members' global ``ranks``; this is global rank ``rank``) of job
    ``job``: ``algorithm(op, name)`` gives a registered algorithm's component and options, ``config`` is the
    job's effective config, ``secret`` its secret; ``chunk_bytes`` what the group's ``HostChannel`` chunks
    by. ``label`` names the group in errors (set it when the group is named)."""

    def __init__(self, *, transport: Transport, algorithm: Callable[[str, str], tuple[Any, Options]], job: int,
                 group: int, ranks: Sequence[int], rank: int, timeout: float, chunk_bytes: int, config: Any,
                 secret: bytes) -> None:
        self._transport, self._algorithm, self._job, self._group = transport, algorithm, job, group
        self._ranks, self._rank, self._timeout, self._chunk_bytes = tuple(ranks), rank, timeout, chunk_bytes
        self._config, self._secret = config, secret
        self.label = f"group {group}"
        self._host: HostChannel | None = None
        self._made: dict[Any, tuple[str, Offload]] = {}  # factory -> (name, its object for this group)
        self._counters: collections.Counter[str] = collections.Counter()
        self._reasons: set[str] = set()

    def run(self, component: Any, call: OffloadCall) -> Fallback | None:
        """Run ``call`` through the group's object of the offload ``component``; its Fallback, if any, is
        logged and counted here (the caller runs the host algorithm)."""
        what = f"{call.op}.{component.name}"
        try:
            got = self._object(component).run(call)
        except ErdmaError as exc:
            self._transport.abort(exc)  # the peers must not wait for this rank until their timeout
            raise
        except Exception as exc:
            self._transport.abort(AbortedError(
                f"rank {self._rank}: {call.op} ({self.label}, seq {call.seq}) failed there in "
                f"{component.name}: {type(exc).__name__}: {exc}", rank=self._rank, op=call.op))
            raise
        if got is None:
            self._counters[f"{what}.offloaded"] += 1
            return None
        if not isinstance(got, Fallback):
            raise PluginError(f"{call.op} algorithm {component.name!r} of plugin {component.plugin!r} returned "
                              f"{type(got).__name__}; expected None or erdma_core.sdk.Fallback")
        self._counters[f"{what}.fallback"] += 1
        self._counters[f"{what}.fallback.{got.algorithm}"] += 1
        first = got.reason not in self._reasons
        self._reasons.add(got.reason)
        log.log(logging.WARNING if first else logging.INFO, "rank %d: %s (group %d, seq %d) runs on the hosts "
                "with %s instead of %s: %s", self._rank, call.op, self._group, call.seq, got.algorithm,
                component.name, got.reason)
        return got

    def _object(self, component: Any) -> Offload:
        found = self._made.get(component.factory)
        if found is not None:
            return found[1]
        if self._host is None:
            self._host = HostChannel(transport=self._transport, algorithm=self._algorithm, job=self._job,
                                     group=self._group, ranks=self._ranks, rank=self._rank, timeout=self._timeout,
                                     chunk_bytes=self._chunk_bytes)
        _, options = self._algorithm(component.op, component.name)
        made = component.factory(OffloadContext(
            job=self._job, group=self._group, rank=self._ranks.index(self._rank), size=len(self._ranks),
            ranks=self._ranks, timeout=self._timeout, options=options, config=self._config, host=self._host,
            secret=self._secret))
        self._made[component.factory] = (component.name, made)
        return made

    def objects(self) -> list[Offload]:
        """The offloads made for this group so far, in the order they were made."""
        return [made for _, made in self._made.values()]

    def counters(self) -> dict[str, int]:
        """``<op>.<algorithm>.offloaded``, ``.fallback`` and ``.fallback.<host algorithm>``, and what each
        offload's own ``counters()`` (optional) reports, as ``<algorithm>.<name>``."""
        out = dict(self._counters)
        for name, offload in self._made.values():
            own = getattr(offload, "counters", None)
            if own is not None:
                out.update({f"{name}.{k}": v for k, v in own().items()})
        return out

    def close(self) -> None:
        """Close every offload made (a plugin's failing close is logged: it must not keep the group open)."""
        for _, offload in self._made.values():
            try:
                offload.close()
            except Exception:
                log.exception("rank %d: closing an offloaded algorithm failed", self._rank)
        self._made.clear()
