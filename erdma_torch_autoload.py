"""torch's ``torch.backends`` entry point for erdma-core: ``import torch`` calls ``register``, which makes
"erdma" a torch.distributed backend name with no eRDMA import, so frameworks that take the backend as a string
(Lightning's ``process_group_backend``, accelerate, torchtitan and torchtune configs) can choose it.

It lives outside the ``erdma_core`` package so that every ``import torch`` pays for nothing of eRDMA: the
creator imports ``erdma_core.torch`` (and the core) only when a group is made. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
turns torch's entry points off; ``import erdma_core.torch`` still registers the backend then.
"""

from __future__ import annotations

from typing import Any

BACKEND = "erdma"


def register() -> None:
    """Register "erdma" with torch.distributed (idempotent; nothing where torch has no distributed package)."""
    import torch.distributed as dist

    if dist.is_available() and BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def _create(store: Any, rank: int, size: int, timeout: Any) -> Any:
    from erdma_core import torch as backend

    return backend.create(store, rank, size, timeout)
