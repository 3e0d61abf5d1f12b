"""Chat interactions are answered once: on every front process, every node, after a restart.

The chat front checks the platform's signature and its five-minute
timestamp window, then asks `first_seen` before it runs the command: the id
is inserted into `chat_interaction`, and a replay of the same signed request
(sent to another process or node, or after a restart) finds it there and is
refused.  Ids are kept for twice the signature window (a replay older than
that fails the timestamp check); older rows are deleted at most once a
minute per process.
"""
from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta

from peewee import IntegrityError

from models import SeenInteraction, database
from models.clock import utcnow

#: How often one process deletes expired ids (seconds).
PRUNE_EVERY_S = 60.0

_prune = {"last": float("-inf")}
_prune_lock = threading.Lock()


def first_seen(interaction_id: str, window_s: int) -> bool:
    """Record a verified interaction's id; False if any process recorded it before.

    `window_s`: how far a signature's timestamp may be from now; ids are kept
    for twice that.  Call only after the signature is verified (an unsigned
    request must never write here).  Blocking database work: call it off the
    event loop.
    """
    now = utcnow()
    with database.connection_context():
        try:
            with database.atomic():
                SeenInteraction.insert(id=interaction_id, seen_at=now).execute()
        except IntegrityError:
            return False
        _maybe_prune(now - timedelta(seconds=2 * window_s))
    return True


def _maybe_prune(before: datetime) -> None:
    with _prune_lock:
        mono = time.monotonic()
        if mono - _prune["last"] < PRUNE_EVERY_S:
            return
        _prune["last"] = mono
    SeenInteraction.delete().where(SeenInteraction.seen_at < before).execute()
