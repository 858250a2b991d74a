"""The backend registry: one place maps a backend name to the object that runs it.

A backend has `name`, `requirement` (what `is_available` needs, for the error message), `is_available() -> bool`,
`supports(q) -> bool` (device, dtype, head dim), optionally `options` (the set of "sinks", "attention_chunk",
"v_head_dim" it serves; none without it), optionally `plan(...)` (see `torch.ops.hybrid.plan`) and
`plan_cuda_graph(path, k_cache, cu_seqlens_q, seq_lens, block_table)` (`PhaseBackend`'s capture and replay hooks),
`checks_values` (True if it reads the metadata to the host and checks it itself; otherwise the ops do so in
validation mode), and `prefill` / `decode`, each called as
    fn(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale: float, sliding_window: int,
       logit_cap: float) -> Tensor [T, Hq, Dv] (Dv: v_cache's head dim)
with arguments already checked by `validation.check_args`, plus `sinks=` and `attention_chunk=` keywords when those
are in use (only to a backend whose `options` has them). Each writes the new k, v to the cache, then attends.
Register your own with `register_backend`.
"""

from ..errors import HybridInputError
from .flashinfer import FlashInferBackend
from . import cpu
from .cpu import CpuBackend
from .torch_ref import TorchBackend
from .triton import TritonBackend

_BACKENDS = {}
# "auto" tries these in order, by device type; the first available backend that supports the inputs wins.
# On the CPU: the native kernels (built at first use), else the torch backend; Triton runs there only in its
# (slow, debugging) interpreter.
_AUTO_ORDER = {"cuda": ["flashinfer", "triton", "torch"], "cpu": ["cpu", "torch"]}
_AUTO_OTHER_DEVICES = ["torch"]
_auto_cache = {}


def register_backend(backend, prefer: bool = False) -> None:
    """Register `backend` under `backend.name`; with `prefer=True`, "auto" tries it first on every device."""
    _BACKENDS[backend.name] = backend
    if prefer:
        for order in (*_AUTO_ORDER.values(), _AUTO_OTHER_DEVICES):
            order.insert(0, backend.name)
    _auto_cache.clear()
    update_native_entry_points()


def update_native_entry_points() -> None:
    """The names whose CPU calls the native kernels' C++ entry points run without Python: "cpu" while the backend
    registered under it has its kernels loaded, and "auto" while that backend is also first in the CPU's order."""
    backend = _BACKENDS.get("cpu")
    names = []
    if isinstance(backend, CpuBackend) and backend.loaded:
        names = ["cpu", "auto"] if _AUTO_ORDER["cpu"][0] == "cpu" else ["cpu"]
    cpu.serve(names, ["auto", *_BACKENDS])


def backend_names(available: bool = False):
    """The registered backends' names; with `available=True`, only those whose requirement is installed."""
    return sorted(name for name, b in _BACKENDS.items() if not available or b.is_available())


def check_backend_name(name: str, arg: str = "backend") -> None:
    if name != "auto" and name not in _BACKENDS:
        raise HybridInputError(f"{arg} must be 'auto' or one of {backend_names()}, got {name!r}")


def _serves(backend, features) -> bool:
    return features <= getattr(backend, "options", frozenset())


def get_backend(name: str, q, arg: str = "backend", features: frozenset = frozenset()):
    """The backend object for `name`; "auto" picks the first of `_AUTO_ORDER` that supports `q` and serves
    `features` (see `options` above)."""
    if name == "auto":
        key = (q.device.type, q.dtype, q.shape[-1], features)
        backend = _auto_cache.get(key)
        if backend is None:
            order = _AUTO_ORDER.get(q.device.type, _AUTO_OTHER_DEVICES)
            backend = next(b for b in (_BACKENDS.get(n) for n in order)
                           if b is not None and b.is_available() and b.supports(q) and _serves(b, features))
            _auto_cache[key] = backend
        return backend
    backend = _BACKENDS.get(name)
    if backend is None:
        check_backend_name(name, arg)
    if not backend.is_available():
        raise HybridInputError(f"{arg}={name!r} needs {backend.requirement}, which is not installed")
    if not backend.supports(q):
        raise HybridInputError(
            f"{arg}={name!r} does not support q on {q.device} with dtype {q.dtype} and head dim {q.shape[-1]}")
    if not _serves(backend, features):
        missing = sorted(features - getattr(backend, "options", frozenset()))
        raise HybridInputError(f"{arg}={name!r} does not support {', '.join(missing)}: use the torch backend "
                               f"or 'auto'")
    return backend


register_backend(TorchBackend())
register_backend(TritonBackend())
register_backend(FlashInferBackend())
register_backend(CpuBackend())
