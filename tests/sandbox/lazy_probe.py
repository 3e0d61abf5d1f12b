"""Run in a fresh interpreter: warm as the fork server does, forbid imports, run the corpus.

Prints one JSON object: the module names something tried to import after
warming, and the snippets that failed (tests only; see test_lazy_imports.py).
"""
from __future__ import annotations

import json
import sys
from typing import Any


class _Blocker:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        self.seen.append(fullname)
        raise ImportError(f"late import of {fullname}")


def main() -> None:
    from sandbox.warm import warm
    warm()
    from sandbox.compiler import compile_script
    from sandbox.modules import ALLOWED_MODULES
    from sandbox.runtime import run_endpoint
    from tests.sandbox import lazy_corpus

    blocker = _Blocker()
    sys.meta_path.insert(0, blocker)
    header = "".join(f"import {m}\n" for m in sorted(ALLOWED_MODULES))
    failed: dict[str, str] = {}
    for snippet in (*lazy_corpus.SNIPPETS, lazy_corpus.codec_snippet()):
        body = "\n".join("    " + line for line in (snippet + "\nevent.reply(1)").split("\n"))
        result = compile_script(header + "on endpoint(event):\n" + body + "\n")
        if not result.ok or result.script is None:
            failed[snippet[:80]] = f"compile: {result.errors}"
            continue
        event = {"body": None, "rawBody": "", "headers": {}, "query": {}, "method": "POST",
                 "ip": "127.0.0.1", "userAgent": "t", "timestamp": "2026-01-01T00:00:00.000Z"}
        out = run_endpoint(result.script, event)
        if out["error"] is not None:
            failed[snippet[:80]] = out["error"]["message"]
    print(json.dumps({"imports": sorted(set(blocker.seen)), "failed": failed}))


if __name__ == "__main__":
    main()
