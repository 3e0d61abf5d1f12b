"""Type stub for the C extension ``sandbox/_decimal_signals.c``."""
from typing import Any

def install(context_type: type, view: Any) -> bool: ...
