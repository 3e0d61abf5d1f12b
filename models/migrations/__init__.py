"""Numbered schema migrations: `NNNN_name.py`, each with `up(db)` and `down(db)`.

Each file holds frozen copies of the tables it touches; `models.migrate.Runner`
applies them in order and records each version in `schema_version`.
"""
