"""``ERDMA_DEBUG``: the library's log lines on stderr with no change to the program, as ``NCCL_DEBUG=INFO`` does.

    ERDMA_DEBUG=INFO torchrun --nproc-per-node 2 train.py

``INFO`` shows what each rank set up (transport, paths, algorithm, which collectives a compressor applies to and
from what size, what it saved); ``DEBUG`` adds per-connection detail; ``WARNING``, ``ERROR`` narrow it. Empty or
unset: the program's own logging configuration decides, as before. Applied when ``erdma_core`` is imported."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from .errors import ConfigError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMAT = "erdma %(process)d %(levelname)s %(name)s: %(message)s"


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The one ``ERDMA_DEBUG`` adds (so that a second call changes its level rather than adding another)."""


def configure(environ: Mapping[str, str]) -> None:
    """Send the ``erdma`` loggers' lines at ``ERDMA_DEBUG``'s level and above to stderr (and not also to the
    root logger's handlers: each line once); ConfigError naming the variable for a level it does not know."""
    value = environ.get("ERDMA_DEBUG", "").strip()
    if not value:
        return
    level = {"WARN": "WARNING"}.get(value.upper(), value.upper())
    if level not in LEVELS:
        raise ConfigError(f"environment variable ERDMA_DEBUG={value!r} is not a log level; valid: "
                          f"{', '.join(LEVELS)} (or empty: the program's logging decides)")
    logger = logging.getLogger("erdma")
    handler = next((h for h in logger.handlers if isinstance(h, _Handler)), None)
    if handler is None:
        handler = _Handler()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
