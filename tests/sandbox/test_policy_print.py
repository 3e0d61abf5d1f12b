"""print(): captured per invocation, capped at 16 KB, never reaching real stdout."""
from __future__ import annotations

import pytest

from sandbox.guards import PrintCollector
from tests.sandbox.script_helpers import error_message, run, run_block


def test_print_is_captured_from_module_level_functions_and_block(
        capsys: pytest.CaptureFixture[str]) -> None:
    out = run("""\
        print("loading")
        def helper():
            print("in helper", 1, 2.5, None, sep="|")
        on endpoint(event):
            helper()
            print("a", "b", end="")
            print("!")
        """)
    assert out["output"] == "loading\nin helper|1|2.5|None\na b!\n"
    assert capsys.readouterr() == ("", "")


def test_output_is_capped_with_a_marker() -> None:
    out = run_block('for i in range(1000):\n    print("x" * 99)', output_cap=1000)
    assert out["output"] == "x" * 99 + "\n" + ("x" * 99 + "\n") * 9 \
        + PrintCollector.TRUNCATED_MARKER
    assert len(out["output"].encode()) == 1000 + len(PrintCollector.TRUNCATED_MARKER)


def test_default_cap_is_16_kb() -> None:
    out = run_block('print("é" * 20000)')
    text = out["output"]
    assert text.endswith(PrintCollector.TRUNCATED_MARKER)
    assert len(text[:-len(PrintCollector.TRUNCATED_MARKER)].encode("utf-8")) == 16384


def test_cap_never_splits_a_character() -> None:
    out = run_block('print("aé" * 10)', output_cap=2)
    assert out["output"] == "a" + PrintCollector.TRUNCATED_MARKER


def test_output_is_valid_utf8_even_with_lone_surrogates() -> None:
    out = run_block('print("a\\ud800b")')
    assert out["output"] == "a\\ud800b\n"
    out["output"].encode("utf-8")


@pytest.mark.parametrize(("call", "message"), [
    ('print("x", file=None if False else 1)', "TypeError: print(file=...) is not supported"),
    ('print("x", sep=1)', "TypeError: sep must be None or a string"),
    ('print("x", end=[])', "TypeError: end must be None or a string"),
])
def test_print_argument_checks(call: str, message: str) -> None:
    assert error_message(run_block(call)) == message


def test_output_survives_an_error() -> None:
    out = run_block('print("before")\nraise ValueError("boom")')
    assert out["output"] == "before\n"
    assert out["error"]["message"] == "ValueError: boom"


def test_output_is_not_shared_between_invocations() -> None:
    first = run_block('print("one")')
    second = run_block('print("two")')
    assert (first["output"], second["output"]) == ("one\n", "two\n")
