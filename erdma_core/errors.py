"""Exception types raised by eRDMA. Every message names the rank, the op and the peer involved."""

from __future__ import annotations

__all__ = [
    "AbortedError", "AuthenticationError", "CollectiveError", "CollectiveTimeoutError", "ConfigError", "ErdmaError",
    "IntegrityError", "MismatchError", "PeerLostError", "PluginError", "ProtocolError", "UnreachableError",
]


class ErdmaError(RuntimeError):
    """Base class of every error eRDMA raises on purpose."""


class ConfigError(ErdmaError, ValueError):
    """A config key or value is wrong; the message names the key, the value and the valid choices."""


class PluginError(ErdmaError):
    """A selected component is unknown or failed to load; the message names the plugin and the cause."""


class CollectiveError(ErdmaError):
    """A collective failed; ``rank`` is the local rank, ``op`` the collective's name."""

    def __init__(self, message: str, *, rank: int | None = None, op: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.op = op

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only fields survive pickling (errors cross processes)
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


def _rebuild(cls: type[CollectiveError], message: str, fields: dict[str, object]) -> CollectiveError:
    return cls(message, **fields)  # type: ignore[arg-type]


class PeerLostError(CollectiveError):
    """A peer's connection closed or broke; ``peer`` is the lost rank."""

    def __init__(self, message: str, *, peer: int, rank: int | None = None, op: str | None = None) -> None:
        super().__init__(message, rank=rank, op=op)
        self.peer = peer


class IntegrityError(CollectiveError):
    """A frame failed its integrity check: its bytes were changed between the ranks (a faulty NIC or
    middlebox, or someone on the path). ``peer`` is the rank whose frame failed; the message names the link.
    Every rank of the job fails with it, never with a wrong result."""

    def __init__(self, message: str, *, peer: int, rank: int | None = None, op: str | None = None) -> None:
        super().__init__(message, rank=rank, op=op)
        self.peer = peer


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A blocking call did not finish within its timeout."""


class UnreachableError(CollectiveTimeoutError):
    """A transport's set-up did not connect to some ranks within ``timeouts.connect``; ``peers`` are those ranks
    (no path between the two: a NAT, a firewall; or the peer never came)."""

    def __init__(self, message: str, *, peers: tuple[int, ...] = (), rank: int | None = None,
                 op: str | None = None) -> None:
        super().__init__(message, rank=rank, op=op)
        self.peers = tuple(peers)


class MismatchError(CollectiveError):
    """Ranks called a collective with different ops, shapes, dtypes or roots."""


class ProtocolError(ErdmaError):
    """A peer sent bytes that do not follow the wire format (or belong to another job)."""


class AbortedError(CollectiveError):
    """The process group was aborted by an earlier failure; the message carries the first cause. ``gone``: ranks
    the aborting caller said are gone (``ProcessGroup.abort(gone=...)``), which nothing waits on as it closes."""

    def __init__(self, message: str, *, gone: tuple[int, ...] = (), rank: int | None = None,
                 op: str | None = None) -> None:
        super().__init__(message, rank=rank, op=op)
        self.gone = tuple(gone)


def gone_ranks(error: BaseException) -> set[int]:
    """The ranks ``error`` says are gone: a ``PeerLostError``'s peer, an abort's ``gone`` (an IntegrityError's
    peer is not: it is alive, and told)."""
    ranks = set(getattr(error, "gone", ()))
    if isinstance(error, PeerLostError):
        ranks.add(error.peer)
    return ranks


class AuthenticationError(ErdmaError):
    """A peer or the store could not prove it knows the job's secret (``security.secret``), or this rank could
    not prove it to them: most often the ranks were started with different secrets."""
