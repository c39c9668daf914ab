"""Entry point ``erdma.plugins: naca``: the ``naca`` algorithm for allreduce, broadcast and reduce_scatter
(one offload object per group serves all three), ``auto``'s choice of it for small allreduces where nodes
are named, and ``erdma naca serve``."""

from __future__ import annotations

from typing import Any

from erdma_core.sdk import Config, RegisterAlgorithm, RegisterEnvironment, hookimpl

from .options import ENVIRONMENT, OPTIONS, SECTION, named_nodes, settings


def naca(ctx: Any) -> Any:
    from .offload import Naca

    return Naca(ctx)


def _check(config: Config, section: dict[str, Any]) -> None:
    """The nodes, the admission secret's file and the timers parse (``options.settings``)."""
    settings(config.section("algorithm.allreduce.naca"))


@hookimpl
def erdma_register_algorithms(register: RegisterAlgorithm) -> None:
    register("allreduce", "naca", naca, offload=True, options=OPTIONS,
             description="through aggregation nodes (erdma naca serve): one round up, one down; ring on the hosts "
                         "when none can serve", sdk=2, check=_check)
    for op in ("broadcast", "reduce_scatter"):
        register(op, "naca", naca, offload=True,
                 description="through aggregation nodes; options in [algorithm.allreduce.naca]", sdk=2, check=_check)


@hookimpl
def erdma_choose_algorithm(op: str, nbytes: int, world_size: int, config: Config) -> str | None:
    """``auto``: an allreduce of at most ``auto_max_bytes`` in a group of at least ``auto_min_ranks`` goes
    through the nodes when some are named (the same answer on every rank: the config and ERDMA_NACA_NODES
    are the job's); else the core decides."""
    if op != "allreduce":
        return None
    section = config.section(SECTION)
    if nbytes > section["auto_max_bytes"] or world_size < section["auto_min_ranks"] \
            or not named_nodes(section)[0].strip(" ,"):
        return None
    settings(section)  # named nodes with no secret file, or a bad address: the ConfigError that names it
    return "naca"


@hookimpl
def erdma_register_environment(register: RegisterEnvironment) -> None:
    for name, description in ENVIRONMENT.items():
        register(name, description)


@hookimpl
def erdma_add_commands(subparsers: Any) -> None:
    from .serve import add_parser

    add_parser(subparsers)
