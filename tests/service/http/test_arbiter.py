"""The arbiter's bookkeeping without processes: back-off, journal numbers, a failed reload.

As gunicorn's tests/test_arbiter.py does, the fork and the signals are left
out (`_spawn` and `_signal` recorded instead); test_processes.py runs the real thing.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from service.http.arbiter import MAX_BACKOFF_S, Arbiter
from service.http.front import Front, Slot
from service.settings import load_settings


@pytest.fixture()
def arbiter(monkeypatch: pytest.MonkeyPatch) -> Arbiter:
    arb = Arbiter(load_settings(None, {}, {"server.processes": "2"}))
    arb.slots = [Slot([]), Slot([])]
    arb.booted = True
    arb.sent: list[tuple[int, int]] = []  # type: ignore[misc]
    arb.spawned: list[tuple[int, int, int]] = []  # type: ignore[misc]
    monkeypatch.setattr(arb, "_signal", lambda pid, sig: arb.sent.append((pid, sig)))  # type: ignore[attr-defined]

    def spawn(slot: int, generation: int, journal: int, settings: Any = None) -> None:
        arb.spawned.append((slot, generation, journal))  # type: ignore[attr-defined]
        pid = 10_000 + len(arb.spawned)  # type: ignore[attr-defined]
        arb.fronts[pid] = Front(pid, slot, journal, generation, -1, time.monotonic(), ready=True)

    monkeypatch.setattr(arb, "_spawn", spawn)
    for slot in (0, 1):
        spawn(slot, 0, slot)
    return arb


def _die(arb: Arbiter, slot: int, status: int = signal.SIGKILL) -> Front:
    """The live front of `slot` dies (a wait status: killed by `status`)."""
    front = next(f for f in arb.fronts.values() if f.slot == slot and not f.retiring)
    del arb.fronts[front.pid]
    arb._front_gone(front, status)
    return front


def test_quick_deaths_back_off_doubling_up_to_the_cap(arbiter: Arbiter) -> None:
    delays = []
    for _ in range(9):
        _die(arbiter, 0)
        slot = arbiter.slots[0]
        assert slot.respawn_at is not None
        delays.append(round(slot.respawn_at - time.monotonic()))
        slot.respawn_at = time.monotonic() - 1  # the back-off has passed
        arbiter._maintain()
    assert delays == [0, 1, 2, 4, 8, 16, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S]
    assert [s for s, _, _ in arbiter.spawned[2:]] == [0] * 9  # type: ignore[attr-defined]


def test_a_replacement_waits_for_its_back_off(arbiter: Arbiter) -> None:
    _die(arbiter, 1)
    arbiter._maintain()  # the first death: at once
    _die(arbiter, 1)
    arbiter._maintain()  # the second quick one waits 1 s
    assert len(arbiter.spawned) == 3  # type: ignore[attr-defined]
    arbiter.slots[1].respawn_at = time.monotonic() - 1
    arbiter._maintain()
    assert len(arbiter.spawned) == 4  # type: ignore[attr-defined]


def test_a_dead_fronts_journal_goes_to_the_next_front(arbiter: Arbiter) -> None:
    arbiter.reload = lambda: load_settings(None, {}, {"server.processes": "2"})
    arbiter.handle_hup()  # new fronts journal in 2 and 3; the old ones (0, 1) hand over
    arbiter._check_reload()
    for front in [f for f in arbiter.fronts.values() if f.retiring]:
        del arbiter.fronts[front.pid]
        arbiter._front_gone(front, 0)  # drained: a clean exit leaves nothing to replay
    assert arbiter.orphans == []
    dead = _die(arbiter, 1)
    assert dead.journal == 3
    arbiter._maintain()
    assert arbiter.spawned[-1] == (1, 1, 3)  # type: ignore[attr-defined]  # not the free 0
    _die(arbiter, 0, status=0)  # exited by itself, cleanly
    arbiter._maintain()
    assert arbiter.spawned[-1] == (0, 1, 0)  # type: ignore[attr-defined]  # the lowest free


def test_a_reload_whose_front_dies_keeps_the_running_fronts(arbiter: Arbiter) -> None:
    arbiter.reload = lambda: load_settings(None, {}, {"server.processes": "2"})
    old = set(arbiter.fronts)
    arbiter.handle_hup()
    assert arbiter.pending == 1 and len(arbiter.fronts) == 4
    new = [f for f in arbiter.fronts.values() if f.generation == 1]
    assert sorted(f.journal for f in new) == [2, 3]  # not the running fronts' journals
    del arbiter.fronts[new[0].pid]
    arbiter._front_gone(new[0], signal.SIGSEGV)
    assert arbiter.pending is None
    # The reload's other front listens already: it may be answering requests,
    # so it hands over like an old front (outside review, session 21).
    from service.http.server import HANDOFF_SIGNAL
    assert arbiter.sent == [(new[1].pid, HANDOFF_SIGNAL)]  # type: ignore[attr-defined]
    assert {f.pid for f in arbiter.fronts.values() if not f.retiring} == old


def test_a_reload_whose_front_dies_kills_its_fronts_not_listening_yet(arbiter: Arbiter) -> None:
    arbiter.reload = lambda: load_settings(None, {}, {"server.processes": "2"})
    old = set(arbiter.fronts)
    arbiter.handle_hup()
    new = [f for f in arbiter.fronts.values() if f.generation == 1]
    new[1].ready = False
    del arbiter.fronts[new[0].pid]
    arbiter._front_gone(new[0], signal.SIGSEGV)
    assert arbiter.pending is None
    assert arbiter.sent == [(new[1].pid, signal.SIGKILL)]  # type: ignore[attr-defined]
    assert {f.pid for f in arbiter.fronts.values() if not f.retiring} == old


def test_a_finished_reload_hands_over_from_the_old_fronts(arbiter: Arbiter) -> None:
    arbiter.reload = lambda: load_settings(None, {"LOGIC_SERVER_PORT": "9"}, {})
    old = set(arbiter.fronts)
    arbiter.handle_hup()
    arbiter._check_reload()
    from service.http.server import HANDOFF_SIGNAL

    assert sorted(arbiter.sent) == sorted((pid, HANDOFF_SIGNAL) for pid in old)  # type: ignore[attr-defined]
    assert arbiter.generation == 1 and arbiter.pending is None
    # The port and the number of fronts change only on a restart.
    assert arbiter.settings.server.port == 8080 and arbiter.settings.server.processes == 2
    assert os.getpid() == arbiter.pid
