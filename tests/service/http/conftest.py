"""Fixtures for end-to-end tests: a migrated SQLite file, `logic serve` processes on it,
and factories that set up guilds, scripts, endpoints and secrets through the service layer."""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.dbsupport import PgSchema, pg_unreachable_reason
from tests.service.http.harness import LOGIC, Server

CONFIG = """
[plans.bench]
endpoints = 9
memory_kb = 4096
requests_per_minute = 1000000
body_bytes = 1048576
history = 200
error_logs = true
ip_whitelist = true
advanced_stats = true
time_limit_ms = 1000
"""

OWNER = "4242"
_guild_ids = itertools.count(10_000)
_ips = itertools.count(2)


@dataclass
class Env:
    database_url: str
    config: Path
    db: Any
    plans: Any


@dataclass
class Ep:
    guild_id: str
    script_id: str
    name: str
    secret: str = field(repr=False)

    @property
    def path(self) -> str:
        return f"/endpoints/{self.guild_id}/{self.script_id}"


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def http_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Env]:
    """The database every end-to-end test of one backend shares, migrated by `logic db upgrade`."""
    from models.db import open_database
    from service.settings import load_settings

    root = tmp_path_factory.mktemp("http")
    schema = None
    if request.param == "sqlite":
        url = f"sqlite:///{root / 'logic.db'}"
    else:
        reason = pg_unreachable_reason()
        if reason:
            pytest.skip(reason)
        schema = PgSchema()
        url = schema.url
    config = root / "logic.toml"
    config.write_text(CONFIG)
    subprocess.run([LOGIC, "--database-url", url, "db", "upgrade"], check=True,
                   capture_output=True)
    settings = load_settings(str(config), env={})
    env = Env(url, config, open_database(url), settings.plans)
    yield env
    env.db.close()
    if schema is not None:
        schema.drop()


@pytest.fixture()
def bind(http_env: Env) -> Callable[[], None]:
    """Bind the model proxy to the test database (other test modules bind it elsewhere)."""
    from models.db import database

    def do() -> None:
        database.initialize(http_env.db)

    do()
    return do


def _start(http_env: Env, tmp_path: Path, **options: Any) -> Server:
    lines = []
    sandbox = {k: v for k, v in options.items() if k in ("workers", "queue_timeout_ms")}
    if sandbox:
        lines.append("[sandbox]")
        lines += [f"{k} = {v}" for k, v in sandbox.items()]
    if "trusted_proxies" in options:
        lines.append("[server]")
        lines.append("trusted_proxies = [" + ", ".join(f'"{c}"' for c in options["trusted_proxies"])
                     + "]")
    lines.append(options.get("extra", ""))  # more TOML tables, e.g. "[ratelimit]\nipv6_prefix = 48"
    n = next(_guild_ids)
    if "[records]" not in options.get("extra", ""):
        lines.append(f'[records]\njournal = "{tmp_path / f"journal-{n}"}"')
    config = tmp_path / f"server-{n}.toml"
    config.write_text("\n".join(lines) + "\n" + CONFIG)
    return Server(http_env.database_url, str(config), nofile=options.get("nofile"),
                  env=options.get("env", {}), host=options.get("host", "127.0.0.1")).start()


@pytest.fixture(scope="module")
def server(http_env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = _start(http_env, tmp_path_factory.mktemp("srv"))
    yield srv
    srv.stop()


@pytest.fixture()
def make_server(http_env: Env, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def make(**options: Any) -> Server:
        srv = _start(http_env, tmp_path, **options)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        try:
            srv.stop()
        except Exception:  # noqa: BLE001 - a test may have stopped it already
            srv.kill()


@pytest.fixture()
def make_endpoint(http_env: Env, bind: Callable[[], None]) -> Callable[..., Ep]:
    from service.core import endpoints, guilds, scripts, secrets
    from service.core.access import Actor

    def make(source: str, plan: str = "pro", enabled: bool = True,
             whitelist: list[str] | None = None) -> Ep:
        bind()
        guild_id = str(next(_guild_ids))
        owner = Actor.user(OWNER)
        guilds.create_guild(Actor.operator(), guild_id, OWNER, plan, plans=http_env.plans)
        script_id = scripts.create_script(owner, guild_id, f"s{guild_id}", source)["logicScriptId"]
        if enabled:
            endpoints.enable_endpoint(owner, guild_id, script_id, plans=http_env.plans)
        if whitelist:
            endpoints.set_whitelist(owner, guild_id, script_id, whitelist, plans=http_env.plans)
        secret = secrets.regenerate_secret(owner, guild_id, script_id)["secret"]
        return Ep(guild_id, script_id, f"s{guild_id}", secret)

    return make


@pytest.fixture()
def set_plan(http_env: Env, bind: Callable[[], None]) -> Callable[[str, str], None]:
    from service.core import guilds
    from service.core.access import Actor

    def do(guild_id: str, plan: str) -> None:
        bind()
        guilds.set_plan(Actor.operator(), guild_id, plan, plans=http_env.plans)

    return do


@pytest.fixture()
def regenerate(bind: Callable[[], None]) -> Callable[[Ep], str]:
    from service.core import secrets
    from service.core.access import Actor

    def do(ep: Ep) -> str:
        bind()
        return str(secrets.regenerate_secret(Actor.user(OWNER), ep.guild_id, ep.script_id)["secret"])

    return do


@pytest.fixture()
def read_history(http_env: Env, bind: Callable[[], None]) -> Callable[[Ep], list[dict[str, Any]]]:
    from service.core import reads
    from service.core.access import Actor

    def do(ep: Ep) -> list[dict[str, Any]]:
        bind()
        return list(reads.history(Actor.user(OWNER), ep.guild_id, ep.script_id,
                                  plans=http_env.plans)["records"])

    return do


@pytest.fixture()
def read_errors(http_env: Env, bind: Callable[[], None]) -> Callable[[Ep], list[dict[str, Any]]]:
    from service.core import reads
    from service.core.access import Actor

    def do(ep: Ep) -> list[dict[str, Any]]:
        bind()
        return list(reads.errors(Actor.user(OWNER), ep.guild_id, ep.script_id,
                                 plans=http_env.plans)["errors"])

    return do


@pytest.fixture()
def source_ip() -> Callable[[], str]:
    """A fresh loopback source address per call, so per-IP throttles do not collide."""

    def make() -> str:
        n = next(_ips)
        return f"127.0.{n // 250}.{n % 250 + 2}"

    return make


@pytest.fixture()
def argon2_secret(bind: Callable[[], None]) -> Callable[[Ep], str]:
    """Store the endpoint's secret as a legacy argon2id hash (as before the SHA-256
    verifier) and return the stored hash."""
    from models import Endpoint, Script
    from service.core.secrets import hash_secret_argon2

    def do(ep: Ep) -> str:
        bind()
        stored = hash_secret_argon2(ep.secret)
        script = Script.get(Script.public_id == ep.script_id)
        Endpoint.update(secret_hash=stored).where(Endpoint.script == script.id).execute()
        return stored

    return do


def stored_secret_hash(ep: Ep) -> str | None:
    """The endpoint's stored secret verifier (the model must be bound)."""
    from models import Endpoint, Script
    script = Script.get(Script.public_id == ep.script_id)
    return Endpoint.get(Endpoint.script == script.id).secret_hash  # type: ignore[no-any-return]


@dataclass
class Ipv6Nets:
    """Addresses of two /64 networks on the loopback interface (both in one /48)."""

    same: list[str]          # five addresses of one /64
    other: str               # an address of another /64


@pytest.fixture()
def ipv6_nets() -> Iterator[Ipv6Nets]:
    """Adds addresses of two /64s (unique to this test process) to `lo`, removes them after.

    Needs root (as CI runs) and a kernel with IPv6: otherwise the test is skipped."""
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("adding IPv6 addresses to lo needs root and iproute2")
    base = f"fd00:4c:{os.getpid() % 0xFFFF:x}"
    nets = Ipv6Nets([f"{base}:a::{n}" for n in range(1, 6)], f"{base}:b::1")
    added: list[str] = []
    try:
        for address in (*nets.same, nets.other):
            done = subprocess.run(["ip", "-6", "addr", "add", f"{address}/128", "dev", "lo",
                                   "nodad"], capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot add {address} to lo: {done.stderr.strip()}")
            added.append(address)
        yield nets
    finally:
        for address in added:
            subprocess.run(["ip", "-6", "addr", "del", f"{address}/128", "dev", "lo"],
                           capture_output=True)
