"""The files under deploy/ stay true to the code."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from pathlib import Path
from typing import Any

import pytest

from service.settings import load_settings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_example_config_loads_and_states_the_defaults() -> None:
    example = load_settings(str(DEPLOY / "logic.toml.example"), env={})
    defaults = load_settings(None, env={})
    assert example == defaults


def test_example_config_names_every_key() -> None:
    text = (DEPLOY / "logic.toml.example").read_text()
    defaults = load_settings(None, env={})
    for section in ("server", "database", "sandbox", "ratelimit", "records", "dashboard"):
        assert f"[{section}]" in text
        for key in vars(getattr(defaults, section)):
            assert f"{key} =" in text, f"{section}.{key} is missing from the example"


# --- deploy/compose.yaml: two nodes, nginx, PostgreSQL, Redis ---------------------------

COMPOSE = DEPLOY / "compose.yaml"
NODES = ("node1", "node2")


def _compose() -> dict[str, Any]:
    import yaml
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _interpolated(value: str) -> str:
    """`value` with compose's `${NAME:?message}` references set as `.env` would,
    once its `change-me` placeholders are replaced as the example says (the
    service refuses the placeholder cookie secret: test_settings.py)."""
    example = {name: (f"{name.lower()}-{'k9' * 20}" if "change-me" in raw else raw)
               for name, raw in (line.split("=", 1) for line in
                                 (DEPLOY / "compose" / "env.example").read_text().splitlines()
                                 if line and not line.startswith("#"))}
    return re.sub(r"\$\{(\w+)(?::?[?-][^}]*)?\}", lambda m: example[m.group(1)], value)


def _volume(service: dict[str, Any], target: str) -> str:
    """What `service` mounts at `target`."""
    for volume in map(str, service["volumes"]):
        source, _, rest = volume.partition(":")
        if rest.split(":")[0] == target:
            return source
    raise AssertionError(f"nothing is mounted at {target}")


def _mounted(service: dict[str, Any], target: str) -> Path:
    """The file of this directory that `service` mounts at `target`."""
    source = _volume(service, target)
    assert source.startswith("./"), source
    return DEPLOY / source


def test_compose_runs_two_nodes_behind_nginx_on_postgresql_and_redis() -> None:
    services = _compose()["services"]
    assert set(services) == {"migrate", *NODES, "nginx", "postgres", "redis"}
    for name in (*NODES, "migrate"):
        node = services[name]
        assert node["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
        assert (DEPLOY.parent / node["build"]["dockerfile"]).is_file()
        assert "ports" not in node            # reached through nginx only
    assert services["migrate"]["command"] == ["db", "upgrade"]
    for name in NODES:
        node = services[name]
        assert node["command"] == ["serve"]
        assert node["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
        assert node["stop_signal"] == "SIGTERM"
        # Room for the 30 s drain, as the systemd unit leaves.
        assert int(node["stop_grace_period"].rstrip("s")) > 30
    # Each node its own journal volume: two nodes never share one.
    journals = {_volume(services[name], "/var/lib/logic") for name in NODES}
    assert len(journals) == 2
    assert services["nginx"]["ports"] == ["443:443"]
    assert [k for k, s in services.items() if "ports" in s] == ["nginx"]
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["redis"]["image"].startswith("redis:")



def test_compose_node_configuration_loads_and_shares_postgresql_and_redis(tmp_path: Path) -> None:
    from service.settings import ServerSettings, SettingsError
    compose = _compose()
    node = compose["services"]["node1"]
    env = {k: _interpolated(str(v)) for k, v in node["environment"].items()}
    config = _mounted(node, env["LOGIC_CONFIG"])
    assert "password" not in config.read_text().lower()   # secrets come from .env only
    path = config
    if "processes" not in {f.name for f in dataclasses.fields(ServerSettings)}:
        # `serve --processes` (server.processes) is not in this tree yet:
        # everything else in the file must load already.
        with pytest.raises(SettingsError, match="processes"):
            load_settings(str(config), env={})
        path = tmp_path / "logic.toml"
        path.write_text(re.sub(r"(?m)^processes = .*$", "", config.read_text()))
    settings = load_settings(str(path), env={k: v for k, v in env.items() if k != "LOGIC_CONFIG"})
    if path == config:
        assert settings.server.processes == 2  # type: ignore[attr-defined]
    assert settings.database.url.startswith("postgresql://logic:")
    assert settings.database.url.endswith("@postgres:5432/logic")
    assert settings.ratelimit.storage == "redis://redis:6379/0"
    assert settings.server.cookie_secret and settings.server.base_url.startswith("https://")
    assert settings.server.port == 8080 and settings.server.host == "0.0.0.0"
    nginx_ip = compose["services"]["nginx"]["networks"]["default"]["ipv4_address"]
    assert any(ipaddress.ip_address(nginx_ip) in net for net in settings.server.trusted_proxies)
    subnet = compose["networks"]["default"]["ipam"]["config"][0]["subnet"]
    assert ipaddress.ip_address(nginx_ip) in ipaddress.ip_network(subnet)
    assert settings.records.journal == "/var/lib/logic/journal"
    assert all(_volume(compose["services"][n], "/var/lib/logic") for n in NODES)


def _server_block(text: str) -> str:
    """The `server {}` block without its name and certificate lines, and the
    http-level directives before it (maps, limit_conn_zone, log_format)."""
    upstream = text.index("upstream logic_endpoints {")
    block = text[text.index("\n}\n", upstream) + 3:]
    return re.sub(r"(?m)^\s*(server_name|ssl_certificate\S*)\s[^;]*;\n", "", block)


def test_compose_nginx_is_the_shipped_nginx_conf_with_both_nodes_upstream() -> None:
    compose = _compose()
    nginx = compose["services"]["nginx"]
    conf = _mounted(nginx, "/etc/nginx/conf.d/default.conf").read_text()
    upstream = conf[conf.index("upstream logic_endpoints {"):conf.index("}")]
    servers = re.findall(r"(?m)^\s*server\s+([^;\s]+)", upstream)
    assert servers == [f"{name}:8080" for name in NODES]
    assert "keepalive" in upstream
    assert _server_block(conf) == _server_block((DEPLOY / "nginx.conf").read_text())
    certs = re.findall(r"ssl_certificate\S*\s+(\S+);", conf)
    assert certs and all(c.startswith("/etc/nginx/certs/") for c in certs)
    assert _volume(nginx, "/etc/nginx/certs") == "./compose/certs"


def test_shipped_nginx_retries_only_where_no_answer_began() -> None:
    # The failover policy docs/deployment.md states: POST is sent again on
    # the invoke path only. test_nginx.py and test_multinode.py show it at work.
    text = (DEPLOY / "nginx.conf").read_text()
    policies = dict(re.findall(r"(?s)location (?:~\*? )?(\S+) \{[^}]*?proxy_next_upstream\s+([^;]*);",
                               text))
    assert policies == {"/endpoints/": "error timeout non_idempotent", "/": "error timeout",
                        '"login[/\\x5C%]"': "error timeout"}
    assert "http_5" not in text and "proxy_intercept_errors" not in text
