"""Bounds a receiver applies to what a peer says before it allocates anything."""

from __future__ import annotations


def encoded_limit(raw_bytes: int) -> int:
    """The most payload bytes an encoded message of ``raw_bytes`` (decoded) may carry: a receiver never
    allocates more on a peer's word, and a sender whose encoding is larger sends the raw bytes instead."""
    return raw_bytes + (raw_bytes >> 3) + (1 << 16)
