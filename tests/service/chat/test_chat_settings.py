"""`[chat]` settings: defaults, file, environment, and one-line refusals."""
from __future__ import annotations

from pathlib import Path

import pytest

from service.settings import SettingsError, load_settings

KEY = "ab" * 32


def test_defaults_leave_the_chat_command_off() -> None:
    chat = load_settings(None, {}, {}).chat
    assert (chat.public_key, chat.path) == ("", "/interactions")
    assert chat.api_url == "https://discord.com/api/v10" and chat.answer_within_ms == 2000


def test_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "logic.toml"
    path.write_text(f'[chat]\npublic_key = "{KEY.upper()}"\npath = "/chat/interactions"\n')
    chat = load_settings(str(path), {}, {}).chat
    assert chat.public_key == KEY and chat.path == "/chat/interactions"
    chat = load_settings(str(path), {"LOGIC_CHAT_ANSWER_WITHIN_MS": "500"}, {}).chat
    assert chat.answer_within_ms == 500


@pytest.mark.parametrize("key,value,why", [
    ("public_key", "abc", "64 hex"),
    ("public_key", "zz" * 32, "64 hex"),
    ("path", "interactions", "absolute path"),
    ("path", "/endpoints/x", "taken"),
    ("path", "/a b", "absolute path"),
    ("api_url", "ftp://x", "http"),
    ("answer_within_ms", "3000", "0..2500"),
])
def test_bad_values_stop_start_up(key: str, value: str, why: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(None, {f"LOGIC_CHAT_{key.upper()}": value}, {})
    assert f"LOGIC_CHAT_{key.upper()}" in str(err.value) and why in str(err.value)
    assert "\n" not in str(err.value)
