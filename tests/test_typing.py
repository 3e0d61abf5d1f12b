"""The package code type-checks under `mypy --strict` (setup.cfg [mypy])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_packages_pass_strict_mypy() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy", "service", "sandbox", "models"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
