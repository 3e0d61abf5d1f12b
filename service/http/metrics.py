"""The service's metrics: plain counters on the event loop, and what a scrape reports.

The invoke path is the hot path, so no prometheus-client object is touched per
request: `Metrics.invoke_answered` adds one to a dict entry and to two
histogram buckets kept in plain lists (about a microsecond, on the loop, no
lock). Everything else is read only when `GET /metrics` is scraped: the
sandbox pool's counters (`Pool.counters`), the record writer's counters, and
these dicts. `families` turns all of it into `Family` values, which
`service.http.metrics_export` writes in the Prometheus text format (one
process) or into prometheus-client's multiprocess files (several front
processes, see `prepare_multiprocess_dir`).

Label values come only from closed sets (status codes, error codes, plan
names, front names) or, with `metrics.per_guild`, from the guild of an
endpoint that exists: never from a path, a header or a body.
"""

from __future__ import annotations

import glob
import os
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sandbox.pool import Outcome
    from service.core.invoke_target import InvokeTarget
    from service.http.context import AppContext
    from service.http.wire import ErrorRenderer

#: prometheus-client's variable for the multiprocess directory: set by
#: `prepare_multiprocess_dir` in the arbiter, inherited by every front.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Upper bounds (seconds) of the latency histograms' buckets; one more bucket (+Inf) follows.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: Tornado handler modules by the front they belong to (`logic_http_requests_total{front}`).
_FRONTS = (("service.api.", "api"), ("service.dashboard.", "dashboard"), ("service.chat.", "chat"),
           ("service.http.health", "health"), ("service.http.metrics", "metrics"))


class AnsweredRequest(Protocol):
    """What `Metrics.invoke_answered` reads of an answered invoke request."""

    status: int
    error_code: str | None
    target: InvokeTarget | None
    started: float
    finished: float
    outcome: Outcome | None


class Histograms:
    """Bucket counts (not cumulative) and sum of one histogram, per label value.

    One plain list per label value: a count per `BUCKETS` bound, one for +Inf,
    and the sum of the observations last (one lookup per observation).
    """

    __slots__ = ("series",)

    def __init__(self) -> None:
        self.series: dict[str, list[float]] = {}

    def observe(self, key: str, seconds: float) -> None:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = [0] * (len(BUCKETS) + 2)
        series[bisect_left(BUCKETS, seconds)] += 1  # the first bound >= seconds: "le"
        series[-1] += seconds


class Metrics:
    """Per-process counters, owned by the event loop thread (no lock)."""

    __slots__ = ("per_guild", "invoke", "service", "script", "http", "_fronts")

    def __init__(self, per_guild: bool = False) -> None:
        self.per_guild = per_guild
        #: (status, error code or "", plan or "", guild or "") -> answered invoke requests
        self.invoke: dict[tuple[int, str, str, str], int] = {}
        self.service = Histograms()   # by plan: arrival of the head to the answer
        self.script = Histograms()    # by plan: the script's own run time in the worker
        #: (front, status, error code or "") -> other requests (admin API, dashboard, ...)
        self.http: dict[tuple[str, int, str], int] = {}
        self._fronts: dict[type, str] = {}

    def invoke_answered(self, request: AnsweredRequest) -> None:
        """Count one answered invoke request (on the loop, once per request)."""
        target = request.target
        plan = guild = ""
        if target is not None:
            plan = target.plan.name
            if self.per_guild:
                guild = target.guild_id
        key = (request.status, request.error_code or "", plan, guild)
        invoke = self.invoke
        invoke[key] = invoke.get(key, 0) + 1
        self.service.observe(plan, request.finished - request.started)
        outcome = request.outcome
        if outcome is not None:
            self.script.observe(plan, outcome.duration_ms * 0.001)

    def http_answered(self, handler: object, status: int, error_code: str | None) -> None:
        """Count one request answered by a Tornado handler (API, dashboard, chat, health)."""
        kind = type(handler)
        front = self._fronts.get(kind)
        if front is None:
            module = kind.__module__ + "."
            front = next((name for prefix, name in _FRONTS if module.startswith(prefix)), "other")
            self._fronts[kind] = front
        key = (front, status, error_code or "")
        self.http[key] = self.http.get(key, 0) + 1

    def counting(self, render: ErrorRenderer) -> ErrorRenderer:
        """`render` (the connection layer's error answers), counting each answer as front
        ``connection``: malformed requests, heads too large, connections over a cap."""
        from service.http.errors import STATUS_CODES

        def counted(status: int) -> tuple[list[tuple[str, str]], bytes]:
            key = ("connection", status, STATUS_CODES.get(status, "bad_request"))
            self.http[key] = self.http.get(key, 0) + 1
            return render(status)

        return counted


@dataclass
class Family:
    """One metric family as reported: `kind` is "counter", "gauge" or "histogram".

    Counter names end in ``_total``. Counters and gauges keep their values in
    `samples`; a histogram's `buckets` maps label values to (bucket counts,
    not cumulative, one per `BUCKETS` bound plus +Inf; sum of the observations).
    """

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    samples: dict[tuple[str, ...], float] = field(default_factory=dict)
    buckets: dict[tuple[str, ...], tuple[list[int], float]] = field(default_factory=dict)


#: Pool counters reported as counters: (key in `Pool.counters`, metric name, help).
_POOL_COUNTERS = (
    ("invocations", "logic_sandbox_invocations_total", "Scripts handed to a sandbox worker."),
    ("timeouts", "logic_sandbox_timeouts_total", "Scripts stopped at their time limit."),
    ("memory_kills", "logic_sandbox_memory_kills_total",
     "Scripts stopped at their memory limit."),
    ("crashes", "logic_sandbox_crashes_total", "Sandbox workers that died or broke the protocol."),
    ("restarts", "logic_sandbox_restarts_total", "Sandbox workers started to replace another."),
    ("busy_rejections", "logic_sandbox_busy_rejections_total",
     "Requests refused because the sandbox queue was full."),
    ("queued", "logic_sandbox_queued_total", "Requests that waited in the queue for a run slot."),
    ("deprioritised", "logic_sandbox_deprioritised_total",
     "Requests queued while their guild was over its worker-time budget."),
    ("quarantined", "logic_sandbox_quarantined_total",
     "Script versions quarantined after repeated worker crashes."),
    ("retired", "logic_sandbox_retired_total", "Idle guild-bound workers retired."),
)


def families(context: AppContext) -> list[Family]:
    """Every family a scrape reports, read from `context` now (on the loop)."""
    out = request_families(context.metrics)
    out += _pool_families(context)
    out += _record_families(context)
    out.append(_dependency_family(context))
    return out


def request_families(m: Metrics) -> list[Family]:
    """The families of the per-request counters in `m`."""
    guild = ("guild",) if m.per_guild else ()
    requests = Family("logic_invoke_requests_total", "counter",
                      "Invoke requests answered, by status, error code (empty for a script's "
                      "own reply) and plan (empty when no endpoint was found).",
                      ("status", "code", "plan", *guild))
    by_plan = Family("logic_invoke_plan_requests_total", "counter",
                     "Invoke requests answered per plan (endpoint found).", ("plan",))
    limited = Family("logic_invoke_rate_limited_total", "counter",
                     "Invoke requests refused 429 rate_limited (the plan's limit), per plan.",
                     ("plan",))
    throttled = Family("logic_invoke_auth_throttled_total", "counter",
                       "Invoke requests refused 429 auth_throttled (too many wrong secrets "
                       "from the address).")
    busy = Family("logic_invoke_busy_total", "counter",
                  "Invoke requests answered 503 busy (no sandbox run slot in time, the "
                  "queue full, too many secrets waiting, shutting down, or a dependency "
                  "unreachable: logic_dependency_down), per plan.",
                  ("plan",))
    throttled.samples[()] = 0
    for (status, code, plan, g), n in m.invoke.items():
        requests.samples[(str(status), code, plan, *((g,) if guild else ()))] = n
        if plan:
            by_plan.samples[(plan,)] = by_plan.samples.get((plan,), 0) + n
        if code == "rate_limited":
            limited.samples[(plan,)] = limited.samples.get((plan,), 0) + n
        elif code == "auth_throttled":
            throttled.samples[()] += n
        elif code == "busy":
            busy.samples[(plan,)] = busy.samples.get((plan,), 0) + n
    out = [requests, by_plan, limited, throttled, busy]
    for name, hist, what in (("logic_invoke_duration_seconds", m.service,
                              "Invoke requests from the arrival of their head to the answer, "
                              "per plan (queueing for a worker included)."),
                             ("logic_script_duration_seconds", m.script,
                              "Scripts' own run time in the sandbox worker, per plan.")):
        family = Family(name, "histogram", what, ("plan",))
        for plan, series in hist.series.items():
            family.buckets[(plan,)] = ([int(n) for n in series[:-1]], series[-1])
        out.append(family)
    http = Family("logic_http_requests_total", "counter",
                  "Requests answered outside the invoke path, by front (api, dashboard, chat, "
                  "health, metrics, other; connection: refused by the HTTP layer before any "
                  "route), status and error code.", ("front", "status", "code"))
    for (front, status, code), n in m.http.items():
        http.samples[(front, str(status), code)] = n
    out.append(http)
    return out


def _gauge(name: str, help_text: str, value: float) -> Family:
    return Family(name, "gauge", help_text, samples={(): value})


def _counter(name: str, help_text: str, value: float) -> Family:
    return Family(name, "counter", help_text, samples={(): value})


def _pool_families(context: AppContext) -> Iterable[Family]:
    pool = context.pool
    counters = pool.counters
    busy = pool.scheduler.running
    workers = counters["workers"]
    yield _gauge("logic_sandbox_run_slots", "Scripts that may run at once (sandbox.workers).",
                 pool.size)
    yield _gauge("logic_sandbox_workers", "Sandbox worker processes (spares and guild-bound).",
                 workers)
    yield _gauge("logic_sandbox_workers_busy", "Run slots in use (scripts running now).", busy)
    yield _gauge("logic_sandbox_workers_idle", "Worker processes not running a script.",
                 max(0, workers - busy))
    yield _gauge("logic_sandbox_queue_depth", "Requests waiting for a run slot.",
                 counters["queue_depth"])
    yield _gauge("logic_sandbox_guilds", "Guilds with a worker bound to them.", counters["guilds"])
    for key, name, help_text in _POOL_COUNTERS:
        yield _counter(name, help_text, counters[key])


def _record_families(context: AppContext) -> Iterable[Family]:
    records = context.records
    yield _gauge("logic_records_pending", "Answered requests waiting to be written as records.",
                 records.pending)
    yield _counter("logic_records_written_total", "Answered requests written as records.",
                   records.written)
    yield _counter("logic_records_dropped_total",
                   "Answered requests whose records were lost (queue full, or an entry that "
                   "could not be written even alone).", records.dropped)
    yield _counter("logic_records_failed_batches_total",
                   "Record batches that failed three times (their entries then written one "
                   "by one).", records.failed_batches)


def _dependency_family(context: AppContext) -> Family:
    """1 while this process finds a dependency unreachable (its own last attempt: no probe here)."""
    family = Family("logic_dependency_down", "gauge",
                    "1 while the dependency is unreachable from this front process "
                    "(database: the record writer or the endpoint lookups failed to reach it; "
                    "change_feed: the PostgreSQL LISTEN connection; ratelimit: Redis).",
                    ("dependency",))
    samples = family.samples
    samples[("database",)] = int(context.records.database_down
                                 or context.load_target.database_down)
    if context.change_feed is not None:
        samples[("change_feed",)] = int(not context.change_feed.healthy)
    samples[("ratelimit",)] = int(context.limits.storage_state()["state"] == "down")
    return family


# --- multiprocess mode (several front processes) ---------------------------------------------

def prepare_multiprocess_dir(path: str) -> str:
    """Make `path` the metrics directory of this run and return it (the arbiter, before forking).

    Creates the directory, removes every file an earlier run left in it (their
    counters would otherwise be added to this run's), and sets
    `PROMETHEUS_MULTIPROC_DIR` so every front started afterwards writes its
    values there and a scrape of any front reports the sum over all of them.
    Raises `OSError` when the directory cannot be made or emptied.
    """
    path = os.path.abspath(path)
    os.makedirs(path, mode=0o700, exist_ok=True)
    for stale in glob.glob(os.path.join(path, "*.db")) + glob.glob(os.path.join(path, "*.db.new")):
        os.remove(stale)
    os.environ[MULTIPROC_ENV] = path
    return path


def mark_front_dead(pid: int, path: str | None = None) -> None:
    """Forget the gauges of front `pid`, which has exited (the arbiter, when it reaps one).

    Its counters and histograms stay: they are totals, and a total must not
    go down. `path` defaults to `PROMETHEUS_MULTIPROC_DIR`; no-op without one.
    """
    from prometheus_client.multiprocess import mark_process_dead

    path = path or os.environ.get(MULTIPROC_ENV)
    if path:
        mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
