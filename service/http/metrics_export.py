"""Writing `service.http.metrics` families out: the Prometheus text format, and multiprocess files.

One process: a scrape formats the families read at that moment
(`prometheus_client.generate_latest` over a collector of them), so every
value is current.

Several front processes (`PROMETHEUS_MULTIPROC_DIR` set by their
supervisor's `prepare_multiprocess_dir`): each front writes its
values into its own files of prometheus-client's multiprocess format in that
directory (`counter_<pid>.db`, `gauge_livesum_<pid>.db`, `histogram_<pid>.db`),
every `FLUSH_S` seconds from a timer on its loop and once more when it stops;
a scrape writes the answering front's files first and then reports
`MultiProcessCollector`'s merge of all of them: counters and histograms
summed over every front of the run (a dead front's totals included),
gauges summed over the fronts alive (`livesum`; the arbiter's
`mark_front_dead` removes a dead front's). The other fronts' values are
therefore up to `FLUSH_S` old, and a front killed with SIGKILL loses at most
its last `FLUSH_S` of counts from the totals.

Only the loop writes a front's files, so the files need no lock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import exposition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

from service.http.metrics import BUCKETS, MULTIPROC_ENV, Family, families

if TYPE_CHECKING:
    from service.http.context import AppContext

log = logging.getLogger("logic.metrics")

#: How often a front writes its values to the multiprocess files (seconds).
FLUSH_S = 1.0
#: The Prometheus text format (0.0.4): what every Prometheus server reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LE = tuple(floatToGoString(b) for b in BUCKETS) + ("+Inf",)  # type: ignore[no-untyped-call]
#: File name prefix per kind (the collector reads the kind, and a gauge's mode, from it).
_FILE_PREFIX = {"counter": "counter", "gauge": "gauge_livesum", "histogram": "histogram"}


def prometheus_families(found: Iterable[Family]) -> Iterator[Any]:
    """prometheus-client metric families for `found` (cumulative histogram buckets)."""
    for f in found:
        if f.kind == "counter":
            counter = CounterMetricFamily(f.name, f.help, labels=f.labels)
            for values, value in f.samples.items():
                counter.add_metric(values, value)
            yield counter
        elif f.kind == "gauge":
            gauge = GaugeMetricFamily(f.name, f.help, labels=f.labels)
            for values, value in f.samples.items():
                gauge.add_metric(values, value)
            yield gauge
        else:
            histogram = HistogramMetricFamily(f.name, f.help, labels=f.labels)
            for values, (counts, total) in f.buckets.items():
                running, cumulative = 0, []
                for le, n in zip(_LE, counts):
                    running += n
                    cumulative.append((le, float(running)))
                histogram.add_metric(values, cumulative, total)
            yield histogram


def file_samples(f: Family) -> Iterator[tuple[str, float]]:
    """(mmap key, value) of every sample of `f` as prometheus-client's multiprocess files hold it.

    Counters are keyed by their name without ``_total`` (as `Counter` writes
    them); histogram buckets are not cumulative (the collector adds them up)
    and the count is left to the collector, which derives it from the buckets.
    """
    if f.kind == "histogram":
        names = [*f.labels, "le"]
        for values, (counts, total) in f.buckets.items():
            for le, n in zip(_LE, counts):
                yield mmap_key(f.name, f.name + "_bucket", names, [*values, le], f.help), n
            yield mmap_key(f.name, f.name + "_sum", list(f.labels), list(values), f.help), total
        return
    metric = f.name[:-len("_total")] if f.kind == "counter" else f.name
    for values, value in f.samples.items():
        yield mmap_key(metric, f.name, list(f.labels), list(values), f.help), value


def _new_file(name: str) -> MmapedDict:
    """A new values file at `name`, in place only once it is initialised.

    prometheus-client creates the file empty, then sizes it and writes its
    header; another front's scrape that globs ``*.db`` in between read an
    empty file and failed (500 on /metrics). So it is made under another name
    and renamed (atomic; the open mapping does not depend on the name)."""
    making = name + ".new"           # not matched by the collector's *.db
    try:
        os.remove(making)            # left by a front of this pid that died making it
    except FileNotFoundError:
        pass
    made = MmapedDict(making)  # type: ignore[no-untyped-call]
    os.rename(making, name)
    return made


class MultiprocessFiles:
    """This process's files in the multiprocess directory `path`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pid = 0
        self._files: dict[str, MmapedDict] = {}
        self._written: dict[str, float] = {}

    def write(self, found: Iterable[Family]) -> None:
        """Write the current value of every sample (only those that changed)."""
        pid = os.getpid()
        if pid != self._pid:  # first write, or a fork: this process's own files
            self.close()
            self._pid = pid
            self._set_aside(pid)
        written = self._written
        for f in found:
            prefix = _FILE_PREFIX[f.kind]
            target = self._files.get(prefix)
            for key, value in file_samples(f):
                if written.get(key) == value:
                    continue
                if target is None:
                    target = self._files[prefix] = _new_file(
                        os.path.join(self.path, f"{prefix}_{pid}.db"))
                target.write_value(key, float(value), 0.0)  # type: ignore[no-untyped-call]
                written[key] = value

    def _set_aside(self, pid: int) -> None:
        """Keep what an exited process with this pid left (a pid reused within the run).

        Its totals move to a file of their own (still summed: a total never
        goes down); its gauges are dropped (that process is not alive).
        """
        for prefix in _FILE_PREFIX.values():
            name = os.path.join(self.path, f"{prefix}_{pid}.db")
            if not os.path.exists(name):
                continue
            if prefix.startswith("gauge"):
                os.remove(name)
            else:
                os.rename(name, os.path.join(self.path, f"{prefix}_{pid}-{time.time_ns()}.db"))

    def collect(self) -> Iterable[Any]:
        """Every front's values, merged (counters summed, live gauges summed)."""
        collector = MultiProcessCollector(None, path=self.path)  # type: ignore[no-untyped-call]
        found: Iterable[Any] = collector.collect()  # type: ignore[no-untyped-call]
        return found

    def close(self) -> None:
        for f in self._files.values():
            f.close()  # type: ignore[no-untyped-call]
        self._files.clear()
        self._written.clear()


class _Families:
    """A 'registry' for `generate_latest`: anything with `collect()`."""

    def __init__(self, items: Iterable[Any]) -> None:
        self._items = items

    def collect(self) -> Iterable[Any]:
        return self._items


class Exporter:
    """Formats a scrape; in multiprocess mode also flushes this front's values periodically."""

    def __init__(self, context: AppContext, multiprocess_dir: str | None = None) -> None:
        self.context = context
        self.files = MultiprocessFiles(multiprocess_dir) if multiprocess_dir else None
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def from_environment(cls, context: AppContext) -> Exporter:
        """Multiprocess mode when `PROMETHEUS_MULTIPROC_DIR` names a directory."""
        path = os.environ.get(MULTIPROC_ENV) or None
        if path is not None and not os.path.isdir(path):
            log.warning("%s=%s is not a directory: metrics cover this process only",
                        MULTIPROC_ENV, path)
            path = None
        return cls(context, path)

    def render(self) -> bytes:
        """The Prometheus text format of every metric now (all fronts in multiprocess mode)."""
        found = families(self.context)
        if self.files is None:
            return exposition.generate_latest(_Families(list(prometheus_families(found))))
        self.files.write(found)
        return exposition.generate_latest(_Families(self.files.collect()))

    def start(self) -> None:
        """Multiprocess mode: write this front's values now and every `FLUSH_S` (on the loop)."""
        if self.files is not None:
            self._flush()

    def stop(self) -> None:
        """Write the final values and close the files."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.files is not None:
            self.flush()
            self.files.close()

    def flush(self) -> None:
        if self.files is not None:
            try:
                self.files.write(families(self.context))
            except Exception:  # noqa: BLE001 - metrics must never take the front down
                log.warning("writing the metrics files failed", exc_info=True)

    def _flush(self) -> None:
        self.flush()
        self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)
