"""`WatchedMixin`: a PostgreSQL database whose threads' statements a watch may give up on.

A thread installs a watch (`watching`, `watch_thread`); each of its statements
then tells the watch its connection (`attach`) and its span (`running`), the
automatic reconnect of `playhouse.shortcuts.ReconnectMixin` (next in the
class's order) never retries one the watch gave up on, and that statement's
connection is ended once it returns: closed, or shut when a transaction is
still open (its rollback then fails, and the next statement reconnects).
See `models.db_watch` for why and how a statement is given up on.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

from models.db_watch import StatementWatch

if TYPE_CHECKING:   # what it is mixed into: the reconnect mixin, then the database
    from playhouse.shortcuts import ReconnectMixin as _Base  # type: ignore[import-untyped]
else:
    _Base = object


class WatchedMixin(_Base):  # type: ignore[misc]
    """Mixed in before `ReconnectMixin` (see the module docstring)."""

    _reconnect_errors: dict[type, list[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watches = threading.local()

    @contextmanager
    def watching(self, watch: StatementWatch) -> Iterator[StatementWatch]:
        """The calling thread's statements run under `watch` meanwhile."""
        previous = getattr(self._watches, "watch", None)
        self._watches.watch = watch
        try:
            yield watch
        finally:
            self._watches.watch = previous
            watch.detach()

    def watch_thread(self, watch: StatementWatch | None) -> None:
        """The calling thread's statements run under `watch` from now on (None: no more)."""
        self._watches.watch = watch

    def _reconnect(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        watch: StatementWatch | None = getattr(self._watches, "watch", None)
        if watch is None:
            return super()._reconnect(func, *args, **kwargs)
        with self._under(watch):
            watch.attach(self)
            try:
                return func(*args, **kwargs)
            except Exception as exc:
                # Given up on: never again, on a socket nobody watches.
                if watch.abandoned or self.in_transaction() or not self._reconnectable(exc):
                    raise
            if not self.is_closed():
                self.close()
            self.connect()
            watch.attach(self)
            return func(*args, **kwargs)

    def commit(self) -> None:
        self._watched(super().commit, final=True)

    def rollback(self) -> None:
        self._watched(super().rollback)

    def _watched(self, func: Callable[[], Any], final: bool = False) -> Any:
        watch: StatementWatch | None = getattr(self._watches, "watch", None)
        if watch is None:
            return func()
        with self._under(watch, final):
            if not self.is_closed():
                watch.attach(self)
            return func()

    @contextmanager
    def _under(self, watch: StatementWatch, final: bool = False) -> Iterator[None]:
        """One statement under `watch` (`final`: a COMMIT); a failure it gave up
        on is said as the watch says it, and its connection ends after it."""
        try:
            with watch.running(final):
                yield
        except Exception as exc:
            self._given_up(watch, exc)
            raise
        finally:
            if watch.abandoned:
                self._end_abandoned(watch)

    @staticmethod
    def _given_up(watch: StatementWatch, exc: Exception) -> None:
        """A statement failed: if because it was given up on, say so if the watch does."""
        if watch.abandoned:
            timed_out = watch.timed_out(exc)
            if timed_out is not None:
                raise timed_out from exc

    def _reconnectable(self, exc: BaseException) -> bool:
        fragments = self._reconnect_errors.get(type(exc), ())
        text = str(exc).lower()
        return any(fragment in text for fragment in fragments)

    def _end_abandoned(self, watch: StatementWatch) -> None:
        """A statement given up on returned: its connection is used no more
        (a cancel landing late must not hit the next statement)."""
        watch.shut()
        if not self.in_transaction():   # else the transaction's rollback fails, then a reconnect
            try:
                self.close()
            except Exception:  # noqa: BLE001 - closing a shut connection may complain
                self._state.reset()
