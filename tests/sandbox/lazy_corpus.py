"""Script snippets that call every module function a script may import, in the ways
that make library code import further modules on first use (tests only)."""
from __future__ import annotations

import encodings.aliases
import pkgutil

import encodings

# One snippet per line group; each runs inside an `on endpoint` block with
# every allowed module imported, so a failure names its snippet.
SNIPPETS: tuple[str, ...] = (
    'json.loads(json.dumps({"a": [1, 2.5, None, "\\u00e9"]}, indent=2, sort_keys=True))',
    'json.dumps([1], separators=(",", ":"), ensure_ascii=True)',
    # error handlers: namereplace reaches unicodedata through PyCapsule_Import
    '[("a\u00e9\u20ac".encode("ascii", h), b"a\\xff".decode("utf-8", d)) for h in ("namereplace", "backslashreplace", "xmlcharrefreplace", "replace", "ignore") for d in ("replace", "ignore", "backslashreplace", "surrogateescape")]',
    'math.fsum([0.1, 0.2]); math.isqrt(10 ** 30); math.comb(50, 7); math.prod([1, 2])',
    're.compile("(?P<x>a+)(?<=a)\\\\N{LATIN SMALL LETTER A}?", re.I | re.X)',
    're.sub("(a)", "\\\\g<1>b", "aaa", flags=re.A | re.M | re.S); re.sub("a", "b", "a", flags=re.U)',
    're.split("\\\\s+", "a b c"); re.findall("[^\\\\W\\\\d]+", "ab 12 cd")',
    'list(re.finditer("a", "aa")); re.fullmatch("a*", "aaa"); re.escape("a.b"); re.subn("a", "b", "aa")',
    're.compile("[a-z]|(?i:x)|a{2,3}?|\\\\bword\\\\b").search("word")',
    'datetime.datetime.strptime("2024-02-03 04:05:06 +0100", "%Y-%m-%d %H:%M:%S %z")',
    'datetime.datetime.now(datetime.timezone.utc).astimezone().strftime("%c %x %X %Z %a %b %p")',
    'datetime.datetime.fromisoformat("2024-02-03T04:05:06+01:00").isoformat()',
    'datetime.date.today().isocalendar(); datetime.datetime.fromtimestamp(0, datetime.UTC)',
    'str(datetime.timedelta(days=1, seconds=5) * 1.5); datetime.time(1, 2).isoformat()',
    'time.strptime("Mon Feb  3 04:05:06 2024"); time.strftime("%c", time.localtime(0))',
    'time.mktime(time.localtime(0)); time.asctime(time.gmtime(0)); time.ctime(0)',
    '[hashlib.new(n, b"x").hexdigest(8) if n.startswith("shake") else hashlib.new(n, b"x").hexdigest() for n in sorted(hashlib.algorithms_available)]',
    '[f(b"x").digest() for f in (hashlib.md5, hashlib.sha1, hashlib.sha224, hashlib.sha256, hashlib.sha384, hashlib.sha512, hashlib.sha3_224, hashlib.sha3_256, hashlib.sha3_384, hashlib.sha3_512, hashlib.blake2b, hashlib.blake2s)]',
    'hashlib.shake_128(b"x").hexdigest(4); hashlib.shake_256(b"x").digest(4); hashlib.blake2b(b"x", key=b"k", digest_size=16).hexdigest()',
    'hashlib.pbkdf2_hmac("sha256", b"p", b"s", 10); hashlib.md5(b"x", usedforsecurity=False).copy().hexdigest()',
    '[hmac.new(b"k", b"m", n).hexdigest() for n in ("md5", "sha1", "sha256", "sha512", "sha3_512", "blake2b", "sha512_256")]',
    'hmac.new(b"k", b"m", hashlib.sha256).copy().digest(); hmac.digest(b"k", b"m", "sha256"); hmac.compare_digest("a", "a")',
    '[base64.b64decode(base64.b64encode(b"xy")), base64.urlsafe_b64decode(base64.urlsafe_b64encode(b"x")), base64.b32decode(base64.b32encode(b"x")), base64.b32hexdecode(base64.b32hexencode(b"x")), base64.b16decode(base64.b16encode(b"x")), base64.b85decode(base64.b85encode(b"x")), base64.a85decode(base64.a85encode(b"x")), base64.decodebytes(base64.encodebytes(b"x")), base64.standard_b64decode(base64.standard_b64encode(b"x"))]',
    'string.capwords("a b"); string.Template("$a ${b}").substitute(a=1, b=2); string.Template("$a").safe_substitute()',
    'class T(string.Template):\n    delimiter = "%"\nT("%a").substitute(a=1)',
    'list(itertools.pairwise([1, 2, 3])); list(itertools.accumulate([1, 2])); list(itertools.product("ab", repeat=2))',
    'functools.reduce(lambda a, b: a + b, [1, 2]); functools.partial(max, 1)(2); functools.cmp_to_key(lambda a, b: a - b)',
    'f = functools.lru_cache(maxsize=4)(lambda x: x)\nf(1)\nf.cache_info()\nfunctools.cache(lambda: 1)()',
    '@functools.total_ordering\nclass O:\n    def __init__(self, v):\n        self.v = v\n    def __eq__(self, o):\n        return self.v == o.v\n    def __lt__(self, o):\n        return self.v < o.v\nO(1) <= O(2)',
    'c = collections.Counter("hello world")\nc.most_common(1); c.most_common(); sorted(c.elements()); repr(c); c + c; c - c; c & c; c | c; c.total()',
    'o = collections.OrderedDict(a=1)\no.move_to_end("a"); repr(o); repr(collections.defaultdict(list)); repr(collections.deque([1], maxlen=3))',
    'P = collections.namedtuple("P", "x y", defaults=[0])\np = P(1)\nrepr(p); p.x + p.y',
    'm = collections.ChainMap({"a": 1}, {"b": 2})\nrepr(m.new_child()); dict(m); repr(m.parents)',
    'statistics.mode([1, 1, 2]); statistics.multimode("aab"); statistics.median([1, 2]); statistics.median_low([1, 2]); statistics.median_high([1, 2])',
    'statistics.median_grouped([1, 2, 2, 3]); statistics.mean([1, 2]); statistics.fmean([1, 2], weights=[1, 2]); statistics.geometric_mean([1, 2]); statistics.harmonic_mean([1, 2])',
    'statistics.pstdev([1, 2]); statistics.pvariance([1, 2]); statistics.stdev([1, 2]); statistics.variance([1, 2]); statistics.quantiles([1, 2, 3, 4], n=4)',
    'statistics.correlation([1, 2, 3], [1, 3, 2]); statistics.covariance([1, 2], [2, 1]); statistics.linear_regression([1, 2, 3], [2, 4, 7], proportional=True)',
    'statistics.mean([decimal.Decimal("1.5"), decimal.Decimal(2)]); statistics.variance([1.5, 2, 3])',
    'd = statistics.NormalDist(1, 2)\nd.samples(3); d.samples(2, seed=1); d.inv_cdf(0.3); d.overlap(statistics.NormalDist()); d.zscore(1); d.quantiles(); statistics.NormalDist.from_samples([1, 2, 3]); d + 1; d * 2; repr(d)',
    'x = decimal.Decimal("1.23456789")\nx.quantize(decimal.Decimal("0.01"), rounding=decimal.ROUND_HALF_UP); x.sqrt(); x.exp(); x.ln(); x.log10(); format(x, "n"); format(x, ",.2f"); str(x); x.to_integral_value(); x.as_integer_ratio(); x.adjusted()',
    'decimal.Context(prec=5, traps=[decimal.Inexact]).create_decimal("1.5"); decimal.Decimal(1.1); decimal.Decimal(3) / 7; hash(decimal.Decimal("1.5"))',
    'u = uuid.uuid4()\nstr(u); u.hex; u.urn; u.bytes_le; u.fields; u.int; u.version; u.variant; u.is_safe; repr(u); uuid.uuid3(uuid.NAMESPACE_DNS, "a"); uuid.uuid5(uuid.NAMESPACE_URL, "a"); uuid.UUID("12345678123456781234567812345678")',
    'r = random.Random(5)\nrandom.seed("text"); random.seed(b"bytes"); random.choices("abc", weights=[1, 2, 3], k=3); random.sample(range(10), 3); random.shuffle([1, 2]); random.gauss(0, 1); random.randbytes(4); random.getrandbits(70); random.randrange(10); random.randint(1, 2); random.triangular(); random.betavariate(1, 2); random.gammavariate(2, 1); random.vonmisesvariate(1, 1); random.lognormvariate(0, 1); random.expovariate(1); random.paretovariate(1); random.weibullvariate(1, 1); random.normalvariate(0, 1); random.uniform(1, 2); random.choice("ab"); r.random(); random.SystemRandom().random(); random.setstate(random.getstate())',
    'format(1234567.891, "n"); format(12, ","); "%c%s%r%a%x%e" % (65, "a", "b", "c", 15, 1.5); f"{1.5:>10.3f}{3!r}"',
    'int("12_345"); int("z", 36); float("1e5"); complex("1+2j"); round(2.675, 2); bytes.fromhex("ab"); (5).to_bytes(2, "little"); int.from_bytes(b"ab", "big")',
    '"Straße".casefold(); "ǅ".title(); "a\\u0301".isidentifier(); "x".center(9, "*"); "a,b".partition(","); "abc".translate({97: "b"}); "a\\tb".expandtabs(); "١٢".isdecimal(); int("١٢")',
    'sorted([3, 1], key=lambda v: -v); max([1, 2], default=0); sum([0.1] * 3); divmod(7, 2); pow(3, -1, 7); abs(-1); hash("a"); ascii("é"); bin(3); oct(3); hex(3)',
    'try:\n    1 / 0\nexcept ZeroDivisionError as exc:\n    str(exc)\ntry:\n    {}["k"]\nexcept KeyError as exc:\n    repr(exc)',
    'print("x", 1, None, sep="-")',
)


def codec_names() -> list[str]:
    """Every codec module name and alias CPython ships."""
    names = set(encodings.aliases.aliases) | set(encodings.aliases.aliases.values())
    names |= {m.name for m in pkgutil.iter_modules(encodings.__path__)}
    names.discard("aliases")
    return sorted(names)


def codec_snippet() -> str:
    """Encode and decode with every codec name (errors allowed: not a text encoding)."""
    return ("for name in %r:\n"
            "    for call in (lambda: 'aé'.encode(name), lambda: b'ab'.decode(name)):\n"
            "        try:\n"
            "            call()\n"
            "        except (LookupError, ValueError, TypeError):\n"
            "            pass\n" % (codec_names(),))
