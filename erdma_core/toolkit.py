"""The toolkit: helpers a plugin may build on, beside the contract (``erdma_core.sdk``). A plugin's
components must satisfy the SDK's protocols; how they do it is theirs, and these are the core's own parts
offered for it.

Stability. ``TOOLKIT_VERSION`` says which version of this module a plugin was written against; it goes up
when a name here is removed or changes its meaning (adding a name keeps it), and the core's release notes
say what changed. Base classes are offered with their public methods (no underscore) as the contract: a
subclass overrides the hooks their docstrings name and touches nothing private (``tests/test_sdk.py``
refuses that of the in-tree plugins). The SDK version of a component (``register(..., sdk=N)``) does not
cover this module: a plugin pins the erdma-core releases whose toolkit it was tested with.

Transports: ``MessageTransport`` (matches frames to receives, does ABORT, BYE and lost peers),
``SocketTransport`` (its base for stream sockets: listen, dial, authenticate, pools), ``FrameInbox`` and
``StreamReader`` (the inbound steps a reader drives), ``Mailbox`` (receives matched by key), ``DIRECT_BYTES``,
the wire's frame kinds, layouts and bounds (``DATA``, ``BYE``, ``FRAME``, ``HELLO``, ``HELLO_ACCEPTED``,
``HELLO_REQUEST``, ``MAX_CONTROL_BYTES``, ``P2P_GROUP_BIT``, ``Hello``), ``await_key`` and
``failed_elsewhere`` (set-up waits that end when another rank gave up; ``FAILED_PREFIX``, the keys a rank that
gave up writes its reason to), ``running`` (a process's threads that outlive a closed transport).

Security and networking: the job's secret and proofs (``auth``), frame seals (``integrity``), published
addresses and candidates (``addresses``, ``route_source``), the meeting of two ranks' sockets (``meet``), what
earlier set-ups of the process found about paths to other sites (``verdicts``), ``WakePipe``, ``recv_exact``,
``retrying``, ``address_of`` (a buffer's address for single-copy reads).

Data: ``dtypes`` (eRDMA's dtype names and codes), ``reduce_ops`` (reductions on numpy arrays).
"""

from __future__ import annotations

from .net import addresses, meet
from .net.addresses import route_source
from .net.sockets import recv_exact, retrying
from .net.wakeup import WakePipe
from .protocol import dtypes, reduce_ops
from .security import auth, integrity
from .transport import verdicts
from .transport.base import FAILED_PREFIX, MessageTransport, await_key, failed_elsewhere
from .transport.frames import DIRECT_BYTES, FrameInbox, StreamReader
from .transport.leftovers import running
from .transport.mailbox import Mailbox
from .transport.stream.single_copy import address_of
from .transport.stream.socket_transport import SocketTransport
from .wire import BYE, DATA, FRAME, HELLO, HELLO_ACCEPTED, HELLO_REQUEST, MAX_CONTROL_BYTES, P2P_GROUP_BIT, Hello

TOOLKIT_VERSION = 1

__all__ = [
    "TOOLKIT_VERSION",
    # transports
    "BYE", "DATA", "DIRECT_BYTES", "FAILED_PREFIX", "FRAME", "HELLO", "HELLO_ACCEPTED", "HELLO_REQUEST",
    "MAX_CONTROL_BYTES", "P2P_GROUP_BIT", "FrameInbox", "Hello", "Mailbox", "MessageTransport", "SocketTransport",
    "StreamReader", "await_key", "failed_elsewhere", "running",
    # security and networking
    "WakePipe", "address_of", "addresses", "auth", "integrity", "meet", "recv_exact", "retrying", "route_source",
    "verdicts",
    # data
    "dtypes", "reduce_ops",
]
