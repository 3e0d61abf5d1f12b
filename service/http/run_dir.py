"""The per-run directory of `logic serve` with several front processes.

Made by the `logic` process before it imports the service (`service.cli.serve`)
and removed by the arbiter when it exits. It holds `metrics/`, exported as
PROMETHEUS_MULTIPROC_DIR (unless the operator set it) so that prometheus-client,
which reads the variable when it is imported, runs in multiprocess mode in
every front.
"""

from __future__ import annotations

import os
import tempfile

#: prometheus-client's multiprocess directory variable.
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"


def make_run_dir() -> str:
    """Create the run directory and export its `metrics/`; returns its path."""
    path = tempfile.mkdtemp(prefix="logic-run-")
    metrics = os.path.join(path, "metrics")
    os.mkdir(metrics, 0o700)
    os.environ.setdefault(METRICS_ENV, metrics)
    return path
