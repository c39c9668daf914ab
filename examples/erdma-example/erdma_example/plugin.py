"""Entry point ``erdma.plugins: example``: registers the components. Importing it is cheap: each factory
imports its module only when a job selects the component."""

from __future__ import annotations

from typing import Any

from erdma_core.sdk import Config, Option, Register, RegisterAlgorithm, hookimpl


def _unix(config: Config, section: dict[str, Any]) -> Any:
    from .unix import UnixTransport

    return UnixTransport(config, section)


def _half(config: Config, section: dict[str, Any]) -> Any:
    from .half import Half

    return Half(config, section)


def _bruck(spec: Any) -> Any:
    from .bruck import allgather

    return allgather(spec)


@hookimpl
def erdma_register_transports(register: Register) -> None:
    register("unix", _unix, description="Unix-domain stream sockets (ranks on one host)",
             options={"folder": Option(str, "", "where the sockets live; empty: the temp folder")}, sdk=2)


@hookimpl
def erdma_register_compressors(register: Register) -> None:
    register("half", _half, description="float32/float64 sent as float16, with error feedback",
             options={"error_feedback": Option(bool, True, "carry each step's rounding error into the next")}, sdk=2)


@hookimpl
def erdma_register_algorithms(register: RegisterAlgorithm) -> None:
    register("allgather", "bruck", _bruck, description="Bruck: ceil(log2 p) steps for any world size", sdk=2)
