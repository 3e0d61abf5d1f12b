"""Fast multi-row INSERT (and upsert) for the record store.

peewee builds every query from an expression tree; for a 50-row insert that
costs far more CPU than the database spends executing it (profiled: ~80 % of
`write_batch`).  The writer shares its process with the event loop, so here
the SQL text is built once per (table, columns, row count) and only the
parameters change.  Values still go through each field's `db_value`, so the
types stored are exactly what peewee would store.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Sequence

from peewee import Field, Model

from models.db import database

#: Parameters per statement; below SQLite's oldest default limit (999).
MAX_PARAMS = 900


@lru_cache(maxsize=64)
def _sql(table: str, columns: tuple[str, ...], rows: int, param: str,
         conflict: tuple[str, ...], add: tuple[str, ...]) -> str:
    one = "(" + ", ".join([param] * len(columns)) + ")"
    sql = (f'INSERT INTO "{table}" (' + ", ".join(f'"{c}"' for c in columns) + ") VALUES "
           + ", ".join([one] * rows))
    if conflict:
        # `excluded` is the row that failed to insert (SQLite >= 3.24, PostgreSQL).
        sets = ", ".join(f'"{c}" = "{table}"."{c}" + excluded."{c}"' for c in add)
        sql += " ON CONFLICT (" + ", ".join(f'"{c}"' for c in conflict) + f") DO UPDATE SET {sets}"
    return sql


def insert_rows(model: type[Model], names: Sequence[str], rows: Sequence[Sequence[Any]], *,
                conflict: Sequence[str] = (), add: Sequence[str] = ()) -> None:
    """INSERT `rows` (values in `names` order) into `model`'s table.

    With `conflict` (field names of a unique index), a clashing row instead
    adds its `add` fields to the existing row (a counter upsert)."""
    if not rows:
        return
    fields: list[Field] = [model._meta.fields[n] for n in names]
    columns = tuple(f.column_name for f in fields)
    conflict_cols = tuple(model._meta.fields[n].column_name for n in conflict)
    add_cols = tuple(model._meta.fields[n].column_name for n in add)
    converters: list[Callable[[Any], Any]] = [f.db_value for f in fields]
    per_statement = max(1, MAX_PARAMS // len(columns))
    db: Any = database.obj
    for start in range(0, len(rows), per_statement):
        chunk = rows[start:start + per_statement]
        params: list[Any] = []
        for row in chunk:
            params.extend(conv(value) for conv, value in zip(converters, row))
        sql = _sql(model._meta.table_name, columns, len(chunk), db.param, conflict_cols, add_cols)
        db.execute_sql(sql, params)
