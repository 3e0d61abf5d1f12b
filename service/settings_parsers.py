"""How each configuration value is read and checked.

Each parser takes the raw value (TOML-typed, or a string from the
environment or a command-line flag) and returns the typed value, or raises
ValueError with a short reason (`service.settings` adds where it came
from). A parser of a secret never echoes the value.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import ParseResult, urlparse

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty string")
    return value


def int_between(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        if isinstance(value, str):
            if not re.fullmatch(r"-?[0-9]+", value.strip()):
                raise ValueError("expected an integer")
            value = int(value)
        if not isinstance(value, int):
            raise ValueError("expected an integer")
        if not lo <= value <= hi:
            raise ValueError(f"expected {lo}..{hi}")
        return value
    return parse


def flag(value: Any) -> bool:
    # Plans come only from TOML, which has real booleans: a string is a typo.
    if isinstance(value, bool):
        return value
    raise ValueError("expected true or false")


def share(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number")
    try:
        share = float(value)
    except (TypeError, ValueError):
        raise ValueError("expected a number") from None
    if not 0.0 < share <= 1.0:
        raise ValueError("expected a fraction above 0 and at most 1")
    return share


def env_flag(value: Any) -> bool:
    # A setting that also comes from the environment or a flag: "true"/"false" too.
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    return flag(value)


def workers(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.lower() in ("", "auto")):
        return None
    return int_between(1, 256)(value)


def processes(value: Any) -> int | None:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        return int_between(1, 256)(value)
    except ValueError:
        raise ValueError('expected "auto" or an integer 1..256') from None


def _parsed(url: str) -> ParseResult:
    """`urlparse(url)`; its errors quote the text they choke on — a URL's
    password, if need be — so they are replaced by a fixed one."""
    try:
        return urlparse(url)
    except ValueError:
        raise ValueError("not a URL that can be parsed (percent-encode / ? # @ : [ ] in "
                         "the user name and password)") from None


def http_url(value: Any) -> str:
    url = text(value)
    parsed = _parsed(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError("expected an http:// or https:// URL")
    # The scheme in lower case (urlparse gives it so): `HTTPS://` is https to
    # everything that reads the setting, the session cookie's Secure flag included.
    return (parsed.scheme + url[len(parsed.scheme):]).rstrip("/")


def cookie_secret(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    if value and len(value) < 32:
        # Never echo the value: it is a secret.
        raise ValueError("too short: use at least 32 random characters")
    if "change-me" in value.lower():
        # The example files' placeholder: anyone could sign sessions with it,
        # and test guesses of it against a copy of the database (the
        # verifiers' key id is derived from it).
        raise ValueError("still the example's placeholder: use 32 or more random characters, "
                         "e.g. from `openssl rand -base64 32`")
    return value


def metrics_token(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    if value and (len(value) < 16 or not re.fullmatch(r"[\x21-\x7e]+", value)):
        # Never echo the value: it is a secret.
        raise ValueError("expected at least 16 printable characters without spaces, or empty")
    return value


def db_url(value: Any) -> str:
    url = text(value)
    if _parsed(url).scheme not in ("sqlite", "postgres", "postgresql"):
        raise ValueError("expected sqlite:///PATH or postgresql://...")
    return url


def storage(value: Any) -> str:
    url = text(value)
    scheme = _parsed(url).scheme
    if scheme not in ("memory", "redis", "rediss", "unix"):
        raise ValueError('expected "memory://" or a redis://, rediss:// or unix:// URL')
    if scheme != "memory":
        _check_redis_url(url)
    return url


def _check_redis_url(url: str) -> None:
    """Refuse a Redis URL its client would refuse at start-up (a port that is no
    number, a database or option of the wrong type), in one line that never
    echoes the URL (it may hold a password)."""
    parsed = _parsed(url)
    database = parsed.path.strip("/")
    if parsed.scheme != "unix" and database and not (database.isascii() and database.isdigit()):
        raise ValueError("not a valid Redis URL: the database (the path) must be a number")
    try:
        from redis.connection import parse_url
    except ImportError:   # the `redis` extra is not installed: the port at least
        try:
            parsed.port
        except ValueError:
            raise ValueError("not a valid Redis URL: the port must be a number "
                             "from 1 to 65535") from None
        return
    try:
        options = parse_url(url)  # type: ignore[no-untyped-call]
    except (ValueError, TypeError) as err:
        reason = "the port must be a number from 1 to 65535" if "port" in str(err).lower() \
            else "a database number or an option has the wrong type"
        raise ValueError(f"not a valid Redis URL: {reason}") from None
    port = options.get("port")
    if port is not None and not 0 < port < 65536:
        raise ValueError("not a valid Redis URL: the port must be a number from 1 to 65535")


def on_storage_error(value: Any) -> str:
    choice = text(value).strip().lower()
    if choice not in ("open", "closed"):
        raise ValueError('expected "open" or "closed"')
    return choice


def networks(value: Any) -> tuple[IPNetwork, ...]:
    if isinstance(value, str):       # env / CLI: comma separated
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list):
        raise ValueError("expected a list of CIDRs")
    out = []
    for item in value:
        try:
            out.append(ipaddress.ip_network(text(item), strict=True))
        except ValueError as err:
            raise ValueError(f"bad CIDR {item!r} ({err})") from None
    return tuple(out)


def public_key(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a hex string")
    key = value.strip().lower()
    if key and not re.fullmatch(r"[0-9a-f]{64}", key):
        raise ValueError("expected 64 hex characters (an Ed25519 public key) or empty")
    return key


def chat_path(value: Any) -> str:
    path = text(value)
    if not re.fullmatch(r"/[A-Za-z0-9._~/-]{1,200}", path) or "//" in path:
        raise ValueError("expected an absolute path such as /interactions")
    taken = ("/endpoints", "/healthz", "/readyz", "/metrics")
    if path.rstrip("/") in taken or path.startswith("/endpoints/"):
        raise ValueError("path is taken by another route")
    return path


