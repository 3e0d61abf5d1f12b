"""Type stub for the C extension ``sandbox/_typepatch.c``."""
from typing import Any

def set_attribute(type: type, name: str, value: Any) -> None: ...
