"""A chat interaction id is accepted once, whichever process sees it, and kept only as long as
its signature could still be replayed."""
from __future__ import annotations

from datetime import timedelta

from models import SeenInteraction
from models.clock import utcnow
from service.core import interactions


def test_an_id_is_accepted_once(db):
    assert interactions.first_seen("800000000000000001", 300) is True
    assert interactions.first_seen("800000000000000001", 300) is False
    assert interactions.first_seen("800000000000000002", 300) is True


def test_ids_older_than_twice_the_window_are_deleted(db, monkeypatch):
    old = utcnow() - timedelta(seconds=601)
    recent = utcnow() - timedelta(seconds=599)
    SeenInteraction.insert_many([{"id": "1", "seen_at": old},
                                 {"id": "2", "seen_at": recent}]).execute()
    monkeypatch.setitem(interactions._prune, "last", float("-inf"))
    assert interactions.first_seen("3", 300) is True
    assert sorted(r.id for r in SeenInteraction.select()) == ["2", "3"]
    # At most once a minute per process: a second call does not scan again.
    SeenInteraction.insert(id="4", seen_at=old).execute()
    assert interactions.first_seen("5", 300) is True
    assert "4" in {r.id for r in SeenInteraction.select()}
