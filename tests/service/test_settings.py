"""Settings: defaults, TOML file, environment, flags, plans, errors."""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from service.plans import DEFAULT_PLANS, FREE, PLUS, PRO
from service.settings import SettingsError, load_settings


def write(tmp_path, text: str) -> str:
    path = tmp_path / "logic.toml"
    path.write_text(text)
    return str(path)


def test_defaults_match_the_design():
    s = load_settings(None, {}, {})
    assert (s.server.host, s.server.port, s.server.base_url) == ("127.0.0.1", 8080, "http://127.0.0.1:8080")
    assert s.server.trusted_proxies == () and s.database.url == "sqlite:///logic.db"
    assert s.sandbox.workers is None and s.sandbox.worker_count == (os.cpu_count() or 1)
    assert s.sandbox.queue_timeout_ms == 2000 and s.ratelimit.storage == "memory://"
    assert s.ratelimit.on_storage_error == "open" and s.ratelimit.storage_timeout_ms == 1000
    assert s.database.outage_serve_s == 30
    assert dict(s.plans) == dict(DEFAULT_PLANS)
    assert (FREE.endpoints, PLUS.endpoints, PRO.endpoints) == (0, 3, 9)
    assert (PLUS.body_bytes, PRO.body_bytes, PLUS.history, PRO.history) == (131072, 1048576, 20, 200)
    assert PRO.ip_whitelist and not PLUS.ip_whitelist and PRO.advanced_stats and PLUS.error_logs


def test_file_env_and_flags_in_order(tmp_path):
    path = write(tmp_path, """
[server]
host = "0.0.0.0"
port = 9000
base_url = "https://logic.example.com/"
trusted_proxies = ["10.0.0.0/8", "::1/128"]
[database]
url = "postgresql://u@db/logic"
[sandbox]
workers = 4
queue_timeout_ms = 500
[ratelimit]
storage = "redis://cache:6379/0"
[plans.plus]
history = 50
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
""")
    s = load_settings(path, {"LOGIC_SERVER_PORT": "9100", "LOGIC_SANDBOX_WORKERS": "2",
                             "LOGIC_OTHER": "ignored"},
                      {"server.port": 9200, "database.url": None})
    assert s.server.host == "0.0.0.0" and s.server.port == 9200
    assert s.server.base_url == "https://logic.example.com"
    # The scheme in any letter case reads as https (the session cookie's Secure flag).
    assert load_settings(None, {"LOGIC_SERVER_BASE_URL": "HTTPS://Logic.example.com/x/"}
                         ).server.base_url == "https://Logic.example.com/x"
    assert s.server.trusted_proxies == (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128"))
    assert s.database.url == "postgresql://u@db/logic" and s.sandbox.workers == 2
    assert s.plans["plus"].history == 50 and s.plans["plus"].endpoints == 3
    assert s.plans["bench"].requests_per_minute == 1000000 and "pro" in s.plans
    # The rate limit's outage policy, from the environment too.
    outage = load_settings(path, {"LOGIC_RATELIMIT_ON_STORAGE_ERROR": "closed",
                                  "LOGIC_RATELIMIT_STORAGE_TIMEOUT_MS": "250"}, {})
    assert outage.ratelimit.on_storage_error == "closed"
    assert outage.ratelimit.storage_timeout_ms == 250
    # How long a node cut off from PostgreSQL serves what it remembers: file, env, 0 = never.
    served = tmp_path / "served.toml"
    served.write_text("[database]\nurl = 'postgresql://u@db/logic'\noutage_serve_s = 5\n")
    assert load_settings(str(served), {}, {}).database.outage_serve_s == 5
    assert load_settings(str(served), {"LOGIC_DATABASE_OUTAGE_SERVE_S": "0"},
                         {}).database.outage_serve_s == 0
    # LOGIC_CONFIG names the file when no --config is given.
    assert load_settings(None, {"LOGIC_CONFIG": path}, {}).server.port == 9000


@pytest.mark.parametrize("text,env,message", [
    ("[server]\nhots = 'x'\n", {}, "config: unknown key server.hots"),
    ("[serve]\nhost = 'x'\n", {}, "config: unknown section [serve]"),
    ("[server]\nport = 'eighty'\n", {}, "config: bad value for server.port: expected an integer"),
    ("[server]\nport = 70000\n", {}, "config: bad value for server.port: expected 0..65535"),
    ("[server]\ntrusted_proxies = ['10.0.0.1/8']\n", {}, "config: bad value for server.trusted_proxies"),
    ("[database]\nurl = 'mysql://x'\n", {}, "config: bad value for database.url"),
    ("[database]\noutage_serve_s = -1\n", {},
     "config: bad value for database.outage_serve_s: expected 0..86400"),
    ("", {"LOGIC_DATABASE_OUTAGE_SERVE_S": "30s"},
     "env: bad value for LOGIC_DATABASE_OUTAGE_SERVE_S: expected an integer"),
    ("[plans.plus]\nendpoint = 3\n", {}, "config: unknown key plans.plus.endpoint"),
    ("[plans.plus]\nerror_logs = 'yes'\n", {}, "config: bad value for plans.plus.error_logs"),
    ("[plans.gold]\nendpoints = 3\n", {}, "config: plans.gold is new and misses memory_kb"),
    ("", {"LOGIC_SERVER_HOTS": "x"}, "env: unknown variable LOGIC_SERVER_HOTS"),
    ("", {"LOGIC_SANDBOX_WORKERS": "0"}, "env: bad value for LOGIC_SANDBOX_WORKERS"),
    ("", {"LOGIC_PLANS_PRO_HISTORY": "5"}, "env: plans are set in the configuration file only"),
    ("not toml [", {}, "is not valid TOML"),
    ("[server]\nprocesses = 0\n", {}, 'config: bad value for server.processes: expected "auto" or an integer 1..256'),
    ("[server]\nprocesses = 'many'\n", {}, "config: bad value for server.processes"),
    ("", {"LOGIC_SERVER_PROCESSES": "2.5"}, "env: bad value for LOGIC_SERVER_PROCESSES"),
    ("[server]\nfront_timeout_s = 1\n", {}, "config: bad value for server.front_timeout_s"),
    ("[ratelimit]\non_storage_error = 'maybe'\n", {},
     "config: bad value for ratelimit.on_storage_error: expected \"open\" or \"closed\""),
    ("", {"LOGIC_RATELIMIT_STORAGE_TIMEOUT_MS": "5"},
     "env: bad value for LOGIC_RATELIMIT_STORAGE_TIMEOUT_MS"),
    ("[ratelimit]\nstorage = 'memcached://x'\n", {}, "config: bad value for ratelimit.storage"),
    # A Redis URL its client would refuse: one line, never the URL (it may hold a password).
    ("[ratelimit]\nstorage = 'redis://:pw0rd@127.0.0.1:notaport/1'\n", {},
     "config: bad value for ratelimit.storage: not a valid Redis URL: the port"),
    ("[ratelimit]\nstorage = 'redis://127.0.0.1:99999/0'\n", {},
     "config: bad value for ratelimit.storage: not a valid Redis URL: the port"),
    ("[ratelimit]\nstorage = 'redis://127.0.0.1:6379/x'\n", {},
     "config: bad value for ratelimit.storage: not a valid Redis URL: the database"),
    ("", {"LOGIC_RATELIMIT_STORAGE": "redis://127.0.0.1:6379/0?socket_timeout=pw0rd"},
     "env: bad value for LOGIC_RATELIMIT_STORAGE: not a valid Redis URL"),
    # Session 24: brackets after a `/` in the password made urlparse's own
    # error quote the bracketed part of it.
    ("", {"LOGIC_RATELIMIT_STORAGE": "redis://u:[pw0rd]/x@h:6379/0"},
     "env: bad value for LOGIC_RATELIMIT_STORAGE: not a URL that can be parsed"),
    ("", {"LOGIC_DATABASE_URL": "postgresql://app:[pw0rd]/rest@db.internal:5432/logic"},
     "env: bad value for LOGIC_DATABASE_URL: not a URL that can be parsed"),
    ("[database]\nurl = 'postgresql://app:[pw0rd]/rest@db.internal/logic'\n", {},
     "config: bad value for database.url: not a URL that can be parsed"),
])
def test_errors_are_one_line_naming_the_key(tmp_path, text, env, message):
    with pytest.raises(SettingsError) as err:
        load_settings(write(tmp_path, text), env, {})
    assert message in str(err.value) and "\n" not in str(err.value)
    assert "pw0rd" not in str(err.value)


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    # Red-team pass, session 23: a latin-1 file gave a 48-line traceback.
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"# caf\xe9\n[server]\nport = 9000\n")
    with pytest.raises(SettingsError) as err:
        load_settings(str(path), {}, {})
    assert str(err.value) == f"config: {path} is not UTF-8 text"


def test_processes_default_auto_env_and_flag(tmp_path):
    assert load_settings(None, {}, {}).server.processes == 1
    assert load_settings(None, {}, {}).server.process_count == 1
    auto = load_settings(write(tmp_path, "[server]\nprocesses = 'auto'\n"), {}, {}).server
    assert auto.processes is None and auto.process_count == (os.cpu_count() or 1)
    assert load_settings(None, {"LOGIC_SERVER_PROCESSES": "3"}, {}).server.process_count == 3
    assert load_settings(None, {"LOGIC_SERVER_PROCESSES": "AUTO"}, {}).server.processes is None
    flagged = load_settings(None, {"LOGIC_SERVER_PROCESSES": "3"}, {"server.processes": "2"})
    assert flagged.server.process_count == 2
    with pytest.raises(SettingsError, match="flags: bad value for server.processes"):
        load_settings(None, {}, {"server.processes": "-1"})


def test_missing_file_and_unknown_flag(tmp_path):
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(str(tmp_path / "nope.toml"), {}, {})
    with pytest.raises(SettingsError, match="flags: unknown setting server.hots"):
        load_settings(None, {}, {"server.hots": "x"})
    with pytest.raises(SettingsError, match="flags: bad value for server.port"):
        load_settings(None, {}, {"server.port": "x"})


def test_settings_are_frozen():
    s = load_settings(None, {}, {})
    with pytest.raises(Exception):
        s.server.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.plans["x"] = PRO  # type: ignore[index]


def test_metrics_section(tmp_path):
    s = load_settings(None, {}, {})
    assert s.metrics.per_guild is False and s.metrics.token == ""
    assert s.metrics.allow == (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
    token = "t" * 16
    s = load_settings(write(tmp_path, f'[metrics]\nper_guild = true\nallow = ["10.1.0.0/16"]\n'
                                      f'token = "{token}"\n'), {}, {})
    assert s.metrics.per_guild is True and s.metrics.token == token
    assert s.metrics.allow == (ipaddress.ip_network("10.1.0.0/16"),)
    assert token not in repr(s)
    s = load_settings(None, {"LOGIC_METRICS_PER_GUILD": "true", "LOGIC_METRICS_ALLOW": "",
                             "LOGIC_METRICS_TOKEN": "u" * 20}, {})
    assert s.metrics.per_guild is True and s.metrics.allow == () and s.metrics.token == "u" * 20


@pytest.mark.parametrize("text,env,message", [
    ("[metrics]\nper_guild = 'yes'\n", {}, "config: bad value for metrics.per_guild"),
    ("[metrics]\nallow = ['10.0.0.1/8']\n", {}, "config: bad value for metrics.allow"),
    ("[metrics]\nlabels = 1\n", {}, "config: unknown key metrics.labels"),
    ("", {"LOGIC_METRICS_PER_GUILD": "maybe"}, "env: bad value for LOGIC_METRICS_PER_GUILD"),
    ("", {"LOGIC_METRICS_TOKEN": "short-secret"}, "env: bad value for LOGIC_METRICS_TOKEN"),
    ("", {"LOGIC_METRICS_TOKEN": "has a space in it, long"}, "LOGIC_METRICS_TOKEN"),
    ("[chat]\npath = '/metrics'\n", {}, "config: bad value for chat.path: path is taken"),
])
def test_metrics_errors_are_one_line_and_never_echo_the_token(tmp_path, text, env, message):
    with pytest.raises(SettingsError) as err:
        load_settings(write(tmp_path, text), env, {})
    assert message in str(err.value) and "\n" not in str(err.value)
    assert "short-secret" not in str(err.value) and "space in it" not in str(err.value)


def test_the_example_files_cookie_secret_placeholder_is_refused(tmp_path) -> None:
    # A review (session 26): `logic serve` took the compose example's
    # placeholder, with which anyone can sign a session, and whose guesses the
    # verifiers' key id in a database copy confirms.
    example = (Path(__file__).resolve().parents[2] / "deploy" / "compose" / "env.example")
    placeholder = next(line.split("=", 1)[1] for line in example.read_text().splitlines()
                       if line.startswith("LOGIC_COOKIE_SECRET="))
    with pytest.raises(SettingsError) as err:
        load_settings(None, {"LOGIC_SERVER_COOKIE_SECRET": placeholder}, {})
    assert "placeholder" in str(err.value) and placeholder not in str(err.value)
    assert load_settings(None, {"LOGIC_SERVER_COOKIE_SECRET": "q7" * 20}, {}).server.cookie_secret


@pytest.mark.parametrize("text, message", [
    ("[sandbox]\nworkers = 4\nmax_workers = 7\n",
     "settings: sandbox.max_workers must be 0 (derived) or at least twice sandbox.workers (8)"),
    ("[sandbox]\nworkers = 4\nmemory_budget_mb = 39\n",
     "settings: sandbox.memory_budget_mb must be 0 (derived) or at least 40 (twice sandbox.workers"),
])
def test_worker_room_for_a_fair_job_beside_excess_is_enforced(tmp_path, text, message):
    # A guild within its share runs beside another guild's excess, each in a
    # worker of its own guild: with room for fewer than twice `workers`
    # processes a fair job waits for the excess one and can end in 503 busy.
    with pytest.raises(SettingsError) as err:
        load_settings(write(tmp_path, text), {}, {})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_worker_room_at_its_bound_and_derived_is_accepted(tmp_path):
    s = load_settings(write(tmp_path, "[sandbox]\nworkers = 4\nmax_workers = 8\nmemory_budget_mb = 40\n"),
                      {}, {})
    assert (s.sandbox.max_workers, s.sandbox.memory_budget_mb) == (8, 40)
    env = {"LOGIC_SANDBOX_WORKERS": "2", "LOGIC_SANDBOX_MAX_WORKERS": "0"}
    assert load_settings(None, env, {}).sandbox.max_workers == 0
