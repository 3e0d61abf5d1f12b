"""What the fork server imports and runs once, before it forks any worker.

``sandbox.zygote`` calls :func:`warm` in its fresh interpreter, then freezes
the heap, so what it loads here is shared by every worker it forks.
"""
from __future__ import annotations

import importlib
from typing import Any

from sandbox import job_runner

WARM_MODULES = (
    "json", "math", "re", "random", "datetime", "time", "hashlib", "hmac", "base64",
    "string", "itertools", "functools", "collections", "statistics", "decimal", "uuid",
    "traceback", "linecache", "unicodedata", "encodings.latin_1", "encodings.ascii",
    "encodings.utf_16", "encodings.utf_32", "encodings.cp1252", "encodings.idna",
    "encodings.utf_8_sig", "encodings.unicode_escape", "encodings.raw_unicode_escape",
    "encodings.punycode", "_strptime", "calendar", "locale", "heapq", "bisect", "fractions",
    "numbers", "operator", "reprlib", "keyword", "_sha1", "_sha256", "_sha512", "_md5",
    "_sha3", "_blake2", "zlib", "bz2", "binascii", "stringprep",
)
WARM_SOURCE = '''import json
on endpoint(event):
    event.status(201)
    event.header("X-Warm", "1")
    event.reply({"ok": json.dumps(event.body), "n": len(event.headers)})
'''
WARM_EVENT: dict[str, Any] = {
    "body": {"a": 1}, "rawBody": '{"a": 1}', "headers": {"content-type": "application/json"},
    "query": {}, "method": "POST", "ip": "127.0.0.1", "userAgent": "warm",
    "timestamp": "2026-01-01T00:00:00.000Z",
}

def warm() -> None:
    """Import everything a worker may need, before any privilege drop.

    A worker runs as an unprivileged user that may not be able to read the
    interpreter's files (Python under /root, redteam finding 9), so every
    module the allowed functions import lazily (``heapq`` for
    ``Counter.most_common``, every codec a script can name, ...) is imported
    here; tests/sandbox/test_lazy_imports.py runs every allowed function
    with imports forbidden after this. Then the library caches' state is
    taken as the one each invocation returns to (``sandbox.resets``).
    """
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import codecs
    import encodings
    import encodings.aliases
    import pkgutil
    names = {m.name for m in pkgutil.iter_modules(encodings.__path__)} - {"aliases"}
    for name in sorted(names | set(encodings.aliases.aliases)):
        try:
            codecs.lookup(name)
        except (LookupError, ImportError):
            pass  # Windows-only codecs (mbcs, oem)
    from sandbox.compiler import compile_script
    from sandbox.runtime import prepare_worker_process, run_endpoint
    result = compile_script(WARM_SOURCE)
    if result.ok and result.script is not None:
        run_endpoint(result.script, dict(WARM_EVENT), output_cap=job_runner.OUTPUT_CAP)
    prepare_worker_process()
