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

import _thread
import datetime
import functools
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from .api.join import init_with_store, load_config
from .api.work import bare
from .errors import CollectiveTimeoutError, ErdmaError

BACKEND = "erdma"
_SHORTEST_WAIT = 0.005  # seconds: a get with less (failed_elsewhere: 1 ms) is a look (check), never a wait
DEVICES = ("cpu", "cuda")  # cuda tensors are staged through host memory when the transport cannot move them
_REDUCE = {"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max", "AVG": "avg", "BAND": "band",
           "BOR": "bor", "BXOR": "bxor"}


def _reduce_op(opts: Any) -> str:
    red = opts.reduceOp
    name = getattr(red, "op", red).name  # a ReduceOp object carries its RedOpType in .op
    if name not in _REDUCE:
        raise ValueError(f"ReduceOp.{name} is not supported by the erdma backend; supported: {', '.join(_REDUCE)}")
    return _REDUCE[name]


class TorchStore:
    """torch's c10d Store seen as an eRDMA discovery Store."""

    def __init__(self, store: Any, host: str | None) -> None:
        self._store = store
        self.host = host  # the discovery host: the TCP transport advertises the address that routes to it

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout: float) -> bytes:
        # a key that is there, or a look that may not wait (failed_elsewhere's), goes through check(), which
        # answers at once: c10d's wait() logs a 'waitForInput ... timed out' line whenever its time runs out
        if self._store.check([key]):
            return bytes(self._store.get(key))
        if timeout < _SHORTEST_WAIT:
            raise CollectiveTimeoutError(f"discovery: key {key!r} is not in torch's store")
        try:
            self._store.wait([key], datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise CollectiveTimeoutError(f"discovery: key {key!r} did not appear in torch's store within "
                                         f"{timeout:.1f}s: {exc}") from None
        return bytes(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def close(self) -> None:
        """Let go of torch's store (a group destroyed or aborted): when torch drops it too, its server socket
        (rank 0's TCPStore) closes at once, not whenever the collector frees this group, so that a new group
        may serve a store on the same port right away."""
        self._store = None


def _map(obj: Any, fn: Any) -> Any:
    """``obj`` (a tensor, or lists of them, nested) with every tensor replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list | tuple):
        return type(obj)(_map(o, fn) for o in obj)
    return obj


class _Staging:
    """Host copies of device tensors for a transport that moves host memory only (as Gloo stages CUDA
    tensors). ``host`` swaps them in before the op; ``restore`` copies every staged tensor back (a
    collective may write any of them) and maps the op's result to the caller's tensors."""

    def __init__(self, devices: frozenset[str]) -> None:
        self.devices = devices
        self.pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(host copy) -> (device, host)

    def host(self, obj: Any) -> Any:
        def stage(t: torch.Tensor) -> torch.Tensor:
            if t.device.type in self.devices:
                return t
            h = t.detach().to("cpu")
            self.pairs[id(h)] = (t, h)
            return h
        return _map(obj, stage)

    def restore(self, result: Any) -> Any:
        for dev, h in self.pairs.values():
            dev.copy_(h)
        return _map(result, lambda t: self.pairs.get(id(t), (t,))[0])


def _async(opts: Any) -> bool:
    """Whether the op may run on after the call returns. torch says when its caller waits at once
    (``opts.asyncOp`` False: ``dist.all_reduce(t)``, not ``async_op=True``): such an op runs as a blocking
    eRDMA call on the caller's thread, with no hand-off to a runner thread and back."""
    return getattr(opts, "asyncOp", True) is not False


def _eager(method: Any) -> Any:
    """A backend method torch.compile never traces: torch calls it from C++ (DDP's reducer, a collective in a
    compiled function), and dynamo, still hooked into every Python frame there, would otherwise trace into
    this Python ProcessGroup (an opaque object to it: "Member 'pg' is not registered")."""
    return torch.compiler.disable(method, reason="the erdma backend runs its collectives eagerly")


def _staged(method: Any) -> Any:
    """Run the op on host copies of tensors that live on a device the transport cannot move (and eagerly)."""

    @functools.wraps(method)
    def op(self: ErdmaProcessGroup, *args: Any) -> Any:
        staging = _Staging(self.pg.devices)
        host_args = staging.host(list(args))
        if not staging.pairs:
            return method(self, *args)
        self._local.staging = staging
        try:
            return method(self, *host_args)
        finally:
            self._local.staging = None
    return _eager(op)


class ErdmaWork(dist.Work):
    """A torch Work over one or more eRDMA Works: ``wait()`` raises the first error (PeerLostError,
    CollectiveTimeoutError, MismatchError, ...) and ``get_future()`` completes with the op's tensors.
    (A Work made by ``_create_work_from_future`` would swallow errors: its ``wait()`` returns True.)

    The future handed to torch must fail in C++ terms: ``Future.set_exception`` only stores the exception
    as the future's *value*, which C++ consumers such as DDP's reducer then read as tensors (a segfault).
    So the future torch sees is ``then()`` of an internal one, and its callback raises the eRDMA error,
    which torch records as the future's error (surfacing as RuntimeError naming the eRDMA error type).
    Futures cost a ``then()`` in torch's C++: they are made on the first ``get_future()`` (DDP asks; a plain
    ``dist.all_reduce`` only waits)."""

    def __init__(self, works: Sequence[Any], result: Any, staging: _Staging | None = None,
                 parts: Sequence[ErdmaWork] = ()) -> None:
        """``parts``: torch Works this one stands for (the ops of a coalesced block), finished with it."""
        super().__init__()
        self._parts = list(parts)
        self._works: list[Any] = [w for p in self._parts for w in p._works] + list(works)
        self._result = result
        self._staging = staging
        self._restoring = threading.Lock()  # the copies back to the device run once, on whichever thread
        self._making = threading.Lock()
        self._future: Future[Any] | None = None  # made by the first get_future(): a plain wait() needs none

    def _finish(self) -> Any:
        """Once every eRDMA work is done: raise the first error, or return the result (staged tensors copied
        back to their device first, once)."""
        error = next((w.exception() for w in self._works if w.exception() is not None), None)
        if error is not None:
            raise error
        for part in self._parts:
            part._finish()
        with self._restoring:
            if self._staging is not None:
                self._result = self._staging.restore(self._result)
                self._staging = None
        return self._result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = None if not timeout else timeout.total_seconds()
        for w in self._works:
            w.wait(seconds)  # raises the op's own error, with its type
        self._finish()  # the copies back to the device are done when this returns
        return True

    def get_future(self) -> Future[Any]:
        with self._making:
            if self._future is None:
                settled: Future[None] = Future()
                self._future = settled.then(self._outcome)
                futures = [w.get_future() for w in self._works]
                lock = threading.Lock()  # callbacks may run on different eRDMA threads at once
                settling = [False]

                def settle(_: object) -> None:
                    with lock:
                        if settling[0] or not all(f.done() for f in futures):
                            return
                        settling[0] = True
                    if self.exception() is None:
                        settled.set_result(None)
                    else:
                        # torch records the error the callback raises with the frames below it (pybind11's
                        # "At:" list); completed from a thread with nothing on its stack, that is the callback's
                        # own raise alone, not the eRDMA thread that finished the op (as Work.wait raises it)
                        _thread.start_new_thread(torch._C.Future.set_result, (settled, None))  # (C: no frame)

                if not futures:
                    settled.set_result(None)
                for f in futures:
                    f.add_done_callback(settle)
            return self._future

    def _outcome(self, _: object) -> Any:
        """The future's callback: the op's result, or its error raised as ``Work.wait`` raises it."""
        error = self.exception()
        if error is not None:
            raise bare(error) if isinstance(error, ErdmaError) else error
        return self._finish()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> BaseException | None:
        return next((w.exception() for w in self._works if w.exception() is not None), None)

    def result(self) -> Any:
        self.wait()
        return self._result


class ErdmaProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on an eRDMA ProcessGroup."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (torch 2.13 stubs name only the store form)
        conf = load_config()
        if conf.sources["timeouts.collective"] == "default":  # nothing configured: torch's timeout rules
            torchs: dict[str, Any] = {"timeouts.collective": timeout.total_seconds()}
            conf = load_config(None, **torchs)
        self.pg = init_with_store(TorchStore(store, os.environ.get("MASTER_ADDR")), rank, size, conf)
        self._local = threading.local()  # the staging of the op being issued on this thread
        for device in DEVICES:  # torch keeps no backends for a Python group: name the devices it serves
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, None)

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend(self, device: torch.device) -> ErdmaProcessGroup:  # type: ignore[override]  # (a Python group)
        """This group is its own backend for every device it serves (DCP's ``async_save`` checks that the
        group serves "cpu"; torch's helpers such as ``_set_pg_timeout`` then ask for that device's backend)."""
        if torch.device(device).type not in DEVICES:
            raise RuntimeError(f"the erdma backend serves devices {', '.join(DEVICES)}, not {device}")
        return self

    # What torch asks of a backend object before using features erdma does not offer.
    supports_splitting = supports_coalescing = supports_time_estimate = supports_shrinking = False

    # torch keeps a group's name in its backends; this ProcessGroup has none (it is its own backend), so
    # the name torch gives it lives here (``destroy_process_group(subgroup)`` reads it back).
    def _set_group_name(self, name: str) -> None:
        self._erdma_group_name = name
        self._name_group()

    def _set_group_desc(self, desc: str) -> None:
        super()._set_group_desc(desc)
        self._name_group()

    def _name_group(self) -> None:
        """eRDMA's errors name the group as torch does (each torch group is group 0 of its own eRDMA job)."""
        desc = self.group_desc if self.group_desc not in ("", "undefined") else ""
        self.pg.name = f"{self.group_name} ({desc})" if desc else self.group_name

    @property
    def group_name(self) -> str:  # type: ignore[override]  # (GroupName is a str)
        return getattr(self, "_erdma_group_name", "")

    # ---- Work plumbing ----------------------------------------------------------------------------------
    def _work(self, works: Sequence[Any], result: Any) -> ErdmaWork:
        """A torch Work over ``works`` (None: a call that ran blocking, already done)."""
        work = ErdmaWork([w for w in works if w is not None], result, getattr(self._local, "staging", None))
        block = getattr(self._local, "coalesced", None)
        if block is not None:
            block.append(work)
        return work

    # ---- coalescing: torch's _coalescing_manager(group, device) -----------------------------------------
    def _start_coalescing(self, device: torch.device) -> None:
        """Ops issued on this thread until ``_end_coalescing`` start at once, as always (eRDMA queues each
        on the group in order); ``_end_coalescing`` returns one Work that waits for all of them."""
        self._get_backend(device)  # a device erdma does not serve: the error names the ones it does
        if getattr(self._local, "coalesced", None) is not None:
            raise RuntimeError("erdma: _start_coalescing inside a coalesced block on this group (blocks do not nest)")
        self._local.coalesced = []

    def _end_coalescing(self, device: torch.device) -> ErdmaWork:
        block = getattr(self._local, "coalesced", None)
        if block is None:
            raise RuntimeError("erdma: _end_coalescing without _start_coalescing on this thread")
        self._local.coalesced = None
        return ErdmaWork([], [w._result for w in block], parts=block)

    # ---- collectives ----------------------------------------------------------------------------------
    @_staged
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _reduce_op(opts) if opts is not None else "sum"
        return self._work([self.pg.allreduce(t, op=op, async_op=_async(opts)) for t in tensors], tensors)

    @_eager
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    @_staged
    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._work([self.pg.broadcast(t, src=opts.rootRank, async_op=_async(opts)) for t in tensors],
                          tensors)

    @_staged
    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._work([self.pg.reduce(t, dst=opts.rootRank, op=_reduce_op(opts), async_op=_async(opts))
                           for t in tensors], tensors)

    @_staged
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._work([self.pg.allgather(o, i, async_op=_async(opts))
                           for o, i in zip(outputs, inputs, strict=True)], outputs)

    @_staged
    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Any:
        """``outputs[q][j]`` receives rank q's ``inputs[j]`` (outer index: rank, unlike ``allgather``)."""
        works = [self.pg.allgather([outputs[q][j] for q in range(len(outputs))], t, async_op=_async(opts))
                 for j, t in enumerate(inputs)]
        return self._work(works, outputs)

    @_staged
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._work([self.pg.allgather(output, input, async_op=_async(opts))], [output])

    all_gather_single = _allgather_base

    allgather_into_tensor_coalesced = allgather  # same body: outputs[j] gathers inputs[j]
    all_gather_single_coalesced = allgather  # (the name _coalescing_manager calls)

    @_staged
    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:
        op = _reduce_op(opts)
        return self._work([self.pg.reduce_scatter(o, i, op=op, async_op=_async(opts))
                           for o, i in zip(outputs, inputs, strict=True)], outputs)

    @_staged
    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        return self._work([self.pg.reduce_scatter(output, input, op=_reduce_op(opts), async_op=_async(opts))],
                          [output])

    reduce_scatter_single = _reduce_scatter_base

    reduce_scatter_tensor_coalesced = reduce_scatter  # same body: outputs[j] from inputs[j]
    reduce_scatter_single_coalesced = reduce_scatter

    @_staged
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        return self._work([self.pg.alltoall(output, input, list(output_split_sizes) or None,
                                            list(input_split_sizes) or None, async_op=_async(opts))], [output])

    @_eager
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
                          input_split_sizes: list[int] | None, opts: Any = None) -> Any:
        return self.alltoall_base(output, input, output_split_sizes or [], input_split_sizes or [], opts)

    @_staged
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._work([self.pg.alltoall(outputs, inputs, async_op=_async(opts))], outputs)

    @_staged
    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        root = opts.rootRank
        gather_list = outputs[0] if self.pg.rank() == root else None
        return self._work([self.pg.gather(inputs[0], gather_list, dst=root, async_op=_async(opts))], outputs)

    @_staged
    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:
        root = opts.rootRank
        scatter_list = inputs[0] if self.pg.rank() == root else None
        return self._work([self.pg.scatter(outputs[0], scatter_list, src=root, async_op=_async(opts))], outputs)

    @_eager
    def barrier(self, opts: Any = None) -> Any:
        return self._work([self.pg.barrier(async_op=_async(opts))], [])

    @_staged
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self._work([self.pg.send(t, dst, tag=tag, async_op=True) for t in tensors], tensors)

    @_staged
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self._work([self.pg.recv(t, src, tag=tag, async_op=True) for t in tensors], tensors)

    def shutdown(self) -> None:
        self.pg.destroy()

    def abort(self) -> None:
        """torch's abort (``_abort_process_group``; torchft's reconfiguration): ops in flight fail with
        ``AbortedError`` here and on the peers, and threads and connections are released at once."""
        self.pg.abort()


def counters(group: Any = None) -> dict[str, Any]:
    """This rank's counters for a torch group of the erdma backend (None: the default group), as the eRDMA
    group's ``counters()``: with a compressor, ``compression.<name>.encoded.messages``, ``.raw_bytes`` and
    ``.wire_bytes`` (what went out for those), and the messages sent raw (``.small.*``, ``.skipped.*``,
    ``.declined.*``); offloads' and a paired transport's counts. ValueError for a group of another backend."""
    pg = dist.group.WORLD if group is None else group
    if pg is None:
        raise ValueError("erdma_core.torch.counters: no default process group (call init_process_group first)")
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except RuntimeError as exc:
        raise ValueError(f"erdma_core.torch.counters: the group has no erdma backend: {exc}") from None
    if not isinstance(backend, ErdmaProcessGroup):
        raise ValueError(f"erdma_core.torch.counters: the group's backend is {dist.get_backend(pg)!r}, not "
                         f"{BACKEND!r}")
    return backend.pg.counters()


def create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ErdmaProcessGroup:
    """torch.distributed's creator for "erdma" (also what the ``torch.backends`` entry point calls)."""
    return ErdmaProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register the "erdma" backend with torch.distributed (idempotent)."""
    if BACKEND not in dist.Backend.backend_list:  # (where torch loaded the entry point, it is registered)
        dist.Backend.register_backend(BACKEND, create, devices=list(DEVICES))


register()
