"""Finding 9: every module an allowed function imports lazily is imported before the
privilege drop, so workers run as an unprivileged user even when that user cannot
read the interpreter's files (Python under /root, as on this machine)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

from sandbox.modules import ALLOWED_MODULES
from sandbox.pool import Limits, Pool
from tests.sandbox import lazy_corpus
from tests.sandbox.poolkit import event, ref, run_with_pool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _importable(name: str) -> bool:
    try:
        if importlib.util.find_spec(name) is None:
            return False
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 - Windows-only codecs fail inside their module
        return False


def test_after_warming_no_allowed_function_imports_anything() -> None:
    # A fresh interpreter warms as the fork server does, then forbids every
    # import and runs the whole corpus through the real compiler and runtime.
    proc = subprocess.run([sys.executable, "-m", "tests.sandbox.lazy_probe"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failed"] == {}
    # Names that are no module at all (unknown codec names) may be tried; a
    # module that exists and imports must already have been imported.
    assert [name for name in report["imports"] if _importable(name)] == []


def _script(snippet: str) -> str:
    header = "".join(f"import {m}\n" for m in sorted(ALLOWED_MODULES))
    body = "\n".join("    " + line for line in (snippet + "\nevent.reply('ok')").split("\n"))
    return header + "on endpoint(event):\n" + body + "\n"


def test_every_allowed_function_works_in_a_real_worker() -> None:
    # Workers drop to nobody; here the interpreter lives under /root (mode
    # 0700), so before the fix statistics.mode failed with "No module named
    # 'heapq'" and most codecs were unknown.
    snippets = (*lazy_corpus.SNIPPETS, lazy_corpus.codec_snippet())

    async def scenario(pool: Pool) -> dict[str, Any]:
        failed: dict[str, Any] = {}
        for snippet in snippets:
            out = await pool.run(ref(_script(snippet)), event(),
                                 Limits(time_ms=5000, memory_kb=16384))
            if out.body != b'"ok"':
                failed[snippet[:60]] = (out.error_kind, out.error_message)
        return failed

    assert run_with_pool(scenario, size=1) == {}
