"""Who decides each of membership's write-once keys when no store does: the members of one epoch.

A key's acceptors must be fixed with the key, the same for every member that asks. So each key belongs to an
epoch: the record of epoch ``e`` (``epoch/<e>``) is decided by the members of epoch ``e - 1``, and what is
decided within epoch ``e`` (its votes and outcomes, ``vote/<e>/...``) by the members of epoch ``e``. Any two
majorities of one epoch's members meet, so two sides of a partition can never both decide the same key,
and the side without a majority of the epoch before cannot form the next one: it pauses. The first epoch has
no epoch before it: its record is written by the job's creator (``FIRST``) and only read.
"""

from __future__ import annotations

from collections.abc import Callable

from .membership import Record

FIRST = 1  # the job's first epoch


def acceptors(key: str, record: Callable[[int], Record | None]) -> tuple[str, ...] | None:
    """The member ids that decide ``key`` (a key under the job's prefix, the prefix taken off), given
    ``record(e)``: epoch ``e``'s record when this member knows it. None when the key is not one the members
    decide (the first epoch's record, or a key of another kind) or the record it depends on is not known here."""
    parts = key.split("/")
    try:
        epoch = int(parts[1])
    except (IndexError, ValueError):
        return None
    if parts[0] == "epoch" and len(parts) == 2 and epoch > FIRST:
        owner = record(epoch - 1)
    elif parts[0] == "vote" and len(parts) >= 3 and epoch >= FIRST:
        owner = record(epoch)
    else:
        return None
    return None if owner is None else tuple(m.id for m in owner.members)
