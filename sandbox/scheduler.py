"""The pool's fair queue: which guild's request gets the next run slot.

Pure bookkeeping, no I/O (the pool owns workers, timers and futures); every
operation is O(1).  Rules (docs/security.md, "Tenancy"):

* ``size`` run slots.  A job is *fair* when its guild had fewer than ``cap``
  (``max(1, floor(size * share))``) jobs running and is in good standing,
  else *excess*.  Excess jobs start only in a free slot while nobody else
  waits (the pool stays work-conserving for a lone guild).  Fair jobs do not
  count excess jobs against the ``size`` slots: a guild within its share
  never waits behind another guild's excess, it runs beside it, so at most
  ``2 * size`` scripts run at once (``size`` fair plus what was excess).
* Waiting guilds are served in turn (round robin), each guild's requests
  in arrival order (FIFO).
* Cost: each guild has a budget of worker-seconds, refilled continuously
  (``budget_s`` per ``window_s``).  Every finished job charges its run
  time.  A guild that is in debt is *deprioritised*: it is served only when
  no guild in good standing waits.  ``budget_s = 0`` turns this off.

Classes of a guild with waiting requests, served in this order: READY
(under its cap, in good standing), OVER (at its cap, in good standing), LOW
(in debt).  Each class is an insertion-ordered ring; serving a guild moves
it to the ring's end, which is what makes the turn go round.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Protocol

__all__ = ["Queued", "Scheduler", "GuildState"]

READY, OVER, LOW = 0, 1, 2


class Queued(Protocol):
    """What the scheduler needs of a request."""

    guild: str
    queued: bool
    deprioritised: bool
    excess: bool


class GuildState:
    """One guild's queue, running count and budget."""

    __slots__ = ("guild", "queue", "running", "tokens", "stamp", "ring", "flagged", "held")

    def __init__(self, guild: str, tokens: float, now: float) -> None:
        self.guild = guild
        self.queue: OrderedDict[Queued, None] = OrderedDict()
        self.running = 0
        self.tokens = tokens          # worker-seconds left; negative = in debt
        self.stamp = now              # when tokens were last refilled
        self.ring = -1                # READY / OVER / LOW, -1 = in no ring
        self.flagged = False          # already reported as deprioritised
        self.held = False             # its next request waits for a worker: serve none now


class Scheduler:
    """Run slots, per-guild FIFO queues and the round robin between guilds."""

    def __init__(self, size: int, share: float = 0.5, budget_s: float = 60.0,
                 window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        if size < 1 or not 0.0 < share <= 1.0 or budget_s < 0 or window_s <= 0:
            raise ValueError("size >= 1, 0 < share <= 1, budget_s >= 0, window_s > 0")
        self.size = size
        self.share = share
        self.window = window_s
        self.cap = max(1, int(size * share))
        self.budget = float(budget_s)
        self.rate = budget_s / window_s
        self.clock = clock
        self.running = 0
        self.excess = 0
        self.waiting = 0
        self.guilds: dict[str, GuildState] = {}
        self._rings: tuple[OrderedDict[GuildState, None], ...] = (
            OrderedDict(), OrderedDict(), OrderedDict())

    # --- the hot path ---------------------------------------------------------
    def start(self, guild: str) -> int:
        """Start a job of ``guild`` now if it may (call only when nobody waits):
        -1 when it must queue, else 0 (fair) or 1 (excess; pass it to ``finish``)."""
        g = self.guilds.get(guild)
        if g is None:
            g = self.guilds[guild] = GuildState(guild, self.budget, self.clock())
        if g.held:
            return -1
        if g.running < self.cap and g.tokens >= 0:
            if self.running - self.excess >= self.size:
                return -1
            excess = 0
        else:
            if self.running >= self.size:
                return -1
            excess = 1
            self.excess += 1
        g.running += 1
        self.running += 1
        return excess

    def finish(self, guild: str, cost_s: float, excess: bool = False) -> bool:
        """Give back ``guild``'s slot and charge ``cost_s``; True when the guild
        has just fallen into debt for the first time (the pool logs it)."""
        self.running -= 1
        if excess:
            self.excess -= 1
        g = self.guilds.get(guild)
        if g is None:
            return False
        g.running -= 1
        return self._debit(g, cost_s)

    def charge(self, guild: str, cost_s: float) -> bool:
        """Charge ``cost_s`` worker-seconds spent for ``guild`` outside a run slot
        (a compile for the code cache); True as ``finish``."""
        g = self.guilds.get(guild)
        if g is None:
            g = self.guilds[guild] = GuildState(guild, self.budget, self.clock())
        return self._debit(g, cost_s)

    def _debit(self, g: GuildState, cost_s: float) -> bool:
        fell = False
        if self.rate and cost_s > 0:
            self._refill(g)
            g.tokens -= cost_s
            if g.tokens < 0 and not g.flagged:
                g.flagged = fell = True
        if g.queue:
            self._place(g)
        return fell

    # --- the queue -------------------------------------------------------------
    def push(self, req: Queued, resume: bool = False) -> bool:
        """Queue ``req`` behind its guild's earlier requests; True when a request
        of its guild could start at once (fair, with fair room: call ``pop``).

        ``resume``: ``req`` had its turn and gave its slot back while it waited
        for a worker process: it goes before its guild's other requests, and
        its guild before the other guilds of its class.  Resume a guild's
        requests in reverse order to keep theirs."""
        g = self.guilds.get(req.guild)
        if g is None:
            g = self.guilds[req.guild] = GuildState(req.guild, self.budget, self.clock())
        g.queue[req] = None
        req.queued = True
        req.deprioritised = g.tokens < 0
        self.waiting += 1
        if g.ring < 0:
            self._place(g)
        if resume:
            g.queue.move_to_end(req, last=False)
            if g.ring >= 0:
                self._rings[g.ring].move_to_end(g, last=False)
        return g.ring == READY and self.running - self.excess < self.size

    def pop(self) -> Queued | None:
        """The next request to run (its slot taken, ``req.excess`` set), or None."""
        if not self.waiting or self.running - self.excess >= self.size:
            return None
        rings = self._rings
        low = rings[LOW]
        if low:
            # One debtor re-examined per decision: a refilled guild is back in
            # good standing; otherwise it goes to the end of the ring.
            g = next(iter(low))
            self._refill(g)
            if g.tokens >= 0:
                self._place(g, rotate=True)
            else:
                low.move_to_end(g)
        if rings[READY]:
            g = next(iter(rings[READY]))
            excess = False
        elif self.running < self.size and (rings[OVER] or low):
            g = next(iter(rings[OVER] or low))
            excess = True
            self.excess += 1
        else:
            return None  # only excess jobs (or held guilds' requests) wait, no slot is free
        req, _ = g.queue.popitem(last=False)
        req.queued = False
        req.excess = excess
        self.waiting -= 1
        g.running += 1
        self.running += 1
        self._place(g, rotate=True)
        return req

    def hold(self, guild: str) -> None:
        """Serve none of ``guild``'s requests until ``release``: one of them gave its
        slot back to wait for a worker process, and the others would only do the same."""
        g = self.guilds.get(guild)
        if g is None:
            g = self.guilds[guild] = GuildState(guild, self.budget, self.clock())
        g.held = True
        self._place(g)

    def release(self, guild: str) -> None:
        """Serve ``guild``'s requests again (its worker is ready, or its wait ended)."""
        g = self.guilds.get(guild)
        if g is not None and g.held:
            g.held = False
            self._place(g)

    def cancel(self, req: Queued) -> bool:
        """Take a queued request out at once (its client left, or it timed out)."""
        if not req.queued:
            return False
        g = self.guilds[req.guild]
        del g.queue[req]
        req.queued = False
        self.waiting -= 1
        self._place(g)
        return True

    def crowding(self, guild: str) -> Queued | None:
        """When the queue is full: the newest waiting request of the guild with the
        most waiting requests, if that guild has at least two more than ``guild``
        (refusing it makes room for ``guild``'s; O(guilds), only while full)."""
        g = self.guilds.get(guild)
        have = len(g.queue) if g is not None else 0
        top = max(self.guilds.values(), key=lambda s: len(s.queue), default=None)
        if top is None or len(top.queue) < have + 2:
            return None
        return next(reversed(top.queue))

    def standing(self, guild: str) -> float:
        """Worker-seconds ``guild`` has left (negative: in debt; for operators and tests)."""
        g = self.guilds.get(guild)
        if g is None:
            return self.budget
        self._refill(g)
        return g.tokens

    def sweep(self) -> None:
        """Forget guilds with nothing running, nothing queued and a full budget (O(guilds);
        called from the pool's housekeeping, not per request)."""
        for name, g in list(self.guilds.items()):
            if not g.running and not g.queue and not g.held:
                self._refill(g)
                if g.tokens >= self.budget:
                    del self.guilds[name]

    # --- internals ------------------------------------------------------------
    def _refill(self, g: GuildState) -> None:
        now = self.clock()
        if g.tokens < self.budget:
            g.tokens = min(self.budget, g.tokens + (now - g.stamp) * self.rate)
        g.stamp = now

    def _place(self, g: GuildState, rotate: bool = False) -> None:
        """Move ``g`` to the ring its state belongs to (or out of every ring); a
        guild that stays in its ring keeps its turn unless ``rotate``."""
        if not g.queue or g.held:
            ring = -1
        elif self.rate and g.tokens < 0:
            ring = LOW
        elif g.running >= self.cap:
            ring = OVER
        else:
            ring = READY
        if ring == g.ring:
            if rotate and ring >= 0:
                self._rings[ring].move_to_end(g)
            return
        if g.ring >= 0:
            del self._rings[g.ring][g]
        g.ring = ring
        if ring >= 0:
            self._rings[ring][g] = None
