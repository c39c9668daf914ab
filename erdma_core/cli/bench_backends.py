"""The systems ``erdma bench`` times (``--backend``, ``--compare``): eRDMA's process group, torch.distributed's
Gloo and MPI (mpi4py), each with the same calls: ``wrap`` a numpy buffer, run an ``op`` on it, and the max and sum
of a number over the ranks. hivemind's is in ``bench_hivemind`` (imported only when selected)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


class Erdma:
    name = "erdma"

    def __init__(self, algorithm: str | None) -> None:
        import erdma_core

        self.pg = erdma_core.init()
        self.rank, self.size, self.algorithm = self.pg.rank(), self.pg.size(), algorithm

    def wrap(self, a: np.ndarray) -> Any:
        return a

    def describe(self, op: str) -> str:
        """What the job's config chose for ``op``: transport, algorithm, compressor."""
        conf = self.pg.config
        comp = conf["compression.name"]
        if comp != "none":
            comp += f" (from {conf['compression.min_bytes']} bytes, ops {conf['compression.ops']})"
        return (f"transport: {conf['transport.name']}  algorithm: {self.algorithm or conf[f'collectives.{op}']}  "
                f"compression: {comp}")

    def op(self, name: str, out: Any, inp: Any) -> None:
        if name == "allreduce":
            self.pg.allreduce(out, algorithm=self.algorithm)
        elif name == "broadcast":
            self.pg.broadcast(out, 0)
        elif name == "allgather":
            self.pg.allgather(out, inp)
        elif name == "reduce_scatter":
            self.pg.reduce_scatter(out, inp)
        elif name == "alltoall":
            self.pg.alltoall(out, inp, algorithm=self.algorithm)

    def max_over_ranks(self, x: float) -> float:
        a = np.array([x])
        self.pg.allreduce(a, op="max")
        return float(a[0])

    def sum_over_ranks(self, x: float) -> float:
        a = np.array([x])
        self.pg.allreduce(a, op="sum")
        return float(a[0])

    def close(self) -> None:
        self.pg.destroy()


class Gloo:
    name = "gloo"

    def __init__(self, algorithm: str | None) -> None:
        import torch
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo")
        self.dist, self.torch = dist, torch
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def wrap(self, a: np.ndarray) -> Any:
        return self.torch.from_numpy(a)

    def op(self, name: str, out: Any, inp: Any) -> None:
        d = self.dist
        if name == "allreduce":
            d.all_reduce(out)
        elif name == "broadcast":
            d.broadcast(out, 0)
        elif name == "allgather":
            d.all_gather_into_tensor(out, inp)
        elif name == "reduce_scatter":
            d.reduce_scatter_tensor(out, inp)
        elif name == "alltoall":
            d.all_to_all_single(out, inp)

    def max_over_ranks(self, x: float) -> float:
        t = self.torch.tensor([x], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t[0])

    def sum_over_ranks(self, x: float) -> float:
        t = self.torch.tensor([x], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM)
        return float(t[0])

    def close(self) -> None:
        self.dist.destroy_process_group()


class Mpi:
    """Open MPI (or any MPI) through mpi4py; imported only when selected. Start with mpirun."""

    name = "mpi"

    def __init__(self, algorithm: str | None) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def wrap(self, a: np.ndarray) -> Any:
        return a

    def op(self, name: str, out: Any, inp: Any) -> None:
        c = self.comm
        if name == "allreduce":
            c.Allreduce(self.MPI.IN_PLACE, out)
        elif name == "broadcast":
            c.Bcast(out, 0)
        elif name == "allgather":
            c.Allgather(inp, out)
        elif name == "reduce_scatter":
            c.Reduce_scatter_block(inp, out)
        elif name == "alltoall":
            c.Alltoall(inp, out)

    def max_over_ranks(self, x: float) -> float:
        a = np.array([x])
        self.comm.Allreduce(self.MPI.IN_PLACE, a, op=self.MPI.MAX)
        return float(a[0])

    def sum_over_ranks(self, x: float) -> float:
        a = np.array([x])
        self.comm.Allreduce(self.MPI.IN_PLACE, a, op=self.MPI.SUM)
        return float(a[0])

    def close(self) -> None:
        pass  # MPI finalizes at exit
