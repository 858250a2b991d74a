import functools
import importlib


@functools.cache
def importable(module: str) -> bool:
    """Whether an optional dependency imports (a backend's `is_available`)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
