"""models/migrations."""
