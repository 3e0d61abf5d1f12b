"""Save-time checks (`sandbox.checks`): one snippet per rule, exact positions and text."""
from __future__ import annotations

import pytest

from sandbox.checks import check_source
from sandbox.compiler import compile_script
from sandbox.modules import ALLOWED_MODULES
from tests.sandbox.test_docs_examples import EXAMPLES


def _errors(source: str) -> list[tuple[int, int, str]]:
    return [(f.line, f.column, f.message) for f in check_source(source).errors]


def _warnings(source: str) -> list[tuple[int, int, str]]:
    return [(f.line, f.column, f.message) for f in check_source(source).warnings]


@pytest.mark.parametrize("source", ["", "\n\n", "# only a comment\n   \n# another\n"])
def test_an_empty_script_is_an_error(source: str) -> None:
    assert _errors(source) == [(1, 1, 'script is empty: add an "on endpoint(event):" block')]


def test_imports_outside_the_allowed_list_are_errors_with_their_position() -> None:
    source = ("import json\nimport os, math\nfrom subprocess import run\nimport collections.abc\n"
              "on endpoint(e):\n    import socket\n    from . import x\n")
    found = _errors(source)
    assert [(line, col) for line, col, _ in found] == [(2, 1), (3, 1), (4, 1), (6, 5), (7, 5)]
    assert found[0][2].startswith("import of 'os' is not allowed (allowed: base64, collections,")
    assert found[3][2].startswith("import of 'socket' is not allowed")
    assert found[4][2] == "relative imports are not allowed"


def test_the_allowed_list_is_the_runtime_one() -> None:
    source = "".join(f"import {name}\n" for name in sorted(ALLOWED_MODULES))
    assert _errors(source + "on endpoint(e):\n    pass\n") == []


def test_calls_of_names_nothing_defines_are_errors() -> None:
    source = ("def helper(x):\n    return x\n"
              "class Box:\n    pass\n"
              "on endpoint(event):\n"
              "    event.reply(helper(len(sorted([]))))\n"
              "    Box()\n"
              "    for fn in [abs]:\n        fn(1)\n"
              "    print(prnt(1), eval('1'))\n"
              "    getattr(event, 'x')\n")
    assert _errors(source) == [
        (10, 11, "prnt() is not defined in the script and is not a builtin scripts can use"),
        (10, 20, "eval() is not defined in the script and is not a builtin scripts can use"),
        (11, 5, "getattr() is not defined in the script and is not a builtin scripts can use"),
    ]


def test_missing_endpoint_block_and_unknown_events_are_warnings() -> None:
    source = "x = 1\non tick(e):\n    pass\non message(m):\n    pass\n"
    assert _errors(source) == []
    assert _warnings(source) == [
        (1, 1, 'no "on endpoint(event):" block: every call of this script\'s endpoint will answer '
               "501 no_endpoint_handler"),
        (2, 1, '"on tick" never runs here: this service only emits endpoint'),
        (4, 1, '"on message" never runs here: this service only emits endpoint'),
    ]


def test_a_header_line_reports_the_authors_column() -> None:
    # "on" is rewritten to "def" for parsing: columns on header lines stay the author's.
    assert _errors("on endpoint(e): nope()\n") == [
        (1, 17, "nope() is not defined in the script and is not a builtin scripts can use")]


@pytest.mark.parametrize("source", EXAMPLES)
def test_every_documented_example_passes_the_checks(source: str) -> None:
    assert compile_script(source).ok
    assert check_source(source).ok and check_source(source).warnings == ()


def test_names_an_allowed_module_does_not_offer_are_errors() -> None:
    source = ("import json\nimport math as m\nimport random\nfrom json import loads, lodas\n"
              "from collections import Counter\n"
              "on endpoint(event):\n"
              "    json.dumps(json.lodas('1'))\n"
              "    m.sqrt(m.tau) + m.sqroot(4)\n"
              "    random.randint(1, 2) + random.nope()\n")
    assert _errors(source) == [
        (4, 1, "module 'json' has no 'lodas'"),
        (7, 16, "module 'json' has no 'lodas'"),
        (8, 21, "module 'math' has no 'sqroot'"),
        (9, 28, "module 'random' has no 'nope'"),
    ]


def test_a_module_name_the_script_rebinds_is_not_judged() -> None:
    source = ("import json\non endpoint(event):\n    json = event.body\n    json.anything()\n"
              "def f(math):\n    return math.whatever\n")
    assert _errors(source) == []
