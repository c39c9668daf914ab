"""The plugin SDK: the contract between eRDMA's core and a plugin, and nothing else. A plugin's components
satisfy these protocols and register through these types; the helpers it may build on (transport bases,
framing, security and address helpers) are in ``erdma_core.toolkit``, which has its own version. A plugin
imports from these two modules and the public ``erdma_core`` API only (``tests/test_sdk.py`` walks every
in-tree plugin's imports and attribute accesses, and its tests').

Every ``register(...)`` call says the SDK version the component was written for, as a number:
``register(name, factory, sdk=2)`` (not ``sdk=erdma_core.sdk.VERSION``, which would claim every version).
``VERSION`` goes up when a name here is removed or changes its meaning; adding a name keeps it.

The previous version, 1, is served by an adapter: version 1 also offered the helpers that are now the
toolkit's (``SocketTransport``, ``auth``, ``meet``, ...). A plugin that imports them from here still gets
them, with a ``DeprecationWarning`` naming their place in the toolkit, and a component registered with
``sdk=1`` (or, except a transport, with no version, as version 1 allowed) loads, logged at INFO as running
through the adapter. A component written for any other version is refused at load (``erdma plugins`` lists it
with the reason) and selecting it is a ``PluginError`` that names both versions.

Registration: ``VERSION``, ``hookimpl``, ``Register``, ``RegisterAlgorithm``, ``RegisterEnvironment``,
``Option``, ``Check`` (a component's rules over the config, ``register(..., check=)``), ``Config`` (what a
factory and a check are given: the job's effective config, read-only).

Transports: ``Transport`` (the protocol the engine calls), ``TransportContext`` (what ``connect`` is given),
``Request`` (what ``post`` returns), ``Header`` (the frame header every message carries).

Discovery and traversal: ``Store`` (what discovery gives every rank), ``Traversal``, ``Candidate`` (one way
to reach a rank, as a traversal's ``candidates`` lists them).

Compression: ``Compressor``, ``Encoded``, ``Site``.

Algorithms and offloads: ``Spec``, ``Step``, ``Xfer``, ``Copy``, ``Fallback``, ``OffloadCall``,
``OffloadContext``, ``COLLECTIVES``, ``OFFLOADABLE``, ``ReduceOp``.

The errors: every class of ``erdma_core.errors``.
"""

from __future__ import annotations

import warnings
from typing import Any

from .algorithms.schedule import Copy, Spec, Step, Xfer
from .compression import Compressor, Encoded, Site
from .config.option import Option
from .engine.offload import Fallback, OffloadCall, OffloadContext
from .engine.op import Op
from .engine.program import Msg, Program, Stage
from .errors import *  # noqa: F403  (every error: errors.__all__)
from .errors import __all__ as _ERRORS
from .net.addresses import Candidate
from .plugins.hookspecs import Check, Register, RegisterAlgorithm, RegisterEnvironment, hookimpl
from .protocol.config import Config
from .protocol.ops import COLLECTIVES, OFFLOADABLE
from .protocol.reduce_ops import ReduceOp
from .protocol.sdk import VERSION
from .protocol.store import Store
from .transport.base import Transport, TransportContext
from .transport.request import Request
from .traversal import Traversal
from .wire import Header

__all__ = [
    # registration
    "VERSION", "Check", "Config", "Option", "Register", "RegisterAlgorithm", "RegisterEnvironment", "hookimpl",
    # transports
    "Header", "Request", "Transport", "TransportContext",
    # a whole collective on a transport's own path (``Transport.run_program``)
    "Msg", "Op", "Program", "Stage",
    # discovery, traversal, compression
    "Candidate", "Compressor", "Encoded", "Site", "Store", "Traversal",
    # algorithms and offloads
    "COLLECTIVES", "OFFLOADABLE", "Copy", "Fallback", "OffloadCall", "OffloadContext", "ReduceOp", "Spec", "Step",
    "Xfer",
    # errors
    *_ERRORS,
]

# The adapter for SDK version 1: the names it offered that are the toolkit's now.
VERSION_1_MOVED = frozenset({
    "DATA", "DIRECT_BYTES", "FAILED_PREFIX", "FRAME", "HELLO", "HELLO_ACCEPTED", "HELLO_REQUEST",
    "MAX_CONTROL_BYTES", "FrameInbox", "Hello", "MessageTransport", "SocketTransport", "StreamReader", "WakePipe",
    "address_of", "addresses", "auth", "await_key", "failed_elsewhere", "integrity", "meet", "recv_exact",
    "retrying", "route_source", "running", "verdicts", "dtypes", "reduce_ops",
})


def __getattr__(name: str) -> Any:
    """A name of SDK version 1 that moved to the toolkit: served from there, with a warning that says where."""
    if name in VERSION_1_MOVED:
        from . import toolkit

        warnings.warn(f"erdma_core.sdk.{name} is SDK version 1's; since version {VERSION} it is "
                      f"erdma_core.toolkit.{name}", DeprecationWarning, stacklevel=2)
        return getattr(toolkit, name)
    raise AttributeError(f"module 'erdma_core.sdk' has no attribute {name!r}")
