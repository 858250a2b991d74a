"""hybrid_ops: paged LLM attention as `torch.library` ops that `torch.compile` and CUDA graphs capture whole.

    torch.ops.hybrid.prefill / decode / attn / plan   (schemas in `hybrid_ops.ops`)

Set `HYBRID_OPS_VALIDATE=1` or call `set_validation(True)` to check the metadata's values on every call.
"""

__version__ = "0.1.0"  # pyproject.toml reads it; packages (`package`) record it

from . import ops, state_ops  # noqa: F401  (registers torch.ops.hybrid.*)
from .backends import Backend, backend_names, get_backend, register_backend, unregister_backend
from .cache import PagedKVCache
from .errors import HybridInputError, HybridOpsError, OutOfPagesError
from .generation import GenerationStats, HybridGenerator, SamplingParams, generate, package
from .metadata import ForwardBatch, build_metadata
from .modes import ROUTING, ForwardMode, select_path
from .settings import deterministic_enabled, set_deterministic, set_validation, validation_enabled

__all__ = [
    "Backend",
    "backend_names",
    "build_metadata",
    "deterministic_enabled",
    "ForwardBatch",
    "ForwardMode",
    "generate",
    "GenerationStats",
    "get_backend",
    "HybridGenerator",
    "HybridInputError",
    "HybridOpsError",
    "OutOfPagesError",
    "package",
    "PagedKVCache",
    "SamplingParams",
    "register_backend",
    "ROUTING",
    "select_path",
    "set_deterministic",
    "set_validation",
    "unregister_backend",
    "validation_enabled",
]
