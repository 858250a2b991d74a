"""hybrid_ops: paged LLM attention as `torch.library` ops that `torch.compile` and CUDA graphs capture whole.

    torch.ops.hybrid.prefill / decode / attn   (schemas in `hybrid_ops.ops`)

Set `HYBRID_OPS_VALIDATE=1` or call `set_validation(True)` to check the metadata's values on every call.
"""

from . import ops  # noqa: F401  (registers torch.ops.hybrid.*)
from .backends import backend_names, get_backend, register_backend
from .cache import PagedKVCache
from .errors import HybridInputError, HybridOpsError, OutOfPagesError
from .generate import GenerationStats, HybridGenerator, generate
from .hybrid_backend import AttentionLayer, HybridAttnBackend, PhaseBackend
from .metadata import ForwardBatch, build_metadata
from .modes import ROUTING, ForwardMode, select_path
from .validation import deterministic_enabled, set_deterministic, set_validation, validation_enabled

__all__ = [
    "GenerationStats", "HybridGenerator", "generate", "AttentionLayer", "HybridAttnBackend", "PagedKVCache", "PhaseBackend", "ForwardBatch", "ForwardMode", "ROUTING", "HybridInputError", "HybridOpsError", "OutOfPagesError", "backend_names",
    "build_metadata", "get_backend", "register_backend", "set_deterministic", "deterministic_enabled", "set_validation", "select_path", "validation_enabled",
]
