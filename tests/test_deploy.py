"""The files under deploy/ stay true to the code."""

from __future__ import annotations

from pathlib import Path

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
