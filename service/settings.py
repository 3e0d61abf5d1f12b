"""Settings: the one validated, frozen configuration object (DESIGN section 10).

Sources, lowest precedence first: built-in defaults, the TOML file
(`--config` / `LOGIC_CONFIG`), environment variables `LOGIC_<SECTION>_<KEY>`,
then command-line flags.  Every key is checked once here; an unknown key or a
bad value raises `SettingsError` with a one-line message naming it, so the
process stops before it binds a port or touches the database.
"""
from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from service import settings_parsers as to
from service.plans import DEFAULT_PLANS, OPTIONAL_PLAN_KEYS, PLAN_KEYS, Plan
from service.settings_parsers import IPNetwork


class SettingsError(Exception):
    """A configuration problem; `str(err)` is one line naming the key."""


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    base_url: str = "http://127.0.0.1:8080"
    trusted_proxies: tuple[IPNetwork, ...] = ()
    max_connections: int = 0            # 0: derived from the descriptor limit
    max_connections_per_ip: int = 256
    max_pipelined: int = 64
    write_buffer_bytes: int = 262144
    socket_send_buffer_bytes: int = 131072   # SO_SNDBUF; 0: the kernel's autotuning
    socket_receive_buffer_bytes: int = 131072   # SO_RCVBUF; 0: the kernel's autotuning
    buffer_budget_bytes: int = 268435456   # what connections pin together; 0: no budget
    #: Front processes sharing the port (SO_REUSEPORT); None ("auto"): one per CPU.
    processes: int | None = 1
    #: With several fronts: one whose event loop gives no sign of life this long is killed.
    front_timeout_s: int = 30
    #: Signs dashboard session cookies; `logic serve` refuses to start without it.
    cookie_secret: str = field(default="", repr=False)

    @property
    def process_count(self) -> int:
        """The effective number of front processes."""
        return self.processes if self.processes is not None else (os.cpu_count() or 1)


@dataclass(frozen=True)
class DashboardSettings:
    session_idle_minutes: int = 60       # a session unused this long ends
    session_max_hours: int = 12          # and every session ends this long after login


@dataclass(frozen=True)
class DatabaseSettings:
    url: str = "sqlite:///logic.db"
    #: PostgreSQL unreachable: remembered endpoint answers are served this long
    #: after the change feed's connection broke; 0: never (503 at once).
    outage_serve_s: int = 30


@dataclass(frozen=True)
class SandboxSettings:
    workers: int | None = None          # None: one per CPU
    queue_timeout_ms: int = 2000
    max_workers: int = 0                # worker processes (one guild each); 0: from memory
    memory_budget_mb: int = 0           # the workers' memory together; 0: half of the machine's
    idle_retire_s: int = 600            # a guild's worker idle this long is retired
    guild_share: float = 0.5            # of the workers, one guild at most while others wait
    guild_budget_s: int = 60            # worker-seconds per minute per guild; 0: off

    @property
    def worker_count(self) -> int:
        """The effective pool size."""
        return self.workers if self.workers is not None else (os.cpu_count() or 1)


@dataclass(frozen=True)
class RatelimitSettings:
    storage: str = "memory://"
    ipv6_prefix: int = 64
    auth_queue: int = 64
    auth_queue_per_endpoint: int = 8
    on_storage_error: str = "open"      # Redis unreachable: "open" (per-node windows) or "closed" (503)
    storage_timeout_ms: int = 1000      # a Redis call slower than this counts as an outage


@dataclass(frozen=True)
class RecordsSettings:
    journal: str = ""                   # "": beside a SQLite file, else ./logic-journal
    fsync: bool = False


@dataclass(frozen=True)
class MetricsSettings:
    """`GET /metrics` (service.http.metrics_handler): labels and who may scrape."""

    per_guild: bool = False             # a guild label on the invoke request counter
    #: Peers that may scrape; empty: /metrics is off (404 for everyone).
    allow: tuple[IPNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"),
                                    ipaddress.ip_network("::1/128"))
    #: When set, scrapes must also send `Authorization: Bearer <token>`.
    token: str = field(default="", repr=False)


@dataclass(frozen=True)
class ChatSettings:
    """The chat command's interactions endpoint (service.chat); off while `public_key` is empty."""

    public_key: str = ""                # the platform application's Ed25519 public key, hex
    path: str = "/interactions"
    api_url: str = "https://discord.com/api/v10"   # where deferred replies are sent
    answer_within_ms: int = 2000        # past this, a command's reply is deferred (type 5)


@dataclass(frozen=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    database: DatabaseSettings = field(default_factory=DatabaseSettings)
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)
    ratelimit: RatelimitSettings = field(default_factory=RatelimitSettings)
    chat: ChatSettings = field(default_factory=ChatSettings)
    records: RecordsSettings = field(default_factory=RecordsSettings)
    plans: Mapping[str, Plan] = field(default_factory=lambda: DEFAULT_PLANS)
    dashboard: DashboardSettings = field(default_factory=DashboardSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)


_SCHEMA: dict[str, dict[str, Callable[[Any], Any]]] = {
    "server": {"host": to.text, "port": to.int_between(0, 65535), "base_url": to.http_url,
               "trusted_proxies": to.networks, "cookie_secret": to.cookie_secret,
               "max_connections": to.int_between(0, 10_000_000),
               "max_connections_per_ip": to.int_between(1, 10_000_000),
               "max_pipelined": to.int_between(1, 100_000),
               "write_buffer_bytes": to.int_between(4096, 1 << 30),
               "socket_send_buffer_bytes": to.int_between(0, 1 << 26),
               "socket_receive_buffer_bytes": to.int_between(0, 1 << 26),
               "buffer_budget_bytes": to.int_between(0, 1 << 40),
               "processes": to.processes,
               "front_timeout_s": to.int_between(2, 3600)},
    "database": {"url": to.db_url, "outage_serve_s": to.int_between(0, 86_400)},
    "sandbox": {"workers": to.workers, "queue_timeout_ms": to.int_between(1, 600_000),
                "max_workers": to.int_between(0, 4096),
                "memory_budget_mb": to.int_between(0, 1 << 24),
                "idle_retire_s": to.int_between(1, 86_400), "guild_share": to.share,
                "guild_budget_s": to.int_between(0, 3600)},
    "ratelimit": {"storage": to.storage, "ipv6_prefix": to.int_between(8, 128),
                  "auth_queue": to.int_between(1, 1_000_000),
                  "auth_queue_per_endpoint": to.int_between(1, 1_000_000),
                  "on_storage_error": to.on_storage_error,
                  "storage_timeout_ms": to.int_between(10, 600_000)},
    "records": {"journal": to.text, "fsync": to.env_flag},
    "chat": {"public_key": to.public_key, "path": to.chat_path, "api_url": to.http_url,
             "answer_within_ms": to.int_between(0, 2500)},
    "dashboard": {"session_idle_minutes": to.int_between(1, 7 * 24 * 60),
                  "session_max_hours": to.int_between(1, 30 * 24)},
    "metrics": {"per_guild": to.env_flag, "allow": to.networks, "token": to.metrics_token},
}
_SECTION_TYPES: dict[str, type] = {
    "server": ServerSettings, "database": DatabaseSettings,
    "sandbox": SandboxSettings, "ratelimit": RatelimitSettings,
    "chat": ChatSettings,
    "dashboard": DashboardSettings,
    "records": RecordsSettings,
    "metrics": MetricsSettings,
}
_PLAN_PARSERS: dict[str, Callable[[Any], Any]] = {
    "endpoints": to.int_between(0, 10_000), "memory_kb": to.int_between(0, 16 * 1024 * 1024),
    "requests_per_minute": to.int_between(0, 10**9), "body_bytes": to.int_between(0, 1 << 30),
    "history": to.int_between(0, 100_000), "error_logs": to.flag, "ip_whitelist": to.flag,
    "advanced_stats": to.flag, "time_limit_ms": to.int_between(0, 3_600_000),
    "scripts": to.int_between(0, 100_000),
}
_PLAN_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def env_name(section: str, key: str) -> str:
    """The environment variable for `section.key`, e.g. LOGIC_SERVER_BASE_URL."""
    return f"LOGIC_{section}_{key}".upper()


def _parse(where: str, dotted: str, parser: Callable[[Any], Any], value: Any) -> Any:
    try:
        return parser(value)
    except ValueError as err:
        raise SettingsError(f"{where}: bad value for {dotted}: {err}") from None


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as err:
        raise SettingsError(f"config: cannot read {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise SettingsError(f"config: {path} is not valid TOML: {err}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"config: {path} is not UTF-8 text") from None


def _plans_from(table: Any) -> Mapping[str, Plan]:
    if not isinstance(table, dict):
        raise SettingsError("config: plans must be a table of [plans.NAME] tables")
    plans = dict(DEFAULT_PLANS)
    for name, values in table.items():
        if not _PLAN_NAME.fullmatch(name):
            raise SettingsError(f"config: bad plan name plans.{name} (use a-z, 0-9, _ and -)")
        if not isinstance(values, dict):
            raise SettingsError(f"config: plans.{name} must be a table")
        base = plans.get(name)
        parsed: dict[str, Any] = {}
        for key, raw in values.items():
            if key not in _PLAN_PARSERS:
                raise SettingsError(f"config: unknown key plans.{name}.{key}")
            parsed[key] = _parse("config", f"plans.{name}.{key}", _PLAN_PARSERS[key], raw)
        if base is None:
            # A new plan must say every limit: a silent zero would be a
            # plan nobody can use, a silent default one nobody chose.
            missing = [k for k in PLAN_KEYS if k not in parsed and k not in OPTIONAL_PLAN_KEYS]
            if missing:
                raise SettingsError(f"config: plans.{name} is new and misses {', '.join(missing)}")
            plans[name] = Plan(name=name, **parsed)
        else:
            merged = {k: getattr(base, k) for k in PLAN_KEYS} | parsed
            plans[name] = Plan(name=name, **merged)
    return MappingProxyType(plans)


def load_settings(config_file: str | None = None, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """Build the `Settings` from file, environment and CLI overrides.

    `config_file` None falls back to `env["LOGIC_CONFIG"]`.  `overrides` maps
    dotted keys ("server.port") to values; None values are ignored (a flag not
    given).  Raises `SettingsError`.
    """
    env = os.environ if env is None else env
    values: dict[str, dict[str, Any]] = {s: {} for s in _SCHEMA}
    plans: Mapping[str, Plan] = DEFAULT_PLANS

    path = config_file or env.get("LOGIC_CONFIG") or None
    if path:
        data = _read_file(path)
        for section, table in data.items():
            if section == "plans":
                plans = _plans_from(table)
                continue
            if section not in _SCHEMA:
                raise SettingsError(f"config: unknown section [{section}]")
            if not isinstance(table, dict):
                raise SettingsError(f"config: {section} must be a table")
            for key, raw in table.items():
                if key not in _SCHEMA[section]:
                    raise SettingsError(f"config: unknown key {section}.{key}")
                values[section][key] = _parse("config", f"{section}.{key}", _SCHEMA[section][key], raw)

    # Environment: only LOGIC_<SECTION>_* names are ours, so a typo inside a
    # known section is an error while unrelated LOGIC_* variables pass.
    for name, raw in env.items():
        if name.startswith("LOGIC_PLANS_"):
            raise SettingsError(f"env: plans are set in the configuration file only ({name})")
        for section, keys in _SCHEMA.items():
            prefix = f"LOGIC_{section.upper()}_"
            if not name.startswith(prefix):
                continue
            key = name[len(prefix):].lower()
            if key not in keys:
                raise SettingsError(f"env: unknown variable {name}")
            values[section][key] = _parse("env", name, keys[key], raw)

    for dotted, raw in (overrides or {}).items():
        if raw is None:
            continue
        section, _, key = dotted.partition(".")
        if key not in _SCHEMA.get(section, {}):
            raise SettingsError(f"flags: unknown setting {dotted}")
        values[section][key] = _parse("flags", dotted, _SCHEMA[section][key], raw)

    server = values["server"]
    if "base_url" not in server and ("host" in server or "port" in server):
        # Printed URLs follow the address actually served unless one is configured.
        host = server.get("host", ServerSettings.host)
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        host = f"[{host}]" if ":" in host else host
        server["base_url"] = f"http://{host}:{server.get('port', ServerSettings.port)}"
    sections = {s: _SECTION_TYPES[s](**values[s]) for s in _SCHEMA}
    _check_worker_room(sections["sandbox"])
    return Settings(plans=plans, **sections)


def _check_worker_room(box: SandboxSettings) -> None:
    """A guild within its share runs beside another guild's excess, each in a
    process of its own: the pool needs room for twice `workers` processes."""
    from sandbox.budget import WORKER_BYTES
    need = 2 * (box.workers or os.cpu_count() or 1)
    if box.max_workers and box.max_workers < need:
        raise SettingsError(f"settings: sandbox.max_workers must be 0 (derived) or at least "
                            f"twice sandbox.workers ({need})")
    if box.memory_budget_mb and box.memory_budget_mb << 20 < need * WORKER_BYTES:
        raise SettingsError(f"settings: sandbox.memory_budget_mb must be 0 (derived) or at least "
                            f"{need * WORKER_BYTES >> 20} (twice sandbox.workers at "
                            f"{WORKER_BYTES >> 20} MiB a worker)")
