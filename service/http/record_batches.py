"""What the record writer makes of a batch of queued entries (`service.http.records`)."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

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
