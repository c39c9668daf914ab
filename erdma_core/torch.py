"""The torch.distributed backend "erdma". Importing this module registers it:

    import erdma_core.torch
    torch.distributed.init_process_group("erdma")      # or "cpu:erdma,cuda:erdma"

Each torch process group becomes an eRDMA ProcessGroup built by the pipeline ``erdma.toml`` chooses
(transport, algorithms, ...). The rendezvous goes through the store torch made (torchrun's or
``erdma run``'s env:// variables), so no second port is needed. Works hand torch a Future that eRDMA
completes (``ErdmaWork``), so ``wait()`` and ``get_future()`` behave as torch expects and errors surface
as exceptions. In torch 2.13 every op, gather, scatter and reduce included, reaches the backend's Python
methods directly; ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` arrive as ``_allgather_base``
and ``_reduce_scatter_base``, ``all_to_all_single`` as ``alltoall_base``.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from .errors import CollectiveTimeoutError
from .setup import init_with_store, load_config

BACKEND = "erdma"
_REDUCE = {"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max", "AVG": "avg"}


def _reduce_op(opts: Any) -> str:
    for torch_name, ours in _REDUCE.items():
        if opts.reduceOp == getattr(dist.ReduceOp, torch_name):
            return ours
    raise ValueError(f"ReduceOp {opts.reduceOp} is not supported by the erdma backend; "
                     f"supported: {', '.join(_REDUCE)}")


class TorchStore:
    """torch's c10d Store seen as an eRDMA rendezvous store."""

    def __init__(self, store: Any, host: str | None) -> None:
        self._store = store
        self.host = host  # the rendezvous host: the TCP transport advertises the address that routes to it

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout: float) -> bytes:
        try:
            self._store.wait([key], datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise CollectiveTimeoutError(f"rendezvous: key {key!r} did not appear in torch's store within "
                                         f"{timeout:.1f}s: {exc}") from None
        return bytes(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def close(self) -> None:
        pass


class ErdmaWork(dist.Work):
    """A torch Work over one or more eRDMA Works: ``wait()`` raises the first error (PeerLostError,
    CollectiveTimeoutError, MismatchError, ...) and ``get_future()`` completes with the op's tensors.
    (A Work made by ``_create_work_from_future`` would swallow errors: its ``wait()`` returns True.)"""

    def __init__(self, works: Sequence[Any], result: Any) -> None:
        super().__init__()
        self._works = list(works)
        self._result = result
        self._future: Future[Any] = Future()
        futures = [w.get_future() for w in self._works]

        lock = threading.Lock()  # callbacks may run on different eRDMA threads at once

        def settle(_: object) -> None:
            with lock:
                if self._future.done() or not all(f.done() for f in futures):
                    return
                errors = [f.exception() for f in futures if f.exception() is not None]
                if errors:
                    self._future.set_exception(errors[0])
                else:
                    self._future.set_result(result)

        if not futures:
            self._future.set_result(result)
        for f in futures:
            f.add_done_callback(settle)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = None if not timeout else timeout.total_seconds()
        for w in self._works:
            w.wait(seconds)  # raises the op's own error, with its type
        self._future.wait()  # the completion callback may still be running
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> BaseException | None:
        return next((w.exception() for w in self._works if w.exception() is not None), None)

    def result(self) -> Any:
        self.wait()
        return self._result

    def get_future(self) -> Future[Any]:
        return self._future


class ErdmaProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on an eRDMA ProcessGroup."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        conf = load_config()
        if conf.sources["timeouts.collective"] == "default":  # nothing configured: torch's timeout rules
            conf = load_config(None, **{"timeouts.collective": timeout.total_seconds()})
        self.pg = init_with_store(TorchStore(store, os.environ.get("MASTER_ADDR")), rank, size, conf)

    def getBackendName(self) -> str:
        return BACKEND

    # ---- Work plumbing ----------------------------------------------------------------------------------
    def _work(self, works: Sequence[Any], result: Any) -> ErdmaWork:
        return ErdmaWork(works, result)

    # ---- collectives ----------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _reduce_op(opts) if opts is not None else "sum"
        return self._work([self.pg.allreduce(t, op=op, async_op=True) for t in tensors], tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._work([self.pg.broadcast(t, src=opts.rootRank, async_op=True) for t in tensors], tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._work([self.pg.reduce(t, dst=opts.rootRank, op=_reduce_op(opts), async_op=True)
                           for t in tensors], tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._work([self.pg.allgather(o, i, async_op=True) for o, i in zip(outputs, inputs, strict=True)],
                          outputs)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Any:
        """``outputs[q][j]`` receives rank q's ``inputs[j]`` (outer index: rank, unlike ``allgather``)."""
        works = [self.pg.allgather([outputs[q][j] for q in range(len(outputs))], t, async_op=True)
                 for j, t in enumerate(inputs)]
        return self._work(works, outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._work([self.pg.allgather(output, input, async_op=True)], [output])

    all_gather_single = _allgather_base

    allgather_into_tensor_coalesced = allgather  # same body: outputs[j] gathers inputs[j]

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:
        op = _reduce_op(opts)
        return self._work([self.pg.reduce_scatter(o, i, op=op, async_op=True)
                           for o, i in zip(outputs, inputs, strict=True)], outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        return self._work([self.pg.reduce_scatter(output, input, op=_reduce_op(opts), async_op=True)], [output])

    reduce_scatter_single = _reduce_scatter_base

    reduce_scatter_tensor_coalesced = reduce_scatter  # same body: outputs[j] from inputs[j]

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        return self._work([self.pg.alltoall(output, input, list(output_split_sizes) or None,
                                            list(input_split_sizes) or None, async_op=True)], [output])

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
                          input_split_sizes: list[int] | None, opts: Any = None) -> Any:
        return self.alltoall_base(output, input, output_split_sizes or [], input_split_sizes or [], opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._work([self.pg.alltoall(outputs, inputs, async_op=True)], outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        root = opts.rootRank
        gather_list = outputs[0] if self.pg.rank() == root else None
        return self._work([self.pg.gather(inputs[0], gather_list, dst=root, async_op=True)], outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:
        root = opts.rootRank
        scatter_list = inputs[0] if self.pg.rank() == root else None
        return self._work([self.pg.scatter(outputs[0], scatter_list, src=root, async_op=True)], outputs)

    def barrier(self, opts: Any = None) -> Any:
        return self._work([self.pg.barrier(async_op=True)], [])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self._work([self.pg.send(t, dst, tag=tag, async_op=True) for t in tensors], tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self._work([self.pg.recv(t, src, tag=tag, async_op=True) for t in tensors], tensors)

    def shutdown(self) -> None:
        self.pg.destroy()


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ErdmaProcessGroup:
    return ErdmaProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register the "erdma" backend with torch.distributed (idempotent)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


register()
