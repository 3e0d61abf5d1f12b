"""Redaction: what of a request may be kept in history, error logs and the service log.

- History and error logs (`Redactor`): a query parameter or header whose
  value contains the endpoint's secret, or whose name looks like a credential
  (`credential_name`: `secret`, `token`, ... anywhere in it, `key`, `auth`,
  ... as a word of it), is kept as ``[redacted]``; the secret itself is cut
  out of bodies, the script's output and error messages wherever it appears,
  and a value that holds it only in an encoded form (percent-encoding, JSON
  ``\\u`` escapes, Python's ``\\x`` escapes, UTF-16 text: `hides`) is
  replaced whole by ``[redacted]``. So is every other secret or token of the
  service found by its shape (`SHAPES`: another endpoint's secret, an API
  token, a login link's or a session cookie's token; `shape_secrets`).
- The service log (`RedactingFormatter`): anything shaped like a secret or a
  token (``lsk_...``, ``lat_...``, ``Bearer ...``) is replaced, including in
  tracebacks — a last line of defence behind never logging request content.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, unquote, unquote_plus

from service.core.secrets import SECRET_PREFIX

REDACTED = "[redacted]"

#: A name with one of these words (split on - _ . and, where the name keeps
#: the case it was sent in, on case changes) is a credential.
_CREDENTIAL_WORDS = frozenset({
    "secret", "secrets", "token", "tokens", "key", "keys", "apikey", "password", "passwd",
    "pwd", "pass", "auth", "authorization", "credential", "credentials", "session",
    "sessionid", "sig", "signature", "cookie", "jwt", "bearer", "otp",
})
#: ... and so is one holding one of these anywhere in any letter case: header
#: names arrive lower-cased, so `X-AuthToken` is `x-authtoken`, one word
#: (security review: `x-clientsecret`, `apitoken` were kept in clear). Only
#: words no ordinary name holds by chance (not `key`: `keyword`; not `auth`:
#: `author`; not `pass`: `passenger`; not `sig`: `signal`).
_CREDENTIAL_PARTS = ("secret", "token", "password", "passwd", "passphrase", "pwd",
                     "credential", "signature", "session", "sessid", "cookie", "bearer",
                     "jwt", "apikey", "authorization")
#: ... and one with a word ending in one of these (`accesskey`, `dbpass`,
#: `oauth`, `totp`, `hmacsig`; `bypass` and `monkey` too).
_CREDENTIAL_ENDS = ("key", "keys", "pass", "auth", "sig", "otp")
_WORD = re.compile(r"[A-Za-z][a-z]*|[0-9]+")
_SEPARATORS = re.compile(r"[-_.]+")


@functools.lru_cache(maxsize=4096)
def credential_name(name: str) -> bool:
    """True when a parameter or header name says it carries a credential
    (docs/http-api.md, "Keeping the secret safe")."""
    lowered = name.lower()
    if lowered in _CREDENTIAL_WORDS or any(part in lowered for part in _CREDENTIAL_PARTS):
        return True
    if any(word in _CREDENTIAL_WORDS or word.endswith(_CREDENTIAL_ENDS)
           for word in _SEPARATORS.split(lowered)):
        return True
    return any(word.lower() in _CREDENTIAL_WORDS for word in _WORD.findall(name.replace("-", "_")))


class Redactor:
    """Redacts one request's values, knowing the secret it presented (if any)."""

    __slots__ = ("secret",)

    def __init__(self, secret: str | None) -> None:
        self.secret = secret if secret and len(secret) >= 8 else None

    def text(self, value: str) -> str:
        if self.secret and self.secret in value:
            return value.replace(self.secret, REDACTED)
        return value

    def data(self, value: bytes | str) -> bytes | str:
        if isinstance(value, str):
            return self.text(value)
        return self.raw(value)

    def raw(self, value: bytes) -> bytes:
        if self.secret:
            raw = self.secret.encode("utf-8", "surrogatepass")
            if raw in value:
                return value.replace(raw, REDACTED.encode())
        return value

    def value(self, name: str, value: Any) -> Any:
        """A parameter's or header's value as kept."""
        if credential_name(name):
            return REDACTED
        if isinstance(value, list):
            return [self.value("", item) for item in value]
        if isinstance(value, str) and self.secret and self.secret in value:
            return REDACTED
        return value

    def header_name(self, name: str) -> str:
        """A header's name with the secret cut out, in any letter case (names
        are case-insensitive: request headers are kept lower-cased)."""
        if self.secret and self.secret.lower() in name.lower():
            return re.sub(re.escape(self.secret), REDACTED, name, flags=re.IGNORECASE)
        return name

    def mapping(self, values: dict[str, Any], headers: bool = False) -> dict[str, Any]:
        """Query parameters (or `headers`), with credential values redacted and
        the secret cut out of names (`values` itself when nothing is: no secret
        to look for and no credential name)."""
        if self.secret is None and not any(map(credential_name, values)):
            return values
        rename = self.header_name if headers else self.text
        return dict(self.item(rename(name), value) for name, value in values.items())

    def item(self, name: str, value: Any) -> tuple[str, Any]:
        """A name (the secret already cut out of it) and its value as kept: the
        name is judged as it is kept, since a secret's random characters can
        spell a credential word by chance (`pwd`, `-xKey`; 1 secret in 400)."""
        return name, self.value(name, value)


_U_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")
#: Python's ``\\xHH`` escapes: the repr of a str or bytes a script printed or
#: raised with (UTF-16 text's NULs become ``\\x00``).
_X_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
#: Decoding steps tried one after the other on a marked value (percent-encoding
#: and ``\\u`` escapes, in either order, one inside the other): bounded work.
DECODE_DEPTH = 2
#: How much of a value is searched for an encoded secret, once the plain
#: secret is cut out of it: what history keeps of a body or an output (8 KB,
#: counted after that cut) and room for one encoded secret beyond it, so the
#: search costs at most a few milliseconds even for a crafted megabyte.
SCAN_CHARS = 9 * 1024


def _unescaped(match: re.Match[str]) -> str:
    return chr(int(match.group(1), 16))


def _utf16_texts(value: bytes) -> list[str]:
    """`value` read as UTF-16 (both byte orders) from an even and an odd offset:
    UTF-16 text inside other bytes (a multipart part) lines up in one of them.
    Undecodable units become U+FFFD, so the rest still reads."""
    return [value[start:].decode(codec, "replace")
            for codec in ("utf-16-le", "utf-16-be") for start in (0, 1)]


def _decoded_holds(secret: str, text: str, depth: int, fold: bool) -> bool:
    probe = text.lower() if fold else text
    if secret in probe:
        return True
    # UTF-16 text read as one byte a character (a query value, decoded \u
    # escapes): the secret's ASCII with NULs between, at either alignment;
    # decoded further like UTF-16 bytes are (its percent-encoding, say).
    if "\x00" in text and _decoded_holds(secret, text.replace("\x00", ""), depth, fold):
        return True
    if depth == 0:
        return False
    if "%" in text:
        decoded = unquote_plus(text)
        if decoded != text and _decoded_holds(secret, decoded, depth - 1, fold):
            return True
    if "\\u" in text:
        decoded = _U_ESCAPE.sub(_unescaped, text)
        if decoded != text and _decoded_holds(secret, decoded, depth - 1, fold):
            return True
    if "\\x" in text:
        decoded = _X_ESCAPE.sub(_unescaped, text)
        if decoded != text and _decoded_holds(secret, decoded, depth - 1, fold):
            return True
    return False


def hides(secret: str, value: bytes | str, *, fold: bool = False) -> bool:
    """Whether `value` holds `secret` in an encoded form a literal search misses:
    percent-encoded (a form body, a URL in a header), as JSON ``\\u`` escapes or
    Python's ``\\x`` ones (the repr of what a script printed), one inside the
    other, or as UTF-16 text at any alignment (bytes, or text with NULs between
    its letters, each decoded further).
    `fold`: in any letter case, before and after each decoding (`secret` given
    lower-cased; a header name). Searched: the first `SCAN_CHARS` of what is
    left once the plain secret is cut out. Cheap when none of their marks is
    present (the usual case)."""
    # The plain secret is cut out where it stands (`Redactor`); what is left
    # must not hold it encoded. Cut before the slice: what history keeps of a
    # value is counted after the cut, so many plain copies must not push an
    # encoded one past the part searched.
    if isinstance(value, bytes):
        value = value.replace(secret.encode("utf-8", "surrogatepass"), b"")[:SCAN_CHARS]
        if 0 in value and any(_decoded_holds(secret, text, DECODE_DEPTH, fold)
                              for text in _utf16_texts(value)):
            return True
        if 37 not in value and 92 not in value:      # no "%", no "\\"
            return False
        value = value.decode("utf-8", "replace")
    else:
        value = (value.lower() if fold else value).replace(secret, "")[:SCAN_CHARS]
    return _decoded_holds(secret, value, DECODE_DEPTH, fold)


#: Every secret and token the service issues that has a shape of its own, the
#: letters of its prefix in any (ASCII) letter case: an endpoint secret (`lsk_`,
#: `service.core.secrets`) or an admin API token (`lat_`, `service.core.tokens`)
#: and 43 URL-safe characters; a login link's token (43 of them after `login/`);
#: a dashboard session's token in its signed cookie value (Tornado's
#: ``...|13:logic_session|60:<base64>|...``). A session token or a login
#: link's token standing alone has no shape (43 URL-safe characters).
SHAPES = re.compile(
    r"(?a)(?i:lsk_|lat_)[A-Za-z0-9_-]{43}"
    r"|(?i:login/)(?P<link>[A-Za-z0-9_-]{43})(?![A-Za-z0-9_-])"
    r"|(?i:logic_session)\|[0-9]+:(?P<session>[A-Za-z0-9+/=]{40,})")
#: What each of `SHAPES` starts with, in lower case: the cheap test before the
#: search (service/http/_scan.c tests for the same four).
SHAPE_PREFIXES = ("lsk_", "lat_", "login/", "logic_session")
_SHAPE_PREFIXES_B = tuple(prefix.encode() for prefix in SHAPE_PREFIXES)
#: A secret's random part standing alone: 43 URL-safe characters, no more.
_RANDOM_PART = re.compile(r"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])")
#: Random parts checked against the endpoint's verifier per request, at most.
MAX_CHECKED = 64


def shaped(value: str | bytes) -> bool:
    """Whether `value` holds one of `SHAPE_PREFIXES` in any letter case."""
    lowered = value.lower()
    if isinstance(lowered, bytes):
        return any(prefix in lowered for prefix in _SHAPE_PREFIXES_B)
    return any(prefix in lowered for prefix in SHAPE_PREFIXES)


def shape_secrets(value: str | bytes, found: dict[str, None]) -> None:
    """Add to `found` what is secret in each of `SHAPES` that `value` holds: a
    secret or token and its random part (it is found without the prefix too),
    a login link's or a session cookie's token. Bytes are read as Latin-1."""
    if not shaped(value):
        return
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    for match in SHAPES.finditer(text):
        token = match["link"] or match["session"]
        if token:
            found[token] = None
        else:
            found[match[0]] = None
            found[match[0][4:]] = None


def shape_redactors(found: dict[str, None]) -> list[Redactor]:
    """A `Redactor` for each of `found`, the longest first (a secret is cut
    whole before its random part is looked for alone)."""
    return [Redactor(part) for part in sorted(found, key=lambda part: (-len(part), part))]


def shaped_redactors(*values: Any, is_secret: Callable[[str], bool] | None = None
                     ) -> list[Redactor]:
    """A `Redactor` for everything secret in `SHAPES` among `values` (text, bytes,
    and the names and values of mappings; `shape_secrets`): for a request that
    presents no secret, such as a test call. With `is_secret` (the endpoint's
    verifier, when it is cheap), a random part that stands alone is redacted
    too when it is the endpoint's secret's (the first `MAX_CHECKED` of them)."""
    found: dict[str, None] = {}
    alone: list[str] = []
    for value in values:
        items = [*value, *value.values()] if isinstance(value, dict) else [value]
        for item in items:
            text = (item.decode("latin-1") if isinstance(item, bytes)
                    else item if isinstance(item, str) else str(item))
            shape_secrets(text, found)
            if is_secret is not None and len(alone) < MAX_CHECKED:
                alone += _RANDOM_PART.findall(text)[:MAX_CHECKED - len(alone)]
    if is_secret is not None:
        for part in set(alone):
            if is_secret(SECRET_PREFIX + part):
                found[SECRET_PREFIX + part] = found[part] = None
    return shape_redactors(found)


def redact_all(redactors: list[Redactor], value: Any) -> Any:
    """`value` (a mapping, text or bytes) through every redactor in turn."""
    for redact in redactors:
        value = redact.mapping(value) if isinstance(value, dict) else redact.data(value)
    return value


#: Secret- and token-shaped text in a log line.
#: (No word boundary before the prefix: "x_lsk_..." is redacted too, and
#: what is cut off before a prefix is only ever over-redaction.)
_SECRET_SHAPES = re.compile(r"(lsk|lat)_[A-Za-z0-9_\-]{6,}|(?i:\b(bearer|basic)\s+)[^\s'\",;]+")


_AFTER_LOGIN = re.compile(r"(?is)(login[/\\%]).*")
#: A `login` segment's end: `/`, `\` (which browsers read as `/`), or a `%`
#: still encoded after the decoding rounds below.
_LOGIN_SEGMENT = re.compile(r"(?i)login[/\\%]")
#: Rounds of percent-decoding a path gets before it is looked at (a link
#: encoded twice by a link rewriter: `/login%252F...`).
_DECODE_ROUNDS = 4
#: What a decoded path may not show as it is: anything but printable ASCII
#: (and the "…" that marks a cut): control characters of C0 and C1, line and
#: paragraph separators, bidirectional controls.
_CONTROL = re.compile("[^\x21-\x7e\u2026]")


def loggable_path(path: str) -> str:
    """A request path as an access line may show it: what follows a `login/`
    (or `login\\`) segment, in any letter case and percent-encoded or not,
    even twice over, may be a login link's token (`//login/...` from a base
    URL ending in "/", a link typed in capitals, `/%6Cogin/...`,
    `/login%252F...`), and is cut. A path cut after decoding is shown
    decoded, all but its printable ASCII encoded again (no forged log lines,
    no terminal escapes, no reordered text)."""
    decoded = path
    for _ in range(_DECODE_ROUNDS):
        if "%" not in decoded:
            break
        once = unquote(decoded)
        if once == decoded:
            break
        decoded = once
    if decoded is not path and _LOGIN_SEGMENT.search(decoded):
        return _CONTROL.sub(lambda m: quote(m.group(), safe=""),
                            _AFTER_LOGIN.sub(r"\1…", decoded))
    if _LOGIN_SEGMENT.search(path):
        return _AFTER_LOGIN.sub(r"\1…", path)
    return path


def scrub(text: str) -> str:
    """`text` with every secret-shaped word replaced."""
    return _SECRET_SHAPES.sub(REDACTED, text)


class RedactingFormatter(logging.Formatter):
    """A `logging.Formatter` whose output never carries a secret-shaped word."""

    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record))
