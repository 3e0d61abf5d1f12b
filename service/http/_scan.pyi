"""Type stub for the C extension ``service/http/_scan.c``."""

from typing import Any

def scan(secret: str, lowered: str, facts: tuple[Any, ...], /
         ) -> tuple[bool, bool, bool] | None: ...
