"""Every Python example in docs/script-language.md compiles and runs cleanly."""
from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

import pytest

from sandbox.compiler import compile_script
from sandbox.runtime import run_endpoint
from tests.sandbox.script_helpers import make_event

DOC = Path(__file__).resolve().parents[2] / "docs" / "script-language.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_the_doc_has_examples() -> None:
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("source", EXAMPLES)
def test_example_compiles_and_runs(source: str) -> None:
    result = compile_script(source)
    assert result.ok, result.errors
    assert result.script is not None
    raw = b'{"scores": [3, 5, 5, 9], "score": 21}'
    signature = hmac.new(b"shared-with-the-game-server", raw, hashlib.sha256).hexdigest()
    event = make_event(body={"scores": [3, 5, 5, 9], "score": 21}, rawBody=raw.decode(),
                       headers={"x-signature": signature}, query={"top": "1"})
    out = run_endpoint(result.script, event)
    assert out["error"] is None, out["error"]
    assert out["replied"] is True
    assert out["status"] == 200
