"""Start one benchmark job (``python -m erdma_core.cli.bench``) of one system on P ranks, on loopback or with one
rank per lab namespace, and return its validated rows. MPI ranks start through mpirun; in the lab mpirun
reaches each namespace the way it reaches hosts, through a remote-shell agent (``netlab/nsrsh``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.netlab.topology import Lab
from benchmarks.netlab.veth import VethPair
from erdma_core.cli.launcher import free_port

HERE = Path(__file__).resolve().parent
# system name -> (erdma_core.cli.bench --backend, extra environment); erdma-quic authenticates with a secret
# made fresh for each harness process
_QUIC_SECRET = os.urandom(16).hex()
SYSTEMS: dict[str, tuple[str, dict[str, str]]] = {
    "erdma": ("erdma", {}),  # TCP between hosts; Unix sockets between ranks on one host (loopback)
    "erdma-tcp": ("erdma", {"ERDMA_TRANSPORT_TCP_LOCAL_SOCKETS": "false"}),  # TCP even on one host
    "erdma-pool8": ("erdma", {"ERDMA_TRANSPORT_TCP_CONNECTIONS": "8"}),  # a pool of 8 TCP connections per pair
    "erdma-host-cc": ("erdma", {"ERDMA_TRANSPORT_TCP_CONGESTION": "host"}),  # TCP on the hosts' controller (--cc)
    # erdma-quic on its default engine (the compiled one, ngtcp2, where it was built), and on each by name
    "erdma-quic": ("erdma", {"ERDMA_TRANSPORT": "quic", "ERDMA_TRANSPORT_QUIC_SECRET": _QUIC_SECRET}),
    "erdma-quic-ngtcp2": ("erdma", {"ERDMA_TRANSPORT": "quic", "ERDMA_TRANSPORT_QUIC_SECRET": _QUIC_SECRET,
                                    "ERDMA_TRANSPORT_QUIC_ENGINE": "ngtcp2"}),
    "erdma-quic-aioquic": ("erdma", {"ERDMA_TRANSPORT": "quic", "ERDMA_TRANSPORT_QUIC_SECRET": _QUIC_SECRET,
                                     "ERDMA_TRANSPORT_QUIC_ENGINE": "aioquic"}),  # the reference engine
    "erdma-dpdk": ("erdma", {"ERDMA_TRANSPORT": "dpdk"}),  # erdma-dpdk: memif between the ranks of one host
    # memif without its zero-copy client mode: both ends copy through memif's own region
    "erdma-dpdk-copy": ("erdma", {"ERDMA_TRANSPORT": "dpdk", "ERDMA_TRANSPORT_DPDK_MEMIF_ZERO_COPY": "false"}),
    # erdma-dpdk's af_packet on each rank's eth0 (``netlab.veth.VethPair``; root)
    "erdma-dpdk-af_packet": ("erdma", {"ERDMA_TRANSPORT": "dpdk", "ERDMA_TRANSPORT_DPDK_BACKEND": "af_packet",
                                       "ERDMA_TRANSPORT_DPDK_INTERFACE": "eth0"}),
    "erdma-ring": ("erdma", {"ERDMA_ALGORITHM": "ring"}),  # allreduce always by the ring, whatever the size
    # erdma-naca: allreduce through an aggregation node (``erdma naca serve``) that run_job starts in the root
    # namespace, on the lab's host port (the switch: its link is not rate-limited) or on loopback
    "erdma-naca": ("erdma", {"ERDMA_ALGORITHM": "naca"}),
    "erdma-naca-auto": ("erdma", {}),  # the node named, allreduce left on auto: erdma-naca's auto_max_bytes decides
    "erdma-int8": ("erdma", {"ERDMA_COMPRESSION": "int8"}),  # erdma-gpucomp: gradients as absmax int8, EF
    "erdma-int8-pipelined": ("erdma", {"ERDMA_COMPRESSION": "int8", "ERDMA_COMPRESSION_PIPELINE": "true"}),
    "gloo": ("gloo", {}),
    "hivemind": ("hivemind", {}),  # its averager over its own libp2p daemon (pip install hivemind)
    "mpi": ("mpi", {}),  # Open MPI's TCP BTL
    "mpi-sm": ("mpi", {"MPI_BTL": "self,vader"}),  # Open MPI's shared memory, on one host only
}


# what a lossy system's results are checked against (relative to the largest expected value, on the bench's
# random data): int8 re-quantizes each partial sum, within 1/254 of its block's largest value each time, so a
# ring of 4 ranks measured up to 1.6% (erdma bench -n 4 --sizes 1M,16M); 5% holds up to 8 ranks
BENCH_ARGS: dict[str, list[str]] = {"erdma-int8": ["--rtol", "0.05"], "erdma-int8-pipelined": ["--rtol", "0.05"],
                                    "hivemind": ["--rtol", "1e-6"]}  # a mean times the ranks may round


class JobFailed(RuntimeError):
    pass


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | extra


def _mpirun(n: int, argv: Sequence[str], lab: Lab | None, btl: str = "tcp,self") -> tuple[list[str], dict[str, str]]:
    base = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(n), "--mca", "btl", btl]
    if lab is None:  # on one host: TCP over loopback (or, for mpi-sm, shared memory)
        extra = ["--mca", "btl_tcp_if_include", "lo"] if "tcp" in btl else []
        return [*base, *extra, *argv], _env({})
    if "tcp" not in btl:
        raise ValueError(f"MPI with btl {btl} cannot reach the lab's other namespaces")
    net = f"10.77.{lab.subnet}.0/24"
    hosts = ",".join(f"{lab.addr(i)}:1" for i in range(n))
    cmd = [*base, "--host", hosts, "--mca", "plm_rsh_agent", str(HERE / "netlab" / "nsrsh"),
           "--mca", "plm_rsh_no_tree_spawn", "1", "--mca", "plm_rsh_num_concurrent", "1", "--mca", "oob_tcp_if_include", net,
           "--mca", "btl_tcp_if_include", net, *argv]
    return cmd, _env({"NETLAB_HOSTS": " ".join(f"{lab.addr(i)}={lab.ranks[i]}" for i in range(n))})


def run_job(system: str, n: int, bench_args: Sequence[str], lab: Lab | VethPair | None = None,
            timeout: float = 900.0, erdma_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run the job; raise JobFailed naming the system, the rank and the cause on any failure or timeout."""
    if system not in SYSTEMS:
        raise ValueError(f"system {system!r}: valid choices are {', '.join(SYSTEMS)}")
    backend, system_env = SYSTEMS[system]
    if isinstance(lab, VethPair) and (backend == "mpi" or system.startswith("erdma-naca")):
        raise ValueError(f"system {system!r} does not run on a VethPair (it needs the lab's hosts or host port)")
    with tempfile.TemporaryDirectory(prefix="erdma-bench-") as tmp:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, "-m", "erdma_core.cli.bench", "--backend", backend, *bench_args, *BENCH_ARGS.get(system, []),
                "--json", str(out)]
        node = _naca_node(Path(tmp), lab) if system.startswith("erdma-naca") else None
        system_env = system_env | (node[1] if node else {})
        if backend == "mpi":
            cmd, env = _mpirun(n, argv, lab, system_env.get("MPI_BTL", "tcp,self"))
            procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
        else:
            master = lab.addr(0) if lab else "127.0.0.1"
            env = _env({"MASTER_ADDR": master, "MASTER_PORT": str(29500 if lab else free_port()),
                        "WORLD_SIZE": str(n), "GLOO_SOCKET_IFNAME": "eth0" if lab else "lo"} | system_env
                       | (erdma_env or {}))
            procs = [subprocess.Popen(lab.command(i, argv) if lab else argv, env=env | {"RANK": str(i)},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
        try:
            _wait(system, procs, timeout)
        finally:
            if node is not None:
                node[0].kill()
                node[0].wait()
        return json.loads(out.read_text())


def _naca_node(tmp: Path, lab: Lab | None) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """An aggregation node for one job, and the environment that points the ranks at it."""
    secret = tmp / "naca.secret"
    secret.write_text(os.urandom(32).hex())
    host = lab.host_addr if lab else "127.0.0.1"
    if lab is not None and not lab.host_port:
        raise ValueError("erdma-naca in the lab needs the lab's host port (Lab(..., host_port=True))")
    proc = subprocess.Popen([sys.executable, "-m", "erdma_core.cli", "naca", "serve", "--host", host, "--port", "0",
                             "--secret-file", str(secret)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    from erdma_naca.serve import address_of  # erdma-naca's; imported only for this system

    try:
        address = address_of(proc)
    except RuntimeError as exc:
        raise JobFailed(f"erdma-naca: {exc}") from None
    return proc, {"ERDMA_NACA_NODES": address, "ERDMA_ALGORITHM_ALLREDUCE_NACA_SECRET_FILE": str(secret)}


def _wait(system: str, procs: list[subprocess.Popen[str]], timeout: float) -> None:
    import time

    deadline = time.monotonic() + timeout
    errors: list[str] = []
    try:
        for rank, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise JobFailed(f"{system}: rank {rank} still running after {timeout:.0f}s") from None
            if p.returncode != 0:
                errors.append(f"{system}: rank {rank} exited {p.returncode}: {err.strip()[-1500:]}")
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if errors:
        raise JobFailed(errors[0])
