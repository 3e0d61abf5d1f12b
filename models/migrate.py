"""Schema migrations: discover `models/migrations/NNNN_*.py`, apply them in
order, record each in the `schema_version` table, and refuse to run on a
database that is behind.

Each migration runs in its own transaction together with its history row, so
a failure leaves the database at the previous version (SQLite and PostgreSQL
both have transactional DDL).  Concurrent upgrades are serialised: SQLite by
`BEGIN IMMEDIATE`, PostgreSQL by a transaction-scoped advisory lock; each
transaction re-reads the version after taking the lock, so a second runner
skips what the first applied.
"""
from __future__ import annotations

import importlib
import logging
import pkgutil
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from peewee import Database, PostgresqlDatabase

from models.clock import utcnow

log = logging.getLogger("logic.migrate")

HISTORY_TABLE = "schema_version"
_PACKAGE = "models.migrations"
_ADVISORY_KEY = 0x4C6F676963   # "Logic"


def _sql(db: Database, sql: str, params: tuple[Any, ...] = ()) -> Any:
    """`db.execute_sql` (untyped in peewee's stubs) behind one typed call."""
    return db.execute_sql(sql, params)  # type: ignore[no-untyped-call]


class MigrationError(Exception):
    """A migration cannot be found or applied."""


class SchemaBehindError(Exception):
    """The database is older (or newer) than this release; one-line message."""

    def __init__(self, current: int, latest: int) -> None:
        self.current, self.latest = current, latest
        if current < latest:
            msg = (f'database schema is at version {current}, this release needs {latest}: '
                   f'run "logic db upgrade"')
        else:
            msg = (f"database schema is at version {current}, newer than this release "
                   f"({latest}): upgrade the software")
        super().__init__(msg)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    module: ModuleType


def discover() -> list[Migration]:
    """All migrations shipped with this release, in version order."""
    package = importlib.import_module(_PACKAGE)
    found: list[Migration] = []
    for info in pkgutil.iter_modules(package.__path__):
        head, _, _ = info.name.partition("_")
        if not head.isdigit():
            continue
        module = importlib.import_module(f"{_PACKAGE}.{info.name}")
        if not callable(getattr(module, "up", None)) or not callable(getattr(module, "down", None)):
            raise MigrationError(f"migration {info.name} must define up(db) and down(db)")
        found.append(Migration(int(head), info.name, module))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    # Numbers are reserved per branch of work, so a release may skip one (a
    # gap is harmless: the history table records what was applied); a
    # duplicate or a non-positive number is a packaging mistake.
    if len(set(versions)) != len(versions) or (versions and versions[0] < 1):
        raise MigrationError("migration versions must be distinct positive numbers")
    return found


def latest_version() -> int:
    """The schema version this release needs (the highest migration number)."""
    found = discover()
    return found[-1].version if found else 0


class Runner:
    """Applies and reverts migrations on one database."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.migrations = discover()
        self.latest = self.migrations[-1].version if self.migrations else 0

    # ------------------------------------------------------------ reading
    def current_version(self) -> int:
        """The highest applied version; 0 for an empty database."""
        if not self.db.table_exists(HISTORY_TABLE):
            return 0
        row = _sql(self.db, f"SELECT MAX(version) FROM {HISTORY_TABLE}").fetchone()
        return int(row[0] or 0)

    def _applied(self) -> set[int]:
        rows = _sql(self.db, f"SELECT version FROM {HISTORY_TABLE}").fetchall()
        return {int(r[0]) for r in rows}

    def check(self) -> None:
        """Raise `SchemaBehindError` unless the database is exactly current."""
        current = self.current_version()
        if current > self.latest:
            raise SchemaBehindError(current, self.latest)
        reached = self._first_missing()
        if reached != self.latest:
            raise SchemaBehindError(reached, self.latest)

    def _first_missing(self) -> int:
        """The version just below the first unapplied migration."""
        applied = self._applied() if self.db.table_exists(HISTORY_TABLE) else set()
        below = 0
        for m in self.migrations:
            if m.version not in applied:
                return below
            below = m.version
        return below

    # ------------------------------------------------------------ writing
    def _lock(self) -> None:
        # Inside a transaction: serialise concurrent runners (SQLite already
        # holds the write lock from BEGIN IMMEDIATE).
        if isinstance(self.db, PostgresqlDatabase):
            _sql(self.db, "SELECT pg_advisory_xact_lock(%s)", (_ADVISORY_KEY,))

    def _ensure_history(self) -> None:
        with self.db.atomic():
            self._lock()
            _sql(self.db,
                 f"CREATE TABLE IF NOT EXISTS {HISTORY_TABLE} ("
                "version INTEGER NOT NULL PRIMARY KEY, name VARCHAR(100) NOT NULL, "
                "applied_at TIMESTAMP NOT NULL)")

    def _check_target(self, target: int) -> None:
        if target != 0 and target not in {m.version for m in self.migrations}:
            raise MigrationError(f"unknown schema version {target}")

    def upgrade(self, target: int | None = None) -> list[int]:
        """Apply every pending migration up to `target` (default: latest);
        return the versions applied (empty when already current)."""
        target = self.latest if target is None else target
        self._check_target(target)
        self._ensure_history()
        applied: list[int] = []
        for migration in [m for m in self.migrations if m.version <= target]:
            with self.db.atomic():
                self._lock()
                if migration.version in self._applied():
                    continue
                log.info("applying migration %s", migration.name)
                migration.module.up(self.db)
                _sql(self.db,
                     f"INSERT INTO {HISTORY_TABLE} (version, name, applied_at) "
                    f"VALUES ({self.db.param}, {self.db.param}, {self.db.param})",
                    (migration.version, migration.name, utcnow()))
                applied.append(migration.version)
        return applied

    def downgrade(self, target: int) -> list[int]:
        """Revert applied migrations down to `target` (0 empties the schema);
        return the versions reverted, newest first."""
        self._check_target(target)
        reverted: list[int] = []
        for migration in reversed([m for m in self.migrations if m.version > target]):
            with self.db.atomic():
                self._lock()
                if migration.version not in self._applied():
                    continue
                log.info("reverting migration %s", migration.name)
                migration.module.down(self.db)
                _sql(self.db,
                     f"DELETE FROM {HISTORY_TABLE} WHERE version = {self.db.param}",
                    (migration.version,))
                reverted.append(migration.version)
        return reverted
