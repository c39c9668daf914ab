"""The shared state of an elastic job (named arrays and the step number): its hash, and its transfer from the
members that hold it to those that do not, checked against that hash."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import MismatchError

_META = struct.Struct("<?q32s32s")  # holds the state, step, state hash, layout hash


def view(x: Any) -> np.ndarray:
    """A numpy array sharing ``x``'s memory (a numpy array, or a CPU torch tensor)."""
    if isinstance(x, np.ndarray):
        return x
    detach = getattr(x, "detach", None)
    if detach is not None:
        t = detach()
        if str(t.device) != "cpu":
            raise TypeError(f"elastic state: a tensor on {t.device}; register CPU tensors (or numpy arrays)")
        if str(t.dtype) == "torch.bfloat16":  # numpy has no bfloat16: the same bytes as int16
            import torch

            t = t.view(torch.int16)
        return t.numpy()
    raise TypeError(f"elastic state: {type(x).__name__} is not a numpy array or a torch tensor")


def layout_hash(state: Mapping[str, Any]) -> bytes:
    h = hashlib.sha256()
    for name in sorted(state):
        a = view(state[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
    return h.digest()


def state_hash(state: Mapping[str, Any], step: int) -> bytes:
    """SHA-256 over the step, then each array's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256(struct.pack("<q", step))
    for name in sorted(state):
        a = np.ascontiguousarray(view(state[name]))
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.view(np.uint8).reshape(-1).data if a.size else b"")
    return h.digest()


def transfer(pg: Any, state: Mapping[str, Any], step: int, has_state: bool) -> int:
    """Every member of ``pg`` calls this: the members without the state receive it from those with it (each
    from one of them, spread over them), then check it by hash. Returns the step the state is at."""
    mine = _META.pack(has_state, step, state_hash(state, step) if has_state else bytes(32), layout_hash(state))
    out = np.zeros(pg.size() * _META.size, np.uint8)
    pg.allgather(out, np.frombuffer(mine, np.uint8).copy())
    metas = [_META.unpack(out[i * _META.size:(i + 1) * _META.size].tobytes()) for i in range(pg.size())]
    sources = [i for i, m in enumerate(metas) if m[0]]
    if not sources:
        raise MismatchError("elastic: no member holds the shared state (every peer that held it has left)")
    _, want_step, want, layout = metas[sources[0]]
    for i, (held, s, h, _) in enumerate(metas):
        if held and (s, h) != (want_step, want):
            raise MismatchError(f"elastic: members {sources[0]} and {i} hold different states (step {want_step} "
                                f"hash {want.hex()[:16]} vs step {s} hash {h.hex()[:16]})")
    if any(m[0] and m[3] != layout for m in metas):
        raise MismatchError("elastic: the members holding the state registered different names, dtypes or shapes")
    if metas[pg.rank()][3] != layout:
        raise MismatchError(f"elastic: this peer registered state with other names, dtypes or shapes than the "
                            f"members (member {sources[0]}: {sorted(state)} differ)")
    receivers = [i for i, m in enumerate(metas) if not m[0] and m[3] == layout]  # the others leave
    me = pg.rank()
    for j, r in enumerate(receivers):
        src = sources[j % len(sources)]
        if me == src:
            for name in sorted(state):
                pg.send(np.ascontiguousarray(view(state[name])), r)
        elif me == r:
            for name in sorted(state):
                a = view(state[name])
                if a.flags.c_contiguous:
                    pg.recv(a, src)
                else:
                    got = np.empty_like(a, order="C")
                    pg.recv(got, src)
                    a[...] = got
    if not has_state and state_hash(state, want_step) != want:
        raise MismatchError(f"elastic: member {me}: the state received does not match its hash "
                            f"{want.hex()[:16]}")
    return want_step
