"""Peewee models, migrations and queries."""
