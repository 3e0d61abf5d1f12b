"""`TargetCache`'s outage rule (`service.core.invoke_target`): what a lookup is
answered while PostgreSQL is unreachable, and when an outage begins and ends.

Answers read under the generation the change feed vouched for when its
connection broke are served for at most `outage_serve_s` after the feed
noticed the break, unless the server was seen up since; anything else is
`TargetsUnavailable` (503 `busy`). docs/architecture.md ("PostgreSQL down")
states the guarantee.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from models.db_errors import connection_lost
from service.core.lookup_query import say_refused

if TYPE_CHECKING:
    from models.change_feed import ChangeFeed
    from service.core.target_read import InvokeTarget

log = logging.getLogger("logic.targets")

#: While PostgreSQL is unreachable, one lookup at a time probes it, this long after
#: the previous probe ended; the others are answered at once (see TargetCache).
PROBE_GAP_S = 0.1

_MISSING = object()


class TargetsUnavailable(Exception):
    """The endpoint cannot be looked up now: the database is unreachable and no
    answer the change feed vouched for is remembered (or it is older than
    `outage_serve_s`), the database refused the lookup, or too many lookups wait."""


class OutageRule:
    """The outage half of `TargetCache` (which sets this state up)."""

    _feed: ChangeFeed | None
    _serve_s: float
    _clock: Callable[[], float]
    _entries: dict[tuple[str, str], InvokeTarget | None]
    _version: object
    _conn: object
    _expired_logged: float | None
    _refusing: bool
    _down_since: float | None
    _retry_at: float
    _lookup_timeout: float

    def _answered_unvouched(self, feed: ChangeFeed, started: float | None) -> None:
        """A query begun after the feed's loss was answered: the server is up and
        may commit unannounced changes, so nothing read before is served in an
        outage (review, session 33: a regenerated secret was accepted again)."""
        lost_at = feed.lost_at
        if lost_at is not None and started is not None and started >= lost_at:
            self._entries.clear()
            self._version = None

    def _serving_until(self) -> float | None:
        """Until when (clock) remembered answers may be served, or None: none may."""
        feed = self._feed
        if feed is None or self._serve_s <= 0:
            return None
        vouch = feed.vouch
        if vouch is None or vouch[0] != self._version or self._conn is not feed:
            return None
        return vouch[1] + self._serve_s

    def _outage_answer(self, key: tuple[str, str]) -> InvokeTarget | None:
        until = self._serving_until()
        if until is not None:
            if self._clock() < until:
                found = self._entries.get(key, _MISSING)
                if found is not _MISSING:
                    return found  # type: ignore[return-value]
            elif self._expired_logged != until:
                self._expired_logged = until
                log.warning("the database has been unreachable for %g s (database.outage_serve_s):"
                            " remembered endpoint answers are no longer served", self._serve_s)
        raise TargetsUnavailable("the database is unreachable")

    def _failed(self, err: BaseException, key: tuple[str, str],
                cancelled: bool = False) -> InvokeTarget | None:
        """A lookup's query failed: an outage only when the connection was lost.
        `cancelled`: it had run `lookup_timeout_s` and was cancelled (a lock)."""
        if connection_lost(err):
            return self._unreachable(err, key)
        # The server is up and said no: no outage (one that was on ends here),
        # and nothing from memory: it may be committing changes meanwhile.
        self._end_outage()
        if not self._refusing:
            self._refusing = True
            say_refused(log, err, self._lookup_timeout if cancelled else None)
        raise TargetsUnavailable("the database refused the lookup")

    def _unreachable(self, err: BaseException, key: tuple[str, str],
                     answer: bool = True) -> InvokeTarget | None:
        now = self._clock()
        self._retry_at = max(self._retry_at, now + PROBE_GAP_S)
        if self._down_since is None:
            self._down_since = now
            until = self._serving_until()
            # The error's kind only: its text may carry the server's address.
            log.warning("the database is unreachable (%s): endpoint lookups are answered from "
                        "%d remembered answers for %.0f s more at most, others get 503 busy, "
                        "until it is back", type(err).__name__,
                        len(self._entries) if until is not None else 0,
                        max(0.0, until - now) if until is not None else 0.0)
        return self._outage_answer(key) if answer else None

    def _reachable(self) -> None:
        if self._down_since is not None or self._refusing:
            self._end_outage()
            self._refusing = False

    def _end_outage(self) -> None:
        if self._down_since is not None:
            log.warning("the database is reachable again after %.1f s: endpoint lookups query "
                        "it again", self._clock() - self._down_since)
            self._down_since = None

