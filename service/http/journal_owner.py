"""A records journal belongs to one database: the installation id it was written for.

The journal's entries name endpoints by their row id, so a journal replayed
into another database puts one guild's requests into whatever endpoint has
that id there (review, session 27: a journal left by a crashed installation
was replayed by another one started with the same journal directory — on
PostgreSQL the default is ./logic-journal — and guild 222's request bodies
appeared in guild 444's history). The directory holds a file `installation`
naming the database it was written for; a start finds it, and when it names
another database the segments are moved aside, not replayed.
"""
from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from service.http.journal import _SEGMENT

log = logging.getLogger("logic.records")

STAMP = "installation"
_SAFE = re.compile(r"[0-9A-Za-z_-]{1,64}")


def bind_to_installation(directory: Path, installation: str) -> int:
    """Make `directory` (a journal the caller holds locked, with the `front-N`
    journals inside it) the journal of `installation`; returns how many
    segments of another installation were moved into a `quarantine-...`
    directory beside them instead of being replayed."""
    stamp = directory / STAMP
    try:
        owner: str | None = stamp.read_text(encoding="utf-8", errors="replace").strip()
    except FileNotFoundError:
        owner = None   # a journal from before the stamp: it can only be this database's
    moved = 0
    if owner is not None and owner != installation:
        name = owner if _SAFE.fullmatch(owner) else "unknown"
        quarantine = directory / f"quarantine-{name}-{int(time.time())}"
        quarantine.mkdir(mode=0o700, exist_ok=True)
        for folder, prefix in [(directory, ""), *((sub, sub.name + "-") for sub in
                                                  sorted(directory.glob("front-*")))]:
            for path in sorted(folder.iterdir()):
                if _SEGMENT.fullmatch(path.name):
                    os.replace(path, quarantine / (prefix + path.name))
                    moved += 1
        log.warning("records journal %s was written for another database (installation %s, "
                    "this one is %s): %d segments moved to %s, not replayed", directory, name,
                    installation, moved, quarantine.name)
    if owner != installation:
        part = directory / (STAMP + ".new")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, installation.encode())
        finally:
            os.close(fd)
        os.replace(part, stamp)
    return moved
