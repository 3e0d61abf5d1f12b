"""Fixtures: see tests/dbsupport.py."""
from tests.dbsupport import db, db_url, pg_empty_url, pg_migrated, pg_schema  # noqa: F401
