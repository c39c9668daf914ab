"""Every hook eRDMA calls, in one module. Each docstring is the contract a plugin relies on.

Plugins implement hooks with ``@erdma_core.hookimpl`` in a module (or object) named by an entry point in
the group ``erdma.plugins``. The core's own components register through these same hooks
(``erdma_core.plugins.builtin``). Registration hooks are called once, when the core's plugin manager is
built; decision hooks are called at most once per collective, never per chunk. The types named here are
``erdma_core.sdk``'s (the contract); the bases many components build on are ``erdma_core.toolkit``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

from ..protocol.config import Config

if TYPE_CHECKING:
    from ..config.option import Option

hookspec = pluggy.HookspecMarker("erdma")
hookimpl = pluggy.HookimplMarker("erdma")


Check = Callable[[Config, dict[str, Any]], None]
"""``check(config, section)``: a component's rules over the whole config (``Config``) and its own section's values,
as ``register(..., check=)`` gives it. Called on every rank when the config is loaded (``erdma_core.load_config``:
``init``, ``erdma run`` before it starts any rank, ``erdma config show``), only while the component is selected,
before the rank contacts anyone: it raises ``ConfigError`` naming the key, the value and what is valid for a
setting that cannot take effect (two settings that cannot go together, a value its ``Option`` bounds cannot
say). It touches no network and no file beyond reading one it is named (a CA file); what depends on other
hosts is the factory's, at set-up."""


class Register(Protocol):
    """What the registration hooks of transports, discovery methods, traversals and compressors are given."""

    def __call__(self, name: str, factory: Callable[..., Any], *, options: Mapping[str, Option] | None = None,
                 description: str = "", sdk: int | None = None, check: Check | None = None) -> None: ...


class RegisterAlgorithm(Protocol):
    """What ``erdma_register_algorithms`` is given."""

    def __call__(self, op: str, name: str, schedule_fn: Callable[..., Any], *,
                 options: Mapping[str, Option] | None = None, description: str = "", offload: bool = False,
                 sdk: int | None = None, check: Check | None = None) -> None: ...


class RegisterEnvironment(Protocol):
    """What ``erdma_register_environment`` is given."""

    def __call__(self, name: str, description: str) -> None: ...


@hookspec
def erdma_register_transports(register: Register) -> None:
    """Register transport factories.

    Called by: the core's plugin manager once, when the plugin manager is built.
    Arguments: ``register(name, factory, *, options=None, description="", sdk=None, check=None)``.
    ``check(config, section)`` (every registration hook takes one; ``Check`` above says when it is called and
    what it may do) refuses settings that cannot take effect, before any rank contacts another. ``factory(config,
    section)`` returns an object that satisfies ``erdma_core.sdk.Transport`` (most subclass
    ``erdma_core.toolkit.MessageTransport``, or ``erdma_core.toolkit.SocketTransport`` for stream sockets); it must be
    cheap to import and do heavy imports (aioquic, pyverbs) only when called. ``sdk`` is the version of
    ``erdma_core.sdk`` the transport was written for, as a number: ``erdma_core.sdk.VERSION``, or the version
    before it, which loads through the SDK's adapter; a transport that says another, or none, is refused
    (logged, listed by ``erdma plugins``, a PluginError when selected). A factory with the attribute
    ``takes_peers = True`` connects only ``ctx.peers`` when it is given them and, given ``ctx.taken``, lets go
    of the peers it names once it names them (``MessageTransport.forget``; the paired job checks both
    transports at once), so it may be a paired job's ``transport.fallback`` (erdma-quic's is). ``options`` is a
    dict of ``erdma_core.sdk.Option`` declaring the keys of the section
    ``[transport.<name>]``; ``section`` is that section's values, ``config`` the whole
    ``erdma_core.sdk.Config``. Returns: nothing. Not firstresult, not historic: every plugin's
    implementation is called.
    """


@hookspec
def erdma_register_discovery(register: Register) -> None:
    """Register discovery methods: how ranks find each other's addresses, chosen by the URL scheme of
    ``discovery.init_method`` (``env``, ``tcp``, ``file``, ...).

    Called by: the core's plugin manager, once. Arguments: ``register(scheme,
    factory, *, options=None, description="", sdk=None, check=None)`` (``sdk`` as for transports; none loads
    as the version before; ``check`` as for transports).
    ``factory(url, rank, world_size, timeout, config)`` returns an ``erdma_core.sdk.Store`` (set, get with a
    timeout, add, close) that every rank of the job shares. A factory with the attribute ``assigns_ranks = True`` is
    called with ``rank=None`` when the process was given no rank (no ``init(rank=...)``, no ``RANK``): the ranks
    then agree on theirs through the method, and the store's ``rank`` attribute says this process's. A store
    whose ``close`` deletes the keys it wrote may offer ``detach()``, leaving them (an elastic job's records).
    Returns: nothing. Every implementation is called.
    """


@hookspec
def erdma_register_traversals(register: Register) -> None:
    """Register NAT traversal strategies.

    Called by: the core's plugin manager, once. Arguments: ``register(name,
    factory, *, options=None, description="", sdk=None, check=None)`` (``sdk`` as for transports; none loads
    as the version before; ``check`` as for transports);
    ``factory(config, section)`` returns an ``erdma_core.sdk.Traversal``: its ``advertise(host, port) ->
    (host, port)`` is called at set-up, once for each address the transport listens on (QUIC striping workers have
    one each), and returns the address peers should dial. Optionally ``udp_socket() -> socket | None``, called once
    before the transport connects: a bound UDP socket a datagram transport (QUIC) must use instead of its own (a
    hole-punched NAT mapping); ``punch(host, port) -> bytes | None``; and ``udp_sockets(count) -> list``,
    more sockets prepared the same way for a transport that stripes (raises ``ConfigError`` when it cannot);
    ``candidates(host, port) -> list[Candidate]`` and ``dial_plan(candidates) -> (list[Candidate], seconds)``
    for a strategy with several ways to reach a rank (``erdma_core.sdk.Traversal`` says how).
    Returns: nothing. Every implementation is called.
    """


@hookspec
def erdma_register_compressors(register: Register) -> None:
    """Register compressors.

    Called by: the core's plugin manager, once. Arguments: ``register(name,
    factory, *, options=None, description="", sdk=None, check=None)`` (``sdk`` as for transports; none loads
    as the version before; ``check`` as for transports);
    ``factory(config, section)`` returns an ``erdma_core.sdk.Compressor``. Its wire id is the
    CRC-32 of ``b"erdma-codec:" + name`` (0 is raw); two names with the same id are refused. The executor calls the
    configured compressor's ``encode`` for each message of at least ``compression.min_bytes`` and any installed
    compressor's ``decode`` for a message that names it. Returns: nothing. Every implementation is called.
    """


@hookspec
def erdma_register_algorithms(register: RegisterAlgorithm) -> None:
    """Register collective algorithms: pure schedules among the group's ranks, or offloads that run a
    collective with an endpoint outside the group (an aggregation node, a switch).

    Called by: the core's plugin manager, once. Arguments: ``register(op, name,
    schedule_fn, *, options=None, description="", offload=False, sdk=None, check=None)`` (``sdk``: the SDK version
    it was written for, as for transports; one that says none loads as the version before; ``check`` as for
    transports, called while ``[collectives]`` names the algorithm for ``op``); ``op`` is one of
    ``erdma_core.sdk.COLLECTIVES``; ``options`` declares the keys of ``[algorithm.<op>.<name>]``.

    A schedule (``offload=False``): ``schedule_fn(spec)`` takes an ``erdma_core.sdk.Spec``
    (the options as ``spec.options``) and returns a list of ``erdma_core.sdk.Step`` (who
    sends which slice to whom). The executor checks each schedule once (``erdma_core.engine.plans.check``)
    and refuses one it could run wrongly, naming the algorithm and this plugin.

    An offload (``offload=True``, for ``erdma_core.sdk.OFFLOADABLE`` ops): ``schedule_fn`` is a factory
    ``f(ctx: erdma_core.sdk.OffloadContext)`` called once per process group (and factory: the same
    factory registered for several ops makes one shared object) on the first collective that selects it,
    returning an object with ``run(call: OffloadCall) -> Fallback | None`` (called once per collective, on the
    thread that runs the group's collectives) and ``close()`` (once, when the group is destroyed). ``run``
    completes the collective in ``call.buffers`` or returns ``Fallback(algorithm, reason)``, and the core runs
    the collective with that host algorithm instead, logging and counting why; every rank must answer alike
    (they agree through ``ctx.host``). It raises ``CollectiveError`` subclasses naming rank and op on failure,
    and never blocks past ``call.deadline``. ``erdma_core.sdk.OffloadContext`` and ``OffloadCall`` write the
    contract down.
    Returns: nothing. Every implementation is called.
    """


@hookspec
def erdma_register_environment(register: RegisterEnvironment) -> None:
    """Declare the ``ERDMA_*`` environment variables a plugin reads that are not config keys (e.g.
    ``ERDMA_KEYS_DIR`` of erdma-quic). Any other ``ERDMA_*`` variable that is not a config key is refused
    with an error naming it, so a typo never goes unnoticed.

    Called by: the core's plugin manager, once. Arguments: ``register(name,
    description)``. Returns: nothing. Every implementation is called.
    """


@hookspec(firstresult=True)
def erdma_choose_algorithm(op: str, nbytes: int, world_size: int, config: Config) -> str | None:
    """Choose the algorithm for one collective whose config says ``auto``.

    Called by: ``erdma_core.ProcessGroup`` before it builds a schedule, only when the
    config leaves the op on ``auto``: once per group, op and size (the answer is kept for later collectives
    of the same shape). Arguments: ``op`` (e.g. ``"allreduce"``), ``nbytes`` (bytes of the local input),
    ``world_size``, ``config`` (the effective ``Config``). Every rank calls it with the same arguments (except
    alltoall with uneven splits, where each rank passes its own input's bytes), so the answer must be a pure
    function of them. For alltoall, answer only algorithms that meet whatever the other ranks chose: the
    core picks ``linear`` or ``pairwise``, which both send each peer exactly one message and receive one.
    Returns: a registered algorithm name, or None to defer to the next implementation. firstresult: the first
    non-None answer wins; the core's answer (by the ``[collectives]`` size thresholds) is registered first
    and so runs last.
    """


@hookspec
def erdma_add_commands(subparsers: Any) -> None:
    """Add subcommands to the ``erdma`` command line (e.g. ``erdma keys`` from erdma-quic).

    Called by: ``erdma_core.cli.main.main`` once, while it builds its parser, after the core's own
    commands, before arguments are parsed. Arguments: ``subparsers``, the ``argparse`` sub-parser action of
    ``erdma``. An implementation adds parsers with ``subparsers.add_parser(name, help=...)`` and sets
    ``handler=fn`` on each with ``set_defaults``; ``fn(args) -> int`` runs the command and returns the exit
    status. It must not import heavy modules until ``fn`` runs. Returns: nothing. Every implementation is
    called.
    """


@hookspec
def erdma_doctor(config: Config) -> list[str] | None:
    """Add to what ``erdma doctor`` reports about this host (e.g. what its NAT does, erdma-p2p).

    Called by: ``erdma_core.cli.main`` once per ``erdma doctor``, after the core's own lines. Arguments:
    ``config``, the effective ``Config`` (a plugin reads its own section, e.g. the STUN server to ask).
    Returns: lines to print, or None to add nothing; a line that starts with ``"problem: "`` makes
    ``erdma doctor`` exit 1. It may take a few seconds (network probes) but must bound every wait. Every
    implementation is called.
    """
