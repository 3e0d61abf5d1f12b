"""What the record writer makes of a batch of queued entries, and of a failed write
(`service.http.records`)."""
from __future__ import annotations

import logging
import sqlite3
from collections.abc import Sequence
from typing import Any

from models.db import MissingDatabaseFile

log = logging.getLogger("logic.records")


def expand(entries: Sequence[Any]) -> list[Any]:
    """Record items for a batch: history only for each endpoint's newest N entries.

    Plain items (anything without `records`) pass through unchanged. The
    newest entry of an endpoint carries its current plan's N.
    """
    left: dict[int, int] = {}
    out: list[list[Any]] = []
    for entry in reversed(entries):
        convert = getattr(entry, "records", None)
        if convert is None:
            out.append([entry])
            continue
        try:
            slot = entry.history_slot()
            history = False
            if slot is not None:
                endpoint_id, keep = slot
                n = left.setdefault(endpoint_id, keep)
                if n > 0:
                    left[endpoint_id] = n - 1
                    history = True
            out.append(convert(history))
        except Exception:  # noqa: BLE001 - one bad entry must not cost the batch
            log.error("a request could not be turned into records; skipped", exc_info=True)
    out.reverse()
    return [item for items in out for item in items]


def mark_of(batch: Sequence[Any]) -> Any:
    """The journal mark of the last journaled entry of `batch` (None: none is)."""
    for entry in reversed(batch):
        mark = getattr(entry, "mark", None)
        if mark is not None:
            return mark
    return None


def local_reason(err: BaseException) -> str | None:
    """The first line of a SQLite error's text (a full disk, a read-only or
    removed file), or None for a database server's error."""
    # The first error of the chain: a full disk ends SQLite's transaction, so
    # what reaches here may be the rollback's "no transaction is active".
    cause: BaseException | None = None
    seen: BaseException | None = err
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, (sqlite3.Error, MissingDatabaseFile)):
            cause = seen
        seen = seen.__cause__ or seen.__context__
    if cause is None:
        return None
    text = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return text[:200]
