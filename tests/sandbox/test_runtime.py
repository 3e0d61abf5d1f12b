"""run_endpoint: event fields, outcomes, sealing, limits and state isolation."""
from __future__ import annotations

import copy
import sys
import time

import pytest

from sandbox.event import ReplyError, ReplyState, new_event
from sandbox.runtime import RECURSION_BUDGET, run_endpoint
from tests.sandbox.script_helpers import compiled, error_kind, make_event, run, run_block


def test_event_fields() -> None:
    out = run_block("""\
        event.reply({
            "body": event.body, "rawBody": event.rawBody, "headers": event.headers,
            "query": event.query, "method": event.method, "ip": event.ip,
            "userAgent": event.userAgent, "timestamp": event.timestamp,
        })
        """)
    assert out["error"] is None
    assert out["body"] == (
        b'{"body":{"score":21,"name":"ada"},"rawBody":"{\\"score\\": 21, \\"name\\": \\"ada\\"}",'
        b'"headers":{"content-type":"application/json","user-agent":"pytest"},'
        b'"query":{"page":"2","tag":["a","b"]},"method":"POST","ip":"203.0.113.7",'
        b'"userAgent":"pytest","timestamp":"2026-11-21T10:00:00.000Z"}')


@pytest.mark.parametrize(("body", "raw", "expected"), [
    ("hello", "hello", b'["str","str"]'),
    (b"\x00\x01", b"\x00\x01", b'["bytes","bytes"]'),
    ([1, 2], "[1, 2]", b'["list","str"]'),
])
def test_body_types(body: object, raw: object, expected: bytes) -> None:
    out = run_block("""\
        def kind(v):
            return "str" if isinstance(v, str) else "bytes" if isinstance(v, bytes) else "list"
        event.reply([kind(event.body), kind(event.rawBody)])
        """, event=make_event(body=body, rawBody=raw))
    assert out["body"] == expected


def test_event_is_read_only_and_cannot_be_built_by_scripts() -> None:
    out = run_block("event.ip = '1.1.1.1'")
    assert out["error"]["message"] == ("TypeError: cannot assign to attributes or items of "
                                       "Event objects")
    out = run_block("type(event)(None, {}, None)")
    assert out["error"]["message"] == "TypeError: event objects cannot be created by scripts"
    out = run_block("class E(type(event)):\n    pass")
    assert out["error"]["message"] == "TypeError: event objects cannot be subclassed"


def test_event_fields_are_fresh_copies() -> None:
    event = make_event()
    original = copy.deepcopy(event)
    script = compiled("""\
        on endpoint(event):
            event.body["score"] = 0
            event.query["tag"].append("evil")
            event.headers.clear()
            event.reply(len(event.query["tag"]))
        """)
    assert run_endpoint(script, event)["body"] == b"3"
    assert run_endpoint(script, event)["body"] == b"3"
    assert event == original


def test_nested_request_data_is_copied_at_every_level() -> None:
    event = make_event(body={"a": [{"b": [1]}], "t": (1, [2])})
    script = compiled("""\
        on endpoint(event):
            event.body["a"][0]["b"].append(2)
            event.body["t"][1].append(3)
            event.reply(event.body)
        """)
    assert run_endpoint(script, event)["body"] == b'{"a":[{"b":[1,2]}],"t":[1,[2,3]]}'
    assert event["body"] == {"a": [{"b": [1]}], "t": (1, [2])}


def test_script_error_outcome() -> None:
    out = run_block("x = {}\nx['missing']")
    assert out["replied"] is False and out["status"] == 500 and out["body"] == b""
    assert out["error"]["kind"] == "script_error"
    assert out["error"]["message"] == "KeyError: 'missing'"
    assert out["error"]["line"] == 3


def test_error_after_reply_is_still_an_error() -> None:
    out = run_block('event.reply("ok")\nraise ValueError("late")')
    assert error_kind(out) == "script_error" and out["replied"] is False


def test_errors_at_module_level() -> None:
    out = run("x = 1 / 0\non endpoint(event):\n    pass\n")
    assert out["error"]["line"] == 1
    assert out["error"]["traceback"].splitlines()[1] == '  File "<script>", line 1, in <module>'


def test_script_exception_with_custom_args_is_rendered_without_calling_them() -> None:
    out = run_block("""\
        class Thing:
            pass
        class Boom(Exception):
            pass
        raise Boom(Thing(), 2)
        """)
    assert out["error"]["message"] == "Boom: <Thing object>, 2"


def test_exception_without_message() -> None:
    assert run_block("raise ValueError")["error"]["message"] == "ValueError"


def test_memory_error_outcome() -> None:
    # Where the allocation failed is reported (line and script frames).
    out = run_block("raise MemoryError()")
    error = out["error"]
    assert {k: error[k] for k in ("kind", "message", "line")} == {
        "kind": "script_memory_exceeded",
        "message": "the script used more memory than its plan allows", "line": 2}
    assert error["traceback"].endswith("raise MemoryError()\nMemoryError")
    assert out["status"] == 500


def test_recursion_is_bounded_and_reported() -> None:
    before = sys.getrecursionlimit()
    out = run_block("def f(n):\n    return f(n + 1)\nf(0)")
    assert sys.getrecursionlimit() == before
    error = out["error"]
    assert error["kind"] == "script_error"
    assert error["message"] == "RecursionError: maximum recursion depth exceeded"
    lines = error["traceback"].splitlines()
    assert lines[1].startswith("  ... ") and lines[1].endswith(" earlier frames omitted")
    assert len([ln for ln in lines if ln.startswith('  File "<script>"')]) == 20


def test_recursion_budget_allows_reasonable_depth() -> None:
    out = run_block(f"def f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\nevent.reply(f("
                    f"{RECURSION_BUDGET - 50}))")
    assert out["body"] == str(RECURSION_BUDGET - 50).encode()


def test_a_generators_finally_run_at_the_end_has_the_same_recursion_budget() -> None:
    # A generator left suspended in the script's globals runs its finally block
    # when they are released after the run: script code, held to the run's
    # recursion budget too (it had the interpreter's default of 1,000 frames:
    # red-team pass, session 34), and its output is still the request's.
    out = run_block("""\
        held.append(late())
        next(held[0])
        event.reply(deepest(0))
        """, prelude="""\
        def deepest(n):
            try:
                return deepest(n + 1)
            except RecursionError:
                return n
        def late():
            def deeper(n):   # a closure: the globals are gone when it runs
                try:
                    return deeper(n + 1)
                except RecursionError:
                    return n
            try:
                yield 1
            finally:
                print("late", deeper(0))
        held = []
        """)
    during = int(out["body"])
    assert 0 < during < RECURSION_BUDGET
    late = int(out["output"].split()[1])
    assert 0 < late < RECURSION_BUDGET, (during, late)


def test_int_str_digits_limit_is_enforced() -> None:
    previous = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # a careless embedder turned the limit off
    try:
        out = run_block("str(10 ** 5000)")
    finally:
        sys.set_int_max_str_digits(previous)
    assert out["error"]["message"].startswith("ValueError: Exceeds the limit (4300 digits)")


def test_no_endpoint_handler() -> None:
    out = run("on tick(e):\n    pass\n")
    assert out == {"replied": False, "status": 501, "headers": [], "body": b"", "contentType": "",
                   "output": "", "error": {"kind": "no_endpoint_handler",
                                           "message": 'the script has no "on endpoint" block',
                                           "line": None, "traceback": None}}


def test_return_value_of_the_block_is_ignored() -> None:
    assert run_block("return {'x': 1}")["body"] == b'{"success": true}'


def test_sealed_event_refuses_calls_after_return() -> None:
    state = ReplyState()
    event = new_event(make_event(), state)
    event.reply("before")
    state.sealed = True
    with pytest.raises(RuntimeError, match="the event is sealed"):
        event.reply("late")
    with pytest.raises(RuntimeError, match="the event is sealed"):
        event.status(500)
    with pytest.raises(RuntimeError, match="the event is sealed"):
        event.header("X-A", "b")
    assert state.payload == "before" and state.status == 200 and state.headers == []


def test_generator_finaliser_cannot_reply_after_the_block() -> None:
    out = run("""\
        HELD = []
        def late(ev):
            try:
                yield 1
            finally:
                ev.reply("late")
                ev.status(500)
        on endpoint(event):
            g = late(event)
            next(g)
            HELD.append(g)
            event.reply("early")
        """)
    assert (out["status"], out["body"]) == (200, b'"early"')


def test_generators_in_cycles_are_finalised_within_their_own_invocation() -> None:
    script = compiled("""\
        def gen():
            try:
                yield 1
            finally:
                print("finalised")
        on endpoint(event):
            g = gen()
            next(g)
            cycle = [g]
            cycle.append(cycle)
            event.reply("done")
        """)
    assert script.has_generators
    out = run_endpoint(script, make_event())
    assert (out["body"], out["output"]) == (b'"done"', "finalised\n")


def test_reply_error_is_a_value_error() -> None:
    assert issubclass(ReplyError, ValueError)


POISON = """\
import json, math, re, random, datetime, time, hashlib, hmac, base64, string
import itertools, functools, collections, statistics, decimal, uuid

def attempt(label, fn):
    try:
        fn()
    except Exception as exc:
        return
    print("poisoned:", label)

def evil(*args, **kwargs):
    return "pwned"

def set_attr(obj, name):
    def go():
        obj.hacked = evil
    return go

def shadow_builtin():
    global len
    len = evil

on endpoint(event):
    targets = [json, math, re, random, datetime, time, hashlib, hmac, base64, string,
               itertools, functools, collections, statistics, decimal, uuid,
               json.dumps, json.loads, re.compile, math.sqrt, datetime.datetime,
               collections.Counter, collections.OrderedDict, decimal.Decimal,
               string.Template, random.Random, uuid.UUID, statistics.NormalDist,
               str, int, dict, list, Exception, ValueError, event, type(event),
               event.reply, len, sorted, re.compile("x"), decimal.Context()]
    for i, target in enumerate(targets):
        attempt("setattr %d" % i, set_attr(target, "hacked"))
    attempt("hashlib set", lambda: hashlib.algorithms_available.add("evil"))
    attempt("template delimiter", set_attr(string.Template, "delimiter"))
    attempt("total_ordering", lambda: functools.total_ordering(uuid.UUID))
    random.seed(12345)
    decimal.Decimal(1) / decimal.Decimal(3)
    re.compile("(?P<cached>a)")
    shadow_builtin()
    event.body["poison"] = True
    event.headers.clear()
    event.reply(random.random())
"""

CHECK = """\
import json, math, random, string, decimal, hashlib, collections

on endpoint(event):
    seeded = random.Random(12345).random()
    event.reply({
        "dumps": json.dumps({"a": [1]}),
        "pi": math.pi,
        "len": len([1, 2]),
        "template": string.Template("$x").substitute(x="ok"),
        "seventh": str(decimal.Decimal(1) / decimal.Decimal(7)),
        "evil_hash": "evil" in hashlib.algorithms_available,
        "random_reseeded": random.random() == seeded,
        "body": event.body,
        "headers": len(event.headers),
        "counter": collections.Counter("aab").most_common(1)[0][0],
    })
"""


def test_a_script_cannot_poison_the_next_invocation() -> None:
    event = make_event()
    poison = run_endpoint(compiled(POISON), event)
    assert poison["error"] is None, poison["error"]
    assert poison["output"] == ""  # every attempt was refused
    check = run_endpoint(compiled(CHECK), make_event())
    assert check["error"] is None, check["error"]
    assert check["body"] == (
        b'{"dumps":"{\\"a\\": [1]}","pi":3.141592653589793,"len":2,"template":"ok",'
        b'"seventh":"0.1428571428571428571428571429","evil_hash":false,"random_reseeded":false,'
        b'"body":{"score":21,"name":"ada"},"headers":2,"counter":"a"}')


def test_invocations_are_cheap() -> None:
    script = compiled("""\
        import json
        def valid(d):
            return isinstance(d, dict) and isinstance(d.get("score"), int)
        on endpoint(event):
            if not valid(event.body):
                event.status(422)
                event.reply({"error": "score must be an integer"})
                return
            event.reply({"ok": True, "double": event.body["score"] * 2})
        """)
    event = make_event()
    run_endpoint(script, event)
    start = time.perf_counter()
    for _ in range(2000):
        run_endpoint(script, event)
    per_call = (time.perf_counter() - start) / 2000
    assert per_call < 200e-6, per_call  # ~15 µs on a laptop; generous for CI


def test_exception_args_property_of_a_script_class_is_not_called() -> None:
    out = run_block("""\
        calls = []
        class Boom(Exception):
            @property
            def args(self):
                calls.append(1)
                print("ran in trusted code")
                raise RuntimeError("nested")
        raise Boom("x")
        """)
    assert out["error"]["kind"] == "script_error"
    assert out["error"]["message"] == "Boom: x"
    assert out["output"] == ""


def test_prepare_worker_process_silences_script_warnings() -> None:
    import warnings

    from sandbox.runtime import prepare_worker_process
    with warnings.catch_warnings():
        prepare_worker_process()
        out = run_block("event.reply(bool(NotImplemented))")
    assert out["error"] is None and out["body"] == b"true"


def test_os_error_with_an_object_filename_is_rendered_without_calling_it() -> None:
    out = run_block("""\
        class Loud(dict):
            pass
        try:
            random.SystemRandom().choice([])
        except IndexError as exc:
            pass
        raise KeyError(Loud(a=1))
        """, "import random\n")
    assert out["error"]["message"] == "KeyError: <Loud object>"


@pytest.mark.parametrize("body", [
    'event.reply({"a": "é\\u2028"})',
    'print("\\ud800 lone")\nevent.reply(b"\\xff")',
    'raise ValueError("bad \\udcff bytes")',
    'event.status(True)',
    'event.header("Content-Type", "text/plain")\nevent.reply("x")',
])
def test_results_survive_msgpack(body: str) -> None:
    import msgpack  # type: ignore[import-untyped]
    out = run_block(body)
    packed = msgpack.packb(out, use_bin_type=True)
    assert msgpack.unpackb(packed, raw=False) == out
