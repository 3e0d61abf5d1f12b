"""The curated builtins: what exists, what does not, and the one-argument type()."""
from __future__ import annotations

import pytest

from sandbox.guards import BASE_BUILTINS
from tests.sandbox.script_helpers import error_kind, error_message, run_block

ABSENT = ["getattr", "setattr", "delattr", "hasattr", "vars", "dir", "globals", "locals",
          "compile", "open", "input", "help", "memoryview", "id", "exit",
          "quit", "aiter", "anext", "ExceptionGroup", "BaseExceptionGroup", "copyright",
          "credits", "license", "SystemExit", "KeyboardInterrupt", "GeneratorExit",
          "OSError", "IOError", "EnvironmentError", "classmethod_", "reload", "execfile"]


@pytest.mark.parametrize("name", ABSENT)
def test_absent_builtins(name: str) -> None:
    out = run_block(f"x = {name}")
    assert error_kind(out) == "script_error"
    assert error_message(out) == f"NameError: name '{name}' is not defined"


def test_breakpoint_is_a_reserved_name() -> None:
    from tests.sandbox.script_helpers import errors
    assert errors("breakpoint()\n") == [(1, 1, '"breakpoint" is a reserved name.')]


def test_no_private_builtins_besides_build_class() -> None:
    assert [n for n in BASE_BUILTINS if n.startswith("_")] == ["__build_class__"]
    assert "__import__" not in BASE_BUILTINS  # added per invocation by the runtime


def test_common_builtins_work() -> None:
    out = run_block("""\
        data = [3, 1, 2]
        event.reply([
            sorted(data), list(reversed(data)), list(zip("ab", data)), list(enumerate("xy")),
            sum(data), min(data), max(data), any(data), all(data), len("abc"),
            list(map(str, data)), list(filter(None, [0, 1])), abs(-2), round(2.567, 1),
            divmod(7, 2), pow(2, 10, 1000), tuple(data) == (3, 1, 2), chr(65), ord("A"),
            hex(255), bin(5), oct(8), repr("q"), ascii("é"), bool(0), int("7"),
            float("1.5"), str(b"x", "ascii"), bytes([104]).decode(), list(range(2)),
            sorted({"b": 1, "a": 2}), frozenset([1]) == {1}, format(3.14159, ".2f"),
            callable(len), isinstance(1, int), issubclass(bool, int), hash(1), next(iter([9])),
            list(bytearray(b"a")), slice(1, 2).stop, complex(1, 2).imag,
        ])
        """)
    assert out["error"] is None, out["error"]
    assert out["body"] == (
        b'[[1,2,3],[2,1,3],[["a",3],["b",1]],[[0,"x"],[1,"y"]],6,1,3,true,true,3,'
        b'["3","1","2"],[1],2,2.6,[3,1],24,true,"A",65,"0xff","0b101","0o10","\'q\'",'
        b'"\'\\\\xe9\'",false,7,1.5,"x","h",[0,1],["a","b"],true,"3.14",true,true,true,1,9,'
        b'[97],2,2.0]')


def test_one_argument_type() -> None:
    out = run_block("event.reply([type(1) is int, type('') is str, type({}) is dict])")
    assert out["body"] == b"[true,true,true]"


@pytest.mark.parametrize(("expr", "message"), [
    ("type('X', (), {})", "TypeError: type() takes exactly one argument here"),
    ("type()", "TypeError: type() takes exactly one argument here"),
    ("type(int)", "TypeError: type() of a class is not available"),
    ("type(type(1))", "TypeError: type() of a class is not available"),
    ("type(Exception)", "TypeError: type() of a class is not available"),
])
def test_type_refusals(expr: str, message: str) -> None:
    assert error_message(run_block(f"x = {expr}")) == message


def test_type_of_script_class_is_refused() -> None:
    out = run_block("class A:\n    pass\nx = type(A)")
    assert error_message(out) == "TypeError: type() of a class is not available"


def test_exceptions_can_be_raised_and_caught() -> None:
    out = run_block("""\
        class MyError(ValueError):
            pass
        try:
            raise MyError("bad")
        except ValueError as exc:
            event.reply(["caught", exc.args[0], isinstance(exc, Exception)])
        """)
    assert out["body"] == b'["caught","bad",true]'
