"""Discovery: how the ranks of a job find each other. ``discovery.init_method`` is a URL (as torch's
``init_method``); its scheme picks the discovery method, which gives every rank the same ``Store``, a small
key-value store the ranks publish their addresses in and agree through. Built in: ``env://``, ``tcp://``,
``file://``, ``etcd://`` (an etcd cluster: ``etcd``); plugins add more (``erdma_register_discovery``)."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from ..errors import ConfigError
from ..protocol.store import Store
from .etcd import EtcdStore, etcd_store
from .store import FileStore, TCPStore

__all__ = ["EtcdStore", "FileStore", "Store", "TCPStore", "check_file", "check_tcp", "env_store", "etcd_store",
           "file_store", "tcp_store"]


def _tcp_address(url: str) -> tuple[str, int]:
    """The host and port of a ``tcp://HOST:PORT`` URL; ConfigError naming the key otherwise."""
    try:
        parsed = urlparse(url)
        host, port = parsed.hostname, parsed.port
    except ValueError:  # a port that is not a number, or out of range
        host, port = None, None
    if not host or not port:
        raise ConfigError(f"config key 'discovery.init_method': {url!r} needs a host and a port: tcp://HOST:PORT")
    return host, port


def _file_path(url: str) -> str:
    """The folder of a ``file:///PATH`` URL; ConfigError naming the key otherwise."""
    path = urlparse(url).path
    if not path:
        raise ConfigError(f"config key 'discovery.init_method': {url!r} needs a path: file:///PATH")
    return path


def check_tcp(config: Any, section: dict[str, Any]) -> None:
    """``tcp://``'s URL names a host and a port (``register(..., check=)``)."""
    _tcp_address(config["discovery.init_method"])


def check_file(config: Any, section: dict[str, Any]) -> None:
    """``file://``'s URL names a path (``register(..., check=)``)."""
    _file_path(config["discovery.init_method"])


def tcp_store(url: str, rank: int, world_size: int, timeout: float, config: Any) -> Store:
    """``tcp://host:port``: rank 0 serves the store on host:port, every rank dials it."""
    host, port = _tcp_address(url)
    secret = config["security.secret"].encode() if config is not None else b""
    return TCPStore(host, port, is_server=rank == 0, timeout=timeout, secret=secret,
                    served_by="rank 0" if rank >= 0 else "the process serving the elastic job's store (erdma run "
                    "--elastic)")


def env_store(url: str, rank: int, world_size: int, timeout: float, config: Any) -> Store:
    """``env://``: MASTER_ADDR and MASTER_PORT name the store that rank 0 serves (as torchrun sets them)."""
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise ConfigError(f"init_method 'env://' needs the environment variables {', '.join(missing)} "
                          "(set by torchrun or `erdma run`)")
    return tcp_store(f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", rank, world_size,
                     timeout, config)


def file_store(url: str, rank: int, world_size: int, timeout: float, config: Any) -> Store:
    """``file:///path``: a folder on a file system all ranks share."""
    return FileStore(_file_path(url))
