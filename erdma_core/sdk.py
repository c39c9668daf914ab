"""What a plugin of eRDMA may use of the core: this module's ``__all__``, and the public ``erdma_core`` API.

A plugin imports these names from here and nothing else of ``erdma_core``'s packages (``tests/test_sdk.py``
walks every in-tree plugin's imports and attribute accesses). Every ``register(...)`` call says which version
of this surface the component was written for, ``register(name, factory, sdk=erdma_core.sdk.VERSION)``; a
transport written for another version, or that says none, is refused at load (``erdma plugins`` lists it with
the reason) and selecting it is a ``PluginError`` that names both versions.

``VERSION`` goes up when a name here is removed or changes its meaning; adding a name keeps it. A plugin
writes the number it was written for (``sdk=1``), not ``sdk=erdma_core.sdk.VERSION``, which would claim every
version.

Registration: ``VERSION``, ``hookimpl``, ``Register``, ``RegisterAlgorithm``, ``RegisterEnvironment``,
``Option``, ``Check`` (a component's rules over the config, ``register(..., check=)``).

Transports: ``Transport`` (the protocol the engine calls), ``MessageTransport`` (the base that matches
frames to receives and does ABORT, BYE and lost peers), ``SocketTransport`` (its base for stream sockets),
``TransportContext`` (what ``connect`` is given), ``Request``, ``FrameInbox`` and ``StreamReader`` (the
inbound steps a reader drives), ``DIRECT_BYTES``, ``Header``, ``Hello`` and the frame kinds and bounds of the
wire (``DATA``, ``FRAME``, ``HELLO``, ``HELLO_ACCEPTED``, ``HELLO_REQUEST``, ``MAX_CONTROL_BYTES``),
``await_key`` and ``failed_elsewhere`` (set-up waits that end when another rank gave up; ``FAILED_PREFIX``: the keys
a rank that gave up writes its reason to, which a store that cleans up at close leaves for the others), the job's secrets
and proofs (``auth``), frame integrity (``integrity``), published addresses and candidates (``addresses``,
``Candidate``, ``route_source``), the meeting of two ranks' sockets (``meet``), what earlier set-ups of the
process found about paths to other sites (``verdicts``), and helpers: ``WakePipe``,
``recv_exact``, ``retrying``, ``running``, ``address_of``.

The rest: ``Store`` (what discovery gives every rank), ``Traversal``, ``Compressor``, ``Encoded``, ``Site``;
for algorithms and offloads ``Spec``, ``Step``, ``Xfer``, ``Copy``, ``Fallback``, ``OffloadCall``,
``OffloadContext``, ``COLLECTIVES``, ``OFFLOADABLE``, ``dtypes``, ``reduce_ops``, ``ReduceOp``; the errors.
"""

from __future__ import annotations

from .algorithms.schedule import Copy, Spec, Step, Xfer
from .compression import Compressor, Encoded, Site
from .config.option import Option
from .engine.offload import Fallback, OffloadCall, OffloadContext
from .errors import *  # noqa: F403  (every error: errors.__all__)
from .errors import __all__ as _ERRORS
from .net import addresses, meet
from .net.addresses import Candidate, route_source
from .net.sockets import recv_exact, retrying
from .net.wakeup import WakePipe
from .plugins.hookspecs import Check, Register, RegisterAlgorithm, RegisterEnvironment, hookimpl
from .protocol import dtypes, reduce_ops
from .protocol.ops import COLLECTIVES, OFFLOADABLE
from .protocol.reduce_ops import ReduceOp
from .protocol.sdk import VERSION
from .protocol.store import Store
from .security import auth, integrity
from .transport import verdicts
from .transport.base import FAILED_PREFIX, MessageTransport, Transport, TransportContext, await_key, failed_elsewhere
from .transport.frames import DIRECT_BYTES, FrameInbox, StreamReader
from .transport.leftovers import running
from .transport.request import Request
from .transport.stream.single_copy import address_of
from .transport.stream.socket_transport import SocketTransport
from .traversal import Traversal
from .wire import DATA, FRAME, HELLO, HELLO_ACCEPTED, HELLO_REQUEST, MAX_CONTROL_BYTES, Header, Hello

__all__ = [
    # registration
    "VERSION", "Check", "Option", "Register", "RegisterAlgorithm", "RegisterEnvironment", "hookimpl",
    # transports
    "DATA", "DIRECT_BYTES", "FAILED_PREFIX", "FRAME", "HELLO", "HELLO_ACCEPTED", "HELLO_REQUEST", "MAX_CONTROL_BYTES",
    "Candidate",
    "FrameInbox", "Header", "Hello", "MessageTransport", "Request", "SocketTransport", "StreamReader", "Transport",
    "TransportContext", "WakePipe", "address_of", "addresses", "auth", "await_key", "failed_elsewhere", "integrity",
    "meet", "recv_exact", "retrying", "route_source", "running", "verdicts",
    # discovery, traversal, compression
    "Compressor", "Encoded", "Site", "Store", "Traversal",
    # algorithms and offloads
    "COLLECTIVES", "OFFLOADABLE", "Copy", "Fallback", "OffloadCall", "OffloadContext", "ReduceOp", "Spec", "Step",
    "Xfer", "dtypes", "reduce_ops",
    # errors
    *_ERRORS,
]
