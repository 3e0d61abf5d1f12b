"""Metrics across front processes: prometheus-client's multiprocess files in one directory.

Two real processes write into one directory and a scrape reports their sum;
the arbiter's two calls (`prepare_multiprocess_dir`, `mark_front_dead`) are
tested as it will make them: before the fronts start, and after one has
exited. The end-to-end test runs two real `logic serve` processes as the two
fronts of one run (each on its own port, which a scrape does not depend on).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from service.http.metrics import (
    MULTIPROC_ENV,
    Family,
    Metrics,
    mark_front_dead,
    prepare_multiprocess_dir,
    request_families,
)
from service.http.metrics_export import MultiprocessFiles
from tests.service.http.conftest import Env
from tests.service.http.harness import Server, wait_until
from tests.service.http.test_checks import ECHO
from tests.service.http.test_metrics import RAISE, Samples, _start, parse, scrape, value


def _request(status: int, code: str | None, plan: str, seconds: float,
             script_ms: float | None) -> SimpleNamespace:
    target = SimpleNamespace(plan=SimpleNamespace(name=plan), guild_id="123")
    outcome = None if script_ms is None else SimpleNamespace(duration_ms=script_ms)
    return SimpleNamespace(status=status, error_code=code, target=target, started=100.0,
                           finished=100.0 + seconds, outcome=outcome)


def _front(path: str, ok: int, errors: int, slots: int) -> None:
    """One front: counts requests, writes its files as a front does, and exits."""
    metrics = Metrics()
    for _ in range(ok):
        metrics.invoke_answered(_request(200, None, "pro", 0.003, 1.0))  # type: ignore[arg-type]
    for _ in range(errors):
        metrics.invoke_answered(_request(500, "script_error", "pro", 0.2, 150.0))  # type: ignore[arg-type]
    found = request_families(metrics)
    found.append(Family("logic_sandbox_run_slots", "gauge", "Run slots.", samples={(): slots}))
    files = MultiprocessFiles(path)
    files.write(found)
    files.close()


def _run_front(path: str, ok: int, errors: int, slots: int) -> int:
    proc = multiprocessing.get_context("spawn").Process(target=_front,
                                                        args=(path, ok, errors, slots))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert proc.pid is not None
    return proc.pid


def test_a_scrape_at_the_moment_a_file_is_made_reads_every_file(
        run_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another front scrapes (globs *.db and reads every file) at any moment,
    # also the moment a front creates its file, before prometheus-client has
    # sized it and written its header: such a scrape failed with 500.
    path = prepare_multiprocess_dir(run_dir)
    scrapes: list[object] = []
    real_open = open

    def open_then_scrape(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        f = real_open(file, mode, *args, **kwargs)  # type: ignore[call-overload]
        if str(file).startswith(path) and "a" in mode:   # a values file made, still empty
            try:
                scrapes.append(list(MultiprocessFiles(path).collect()))
            except Exception as exc:  # noqa: BLE001 - what a scrape would have answered 500 for
                scrapes.append(exc)
        return f

    files = MultiprocessFiles(path)
    metrics = Metrics()
    metrics.invoke_answered(_request(200, None, "pro", 0.003, 1.0))  # type: ignore[arg-type]
    monkeypatch.setattr("builtins.open", open_then_scrape)
    files.write(request_families(metrics))
    monkeypatch.undo()
    files.close()
    assert len(scrapes) >= 2                                 # counters and histograms
    assert not [s for s in scrapes if isinstance(s, Exception)], scrapes
    assert {m.name for m in MultiprocessFiles(path).collect()} >= {"logic_invoke_requests"}


@pytest.fixture()
def run_dir(tmp_path: Path) -> Iterator[str]:
    """A directory for one run; the variable `prepare_multiprocess_dir` sets is removed after."""
    saved = os.environ.pop(MULTIPROC_ENV, None)
    yield str(tmp_path / "metrics")
    os.environ.pop(MULTIPROC_ENV, None)
    if saved is not None:
        os.environ[MULTIPROC_ENV] = saved


def _collect(path: str) -> Samples:
    from prometheus_client import exposition

    class Registry:
        def collect(self):  # type: ignore[no-untyped-def]
            return MultiprocessFiles(path).collect()

    return parse(exposition.generate_latest(Registry()).decode())  # type: ignore[arg-type]


def test_two_processes_are_summed(run_dir: str) -> None:
    # A run before this one left its files: they must not be added to this run's.
    os.makedirs(run_dir)
    Path(run_dir, "counter_1.db").write_bytes(b"stale")
    path = prepare_multiprocess_dir(run_dir)
    assert os.environ[MULTIPROC_ENV] == path and os.listdir(path) == []

    first = _run_front(path, ok=3, errors=1, slots=2)
    second = _run_front(path, ok=4, errors=0, slots=3)
    samples = _collect(path)
    requests = "logic_invoke_requests_total"
    assert value(samples, requests, status="200", code="", plan="pro") == 7
    assert value(samples, requests, status="500", code="script_error", plan="pro") == 1
    assert value(samples, "logic_invoke_plan_requests_total", plan="pro") == 8
    assert value(samples, "logic_sandbox_run_slots") == 5
    # Histograms: buckets summed and cumulative, the count derived from them.
    hist = "logic_invoke_duration_seconds"
    assert value(samples, hist + "_count", plan="pro") == 8
    assert value(samples, hist + "_bucket", plan="pro", le="0.0025") == 0
    assert value(samples, hist + "_bucket", plan="pro", le="0.005") == 7
    assert value(samples, hist + "_bucket", plan="pro", le="0.1") == 7
    assert value(samples, hist + "_bucket", plan="pro", le="0.25") == 8
    assert value(samples, hist + "_bucket", plan="pro", le="+Inf") == 8
    assert value(samples, hist + "_sum", plan="pro") == pytest.approx(7 * 0.003 + 0.2)
    assert value(samples, "logic_script_duration_seconds_bucket", plan="pro", le="0.001") == 7
    assert value(samples, "logic_script_duration_seconds_count", plan="pro") == 8

    # A front that exited: its gauges go, its totals stay (a total never goes down).
    mark_front_dead(second)
    samples = _collect(path)
    assert value(samples, "logic_sandbox_run_slots") == 2
    assert value(samples, requests, status="200", code="", plan="pro") == 7
    mark_front_dead(first, path)
    assert ("logic_sandbox_run_slots", frozenset()) not in _collect(path)


def test_a_front_rewrites_only_changed_values_and_keeps_its_own_file(run_dir: str) -> None:
    path = prepare_multiprocess_dir(run_dir)
    metrics = Metrics()
    files = MultiprocessFiles(path)
    metrics.invoke_answered(_request(200, None, "plus", 0.01, 2.0))  # type: ignore[arg-type]
    files.write(request_families(metrics))
    metrics.invoke_answered(_request(200, None, "plus", 0.01, 2.0))  # type: ignore[arg-type]
    files.write(request_families(metrics))
    files.close()
    assert sorted(os.listdir(path)) == [f"counter_{os.getpid()}.db",
                                        f"histogram_{os.getpid()}.db"]
    samples = _collect(path)
    assert value(samples, "logic_invoke_requests_total", status="200", code="",
                 plan="plus") == 2
    assert value(samples, "logic_invoke_duration_seconds_count", plan="plus") == 2


def test_a_reused_pid_keeps_the_exited_process_totals(run_dir: str) -> None:
    path = prepare_multiprocess_dir(run_dir)
    exited = Metrics()
    for _ in range(2):
        exited.invoke_answered(_request(200, None, "pro", 0.01, 1.0))  # type: ignore[arg-type]
    gauge = Family("logic_sandbox_run_slots", "gauge", "Run slots.", samples={(): 2})
    files = MultiprocessFiles(path)
    files.write([*request_families(exited), gauge])
    files.close()
    # A new front that got the same pid (here: the same process) starts from zero.
    fresh = Metrics()
    fresh.invoke_answered(_request(200, None, "pro", 0.01, 1.0))  # type: ignore[arg-type]
    files = MultiprocessFiles(path)
    files.write(request_families(fresh))
    files.close()
    samples = _collect(path)
    assert value(samples, "logic_invoke_requests_total", status="200", code="",
                 plan="pro") == 3
    assert value(samples, "logic_invoke_duration_seconds_count", plan="pro") == 3
    assert ("logic_sandbox_run_slots", frozenset()) not in samples


def test_two_serve_processes_report_their_sum(http_env: Env, tmp_path: Path, run_dir: str,
                                               make_endpoint) -> None:
    path = prepare_multiprocess_dir(run_dir)
    env = {MULTIPROC_ENV: path}
    fronts: list[Server] = []
    try:
        for n in range(2):
            root = tmp_path / f"front{n}"
            root.mkdir()
            fronts.append(_start(http_env, root, "", env=env))
        a, b = fronts
        ok = make_endpoint(source=ECHO)
        failing = make_endpoint(source=RAISE)
        for _ in range(2):
            assert a.request(ok.path, json_body={}, secret=ok.secret).status == 200
        for _ in range(3):
            assert b.request(ok.path, json_body={}, secret=ok.secret).status == 200
        assert b.request(failing.path, json_body={}, secret=failing.secret).status == 500

        def counted(samples: Samples) -> tuple[float, float]:
            return (value(samples, "logic_invoke_requests_total", status="200", code="",
                          plan="pro"),
                    value(samples, "logic_invoke_requests_total", status="500",
                          code="script_error", plan="pro"))

        # `a` answers for both; b's values reach the files within its flush interval.
        assert wait_until(lambda: counted(scrape(a)) == (5, 1), timeout=20), counted(scrape(a))
        samples = scrape(a)
        assert value(samples, "logic_sandbox_run_slots") == 4  # 2 workers in each front
        assert value(samples, "logic_sandbox_invocations_total") == 6
        assert value(samples, "logic_invoke_duration_seconds_count", plan="pro") == 6
        assert counted(scrape(b)) == (5, 1)

        # b stops; the arbiter marks it dead: its gauges go, its totals stay.
        assert b.proc is not None
        pid = b.proc.pid
        b.stop()
        mark_front_dead(pid, path)
        samples = scrape(a)
        assert value(samples, "logic_sandbox_run_slots") == 2
        assert counted(samples) == (5, 1)
    finally:
        for srv in fronts:
            try:
                srv.stop()
            except Exception:  # noqa: BLE001 - stopped already
                srv.kill()
