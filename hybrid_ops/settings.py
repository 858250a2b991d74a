"""The library's two switches, process-wide. Each setter works as a call or, like `torch.set_grad_enabled`, as a
context manager that restores the previous value on exit:

    hybrid_ops.set_validation(True)            # from now on
    with hybrid_ops.set_deterministic(True):   # inside the block only
        ...
"""

import os


def _from_env(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


_enabled = {"validation": _from_env("HYBRID_OPS_VALIDATE"), "deterministic": _from_env("HYBRID_OPS_DETERMINISTIC")}


class _Set:
    """Sets a switch at once; as a context manager, puts the previous value back on exit."""

    def __init__(self, switch: str, enabled: bool):
        self._switch, self._previous = switch, _enabled[switch]
        _enabled[switch] = bool(enabled)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _enabled[self._switch] = self._previous


def set_validation(enabled: bool) -> _Set:
    """Check the metadata's values on every call (default: `HYBRID_OPS_VALIDATE`): block ids in range, lengths
    consistent. Reads them to the host, a sync on CUDA; the torch and cpu backends read them anyway and always check."""
    return _Set("validation", enabled)


def validation_enabled() -> bool:
    return _enabled["validation"]


def set_deterministic(enabled: bool) -> _Set:
    """Batch invariance: a request's output is bit-identical whatever batch it is in (default:
    `HYBRID_OPS_DETERMINISTIC`). The torch backend then attends one request at a time (no batched decode); the
    Triton decode kernel takes its split count from the table's capacity alone, not the batch size; the cpu backend's
    work split never depends on the batch. FlashInfer cannot promise it: its scheduler splits work by the whole batch.
    Same inputs on the same backend are bit-identical either way."""
    return _Set("deterministic", enabled)


def deterministic_enabled() -> bool:
    return _enabled["deterministic"]
