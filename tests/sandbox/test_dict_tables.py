"""A dict under an insertion keeps a table for any key (review, session 31).

CPython 3.11's ``d[k] = v`` and ``setdefault`` made the table general for a
non-string key, looked the key up (running a script's code when a comparison
reaches it), then stored the key in whatever table the dict had by then:
emptied by ``clear()``, or emptied and refilled by ``update``/``|=`` from a dict
of strings, that was a string-only table, whose later lookups read the key as a
string (a worker crash; a comparison on memory at a pointer the script chose).
``sandbox.dict_tables`` keeps those operations from ever installing such a
table, and makes ``Fraction`` keep two exact integers (the reviewer's route to
a script's code inside an integer's lookup)."""
from __future__ import annotations

import collections
import fractions
import json
import textwrap

import pytest

from sandbox import dict_tables
from sandbox.pool import Limits, Pool
from tests.sandbox.poolkit import event, ref, run_with_pool
from tests.sandbox.test_cpython_fixes import FRACTION
from tests.sandbox.script_helpers import run

#: An aware datetime whose tzinfo is the script's runs ``ACTION`` while another
#: one with the same hash is looked up for insertion (its comparison asks both
#: tzinfos for their offset; ``a``'s hash was computed before arming).
UNDER_INSERTION = '''import datetime
import functools
st = {"armed": 0, "tz": None, "d": None}
class TZ(datetime.tzinfo):
    def utcoffset(self, dt):
        if st["armed"] and self is st["tz"]:
            st["armed"] = st["armed"] - 1
            if st["armed"] == 0:
                act()
        return datetime.timedelta(0)
tz1 = TZ()
tz2 = TZ()
st["tz"] = tz1
def act():
    d = st["d"]
ACTION
on endpoint(event):
    a = datetime.datetime(2020, 1, 1, 0, 0, 7, tzinfo=tz1)
    b = datetime.datetime(2020, 1, 1, 0, 0, 7, tzinfo=tz2)
    again = datetime.datetime(2020, 1, 1, 0, 0, 7, tzinfo=tz2)
INSERT
'''

PLAIN = '''    d = DICT
    st["d"] = d
    d[a] = 1
    st["armed"] = 1
    STORE
    keys = list(d)
    event.reply({"n": len(keys), "found": [k in d for k in keys] + [again in d, "abc" in d]})
'''

CLEAR = "    d.clear()"
REFILL = '''    for k in list(d):
        del d[k]
    d.update({"x": 1, "y": 2})'''
REFILL_OR = '''    for k in list(d):
        del d[k]
    d |= {"x": 1, "y": 2}'''
#: A review of the first fix: the keywords were merged (a table copy) after a
#: generator given to the same call had emptied the dict.
REFILL_KEYWORDS = '''    def emptying():
        for k in list(d):
            del d[k]
        return
        yield
    d.update(emptying(), x=1)'''


def _script(action: str, insert: str) -> str:
    return UNDER_INSERTION.replace("ACTION", action).replace("INSERT", insert)


def _plain(action: str, container: str = "{}", store: str = "d[b] = 2") -> str:
    return _script(action, PLAIN.replace("DICT", container).replace("STORE", store))


CASES = {
    "clear": _plain(CLEAR),
    "clear-setdefault": _plain(CLEAR, store="d.setdefault(b, 2)"),
    "refill-update": _plain(REFILL),
    "refill-or": _plain(REFILL_OR),
    "refill-keywords": _plain(REFILL_KEYWORDS),
    "refill-keywords-setdefault": _plain(REFILL_KEYWORDS, store="d.setdefault(b, 2)"),
    "defaultdict-clear": _plain(CLEAR, "collections.defaultdict(int)").replace(
        "import functools", "import functools\nimport collections"),
    "counter-refill": _plain(REFILL, "collections.Counter()").replace(
        "import functools", "import functools\nimport collections"),
}


@pytest.mark.parametrize("source", CASES.values(), ids=CASES.keys())
def test_a_dict_emptied_under_an_insertion_still_finds_every_key(source: str) -> None:
    # Before the fix: {"n": 3, "found": [true, true, false, false, false]} or
    # similar: the datetime was stored in a string-only table it cannot be
    # found in again (and a string lookup read it as a string).
    result = run(source)
    assert result.get("error") is None, result.get("error")
    answer = json.loads(result["body"])
    *present, absent = answer["found"]
    assert present == [True] * (answer["n"] + 1) and absent is False, answer


LRU = _script("    cached.cache_clear()", '''    calls = []
    hashed = {a: 0}   # a's hash is computed (and kept) before anything is armed
    @functools.lru_cache(maxsize=None)
    def cached(x):
        calls.append(1)
        if x is b:
            # a goes into the cache now; b's insertion, after this returns,
            # compares b with a, and a's tzinfo clears the cache
            st["armed"] = 1
            cached(a)
        return len(calls)
    st["cache"] = cached
    cached(b)
    cached(again)     # equal to b: found in the cache
    event.reply({"calls": len(calls), "size": cached.cache_info().currsize})
''').replace("def act():\n    d = st[\"d\"]\n", "def act():\n    cached = st[\"cache\"]\n")


def test_an_lru_cache_cleared_under_its_own_insertion_still_finds_its_entries() -> None:
    result = run(LRU)
    assert result.get("error") is None, result.get("error")
    # Before: 3 calls (the C cache's table had turned string-only and lost b).
    assert result["body"] == b'{"calls":2,"size":1}'


FRACTION_PARTS = FRACTION + textwrap.dedent('''\
    class I2(int):
        def __eq__(self, other):
            return False
    class I(int):
        @property
        def numerator(self):
            return I2(5)
    on endpoint(event):
        f = Fraction(I(1))
        event.reply(str(f))
''')


def test_a_fraction_is_made_of_two_exact_integers() -> None:
    result = run(FRACTION_PARTS)
    assert result["error"]["kind"] == "script_error"
    assert "numerator and denominator must be integers" in result["error"]["message"]
    assert fractions.Fraction(True) == 1 and type(fractions.Fraction(True).numerator) is int
    assert fractions.Fraction("3/4") + fractions.Fraction(1, 4) == 1
    assert fractions.Fraction(1.5) == fractions.Fraction(3, 2)


#: The reviewer's reproducer: a Fraction over a script int whose comparison
#: empties the dict; then a string lookup compared memory at a chosen pointer.
REVIEWED = FRACTION + textwrap.dedent('''\
    st = {"armed": False, "d": None, "K": 2 ** 40 + 7}
    class I2(int):
        def __eq__(self, other):
            if st["armed"]:
                st["armed"] = False
                st["d"].clear()
            return False
    class I(int):
        @property
        def numerator(self):
            return I2(st["K"])
    on endpoint(event):
        d = {}
        st["d"] = d
        try:
            d[Fraction(I(1))] = "e"
        except TypeError as e:
            d[Fraction(st["K"])] = "e"
        st["armed"] = True
        d[st["K"]] = "k"
        event.reply([k in d for k in list(d)] + ["t" in d])
''')


#: A review of the first fix: the keyword merge after an emptying generator,
#: reached through ``Fraction.__eq__`` reading a script int's ``numerator``;
#: the forged int read as a string compared memory at ``address`` (SIGSEGV in
#: a real worker).
COMBINED = FRACTION + textwrap.dedent('''\
    st = {"armed": False, "d": None}
    def gen():
        d = st["d"]
        for k in list(d):
            del d[k]
        return
        yield
    class I(int):
        @property
        def numerator(self):
            if st["armed"]:
                st["armed"] = False
                st["d"].update(gen(), x=1)
            return int(self)
    def forge(s, address):
        h = hash(s) % 2 ** 64
        digits = [0] * len(s)
        digits[0] = h % 2 ** 32
        digits[1] = h // 2 ** 32
        digits[2] = 0x84
        digits[12] = address % 2 ** 32
        digits[13] = address // 2 ** 32
        digits[len(s) - 1] = digits[len(s) - 1] or 1
        if max(digits) >= 2 ** 30:
            return None
        for pad in range(64):
            digits[4] = pad
            v = 0
            for i in range(len(digits)):
                v = v + digits[i] * 2 ** (30 * i)
            if (hash(v) - hash(s)) % 8 == 0:
                return v
        return None
    on endpoint(event):
        address = 0x100001000
        for i in range(100000):
            s = "zzzzzzzzzz%06d" % i
            v = forge(s, address)
            if v is not None:
                break
        d = {}
        st["d"] = d
        d[Fraction(v)] = "f"
        st["armed"] = True
        d[I(v)] = "k"
        event.reply({"found": s in d, "kept": sorted(str(k) for k in d) == sorted([str(v), "x"])})
''')


def test_the_reviewed_reproducer_ends_as_a_script_answer_in_a_real_worker() -> None:
    async def scenario(pool: Pool) -> None:
        for source in (REVIEWED, CASES["clear"], CASES["refill-or"], COMBINED, LRU):
            out = await pool.run(ref(source), event(), Limits(3000, 16384), "attacker")
            assert out.error_kind is None, (out.error_kind, out.error_message)
            if source is COMBINED:
                assert out.body == b'{"found":false,"kept":true}'
        assert out.body == b'{"calls":2,"size":1}'
        assert pool.counters["crashes"] == 0
        ok = await pool.run(ref("on endpoint(event):\n    event.reply('alive')\n"), event(),
                            Limits(1000, 4096), "victim")
        assert ok.body == b'"alive"'

    run_with_pool(scenario, size=1)


def test_clear_and_update_answer_as_the_originals() -> None:
    assert dict_tables.installed()
    d = {"a": 1, 2: "b"}
    assert d.clear() is None and d == {} and len(d) == 0
    d["x"] = 1
    assert d == {"x": 1} and list(d) == ["x"]
    e: dict[object, object] = {}
    assert e.update({"a": 1}, b=2) is None and e == {"a": 1, "b": 2}
    assert list(e) == ["a", "b"]
    e.update([("c", 3)])
    e.update(e)
    assert e == {"a": 1, "b": 2, "c": 3}
    with pytest.raises(TypeError, match="'int' object is not iterable"):
        {}.update(5)
    with pytest.raises(TypeError, match="element #0 to a sequence"):
        {}.update([1])
    with pytest.raises(ValueError, match="element #1 has length 3; 2 is required"):
        {}.update([(1, 2), (1, 2, 3)])
    seen: list[int] = []
    grown: dict[str, int] = {}
    grown.update((c, len(grown)) for c in "abc" if not seen.append(len(grown)))
    assert grown == {"a": 0, "b": 1, "c": 2} and seen == [0, 1, 2]   # nothing extra inside
    d2 = collections.OrderedDict(a=1)
    d2["b"] = 2
    target: dict[str, int] = {"z": 0}
    target.update(d2)
    assert list(target.items()) == [("z", 0), ("a", 1), ("b", 2)]
    with pytest.raises(TypeError):
        dict.clear([])
    with pytest.raises(TypeError):
        dict.update([], {})
    od = dict_tables.lru_cache  # scripts' lru_cache is the Python one, and works
    calls = []

    @od(maxsize=2)
    def square(x: int) -> int:
        calls.append(x)
        return x * x
    assert [square(3), square(3), square(4), square(5), square(3)] == [9, 9, 16, 25, 9]
    assert calls == [3, 4, 5, 3] and square.cache_info().currsize == 2
    c = collections.Counter("abca")
    c.clear()
    c.update("xx")
    assert c == {"x": 2}
    assert dict.clear.__doc__ and dict.update.__doc__.startswith("D.update(")
