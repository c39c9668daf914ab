"""eRDMA: collective communication for training across decentralized machines.

    import erdma_core
    pg = erdma_core.init()                      # env:// as torchrun or `erdma run` set it
    pg.allreduce(array, op=erdma_core.ReduceOp.SUM)
"""

import os as _os

from . import logs as _logs
from .api.join import default_group, init, load_config, new_group
from .api.process_group import ProcessGroup
from .api.work import Work
from .errors import (
    AbortedError,
    AuthenticationError,
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
    ErdmaError,
    IntegrityError,
    MismatchError,
    PeerLostError,
    PluginError,
    ProtocolError,
    UnreachableError,
)
from .plugins.hookspecs import Register, RegisterAlgorithm, RegisterEnvironment, hookimpl
from .protocol.reduce_ops import ReduceOp

__version__ = "0.1.0"
_logs.configure(_os.environ)  # ERDMA_DEBUG=INFO: the library's log lines on stderr
__all__ = [
    "AbortedError", "AuthenticationError", "CollectiveError", "CollectiveTimeoutError", "ConfigError", "ErdmaError",
    "IntegrityError", "MismatchError", "PeerLostError", "PluginError", "ProcessGroup", "ProtocolError", "ReduceOp",
    "Register", "RegisterAlgorithm", "RegisterEnvironment", "UnreachableError", "Work", "default_group", "hookimpl",
    "init", "load_config", "new_group",
]
