"""A package read, checked and served from: `HybridGenerator.from_package` (`load`), in a process that needs neither
the model's code, transformers nor a compile.

A package (`aot.package`) holds the step program AOTInductor compiled and `extra/hybrid_ops.json`, its `PackageInfo`:
the torch and hybrid_ops versions and op schemas it was built with, the model's config, the cache layout and the
sizes. A process whose torch, hybrid_ops or schemas differ, or that names another config or cache dtype, is refused
before the package's code is loaded.
"""

import dataclasses
import json
import os
import zipfile

import torch

from .. import __version__
from ..errors import HybridInputError
from ..ops import SCHEMAS as ATTENTION_SCHEMAS
from ..state import StatePool
from ..state_ops import SCHEMAS as STATE_SCHEMAS
from .cache_manager import num_snapshots, paged_cache, slot_pages
from .checks import is_int
from .runner import StepRunner

FORMAT = 2
SCHEMAS = {**ATTENTION_SCHEMAS, **STATE_SCHEMAS}  # every op a package may call
INFO = "hybrid_ops.json"  # in the archive's extra/ folder
# Config fields that say nothing about the model: where and with which transformers it was saved, and the private
# ones (the attention implementation among them).
_UNCOMPARED = ("transformers_version",)


@dataclasses.dataclass(frozen=True)
class PackageInfo:
    """What a package records. config: the model's `config.to_dict()` (JSON values); dtypes as names
    ("float32"); layer_shapes: each layer's cache (Hkv, D, Dv, latent) (`cache.LayerShape`); state_shapes: each
    stateful layer's states, [shape, dtype name] each (a request's); backends: (prefill, decode) as the ops are
    called."""

    torch: str
    hybrid_ops: str
    schemas: dict
    model_type: str
    config: dict
    vocab_size: int
    eos_token_id: int | list | None
    device: str
    dtype: str
    cache_dtype: str
    layer_shapes: list
    state_shapes: list
    page_size: int
    pages_per_request: int
    max_batch_size: int
    max_seq_len: int
    prefill_chunk: int
    backends: list
    format: int = FORMAT


def library_versions() -> dict:
    """This process's side of what a package must match: torch's and hybrid_ops' versions and the ops' schemas."""
    return {"torch": torch.__version__, "hybrid_ops": __version__, "schemas": SCHEMAS}


def dtype_named(name: str) -> torch.dtype:
    return getattr(torch, name)


def config_fields(config) -> dict:
    """A config (a transformers config or its `to_dict()`) as JSON values, less the fields `_UNCOMPARED` and the
    private ones."""
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    fields = json.loads(json.dumps(fields, default=str))
    return {k: v for k, v in fields.items() if not k.startswith("_") and k not in _UNCOMPARED}


def stored_values(cache) -> list:
    """The cache's v caches but those of latent layers (views of their k caches): what a packaged step takes."""
    return [v for v, shape in zip(cache.v_caches, cache.layer_shapes) if not shape.latent]


class PackagedStep:
    """A loaded package (torch's `AOTIModelPackageLoader`) as a `StepRunner`'s forward (`runner.py`'s step function)
    over `cache`'s tensors and a hybrid model's `states` (a `StatePool`, or None): the inputs flattened in the exported
    order, the mode as a 0-d int64 tensor on the CPU."""

    def __init__(self, loader, cache, states=None):
        self.loader, self.cache, self.states = loader, cache, states
        self.no_slots = torch.zeros(0, dtype=torch.int32, device=cache.device)

    def __call__(self, input_ids, position_ids, logits_index, forward_mode, cu_seqlens_q, seq_lens, block_table,
                 state_slots=None, tree_mask=None):  # fmt: skip
        if tree_mask is not None:
            raise HybridInputError("a package serves steps without a tree_mask")
        cache = self.cache
        inputs = [input_ids, position_ids, logits_index, torch.tensor(forward_mode), cu_seqlens_q, seq_lens]
        inputs += [
            block_table,
            *cache.k_caches,
            *stored_values(cache),
            *(cache.k_scales or ()),
            *(cache.v_scales or ()),
        ]
        inputs += [self.no_slots if state_slots is None else state_slots]
        inputs += [] if self.states is None else self.states.all_states
        return self.loader.boxed_run(inputs)[0]


def read_info(path) -> PackageInfo:
    """The `PackageInfo` a package records, read without loading its code."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith(f"/extra/{INFO}")), None)
            text = archive.read(name) if name else None
    except (OSError, zipfile.BadZipFile) as e:
        raise HybridInputError(
            f"path: cannot read a package at {os.fspath(path)} ({getattr(e, 'strerror', None) or e})"
        ) from e
    if text is None:
        raise HybridInputError(f"path: {path!r} holds no extra/{INFO}: not a package written by hybrid_ops.package")
    fields = json.loads(text)
    if fields.get("format") != FORMAT:
        raise HybridInputError(
            f"path: the package is of format {fields.get('format')!r}, this hybrid_ops reads format {FORMAT}: "
            f"package the model again"
        )
    return PackageInfo(**fields)


def check_info(info: PackageInfo, config=None, kv_cache_dtype=None) -> None:
    """Raises a `HybridInputError` naming the first difference between the package and this process (torch,
    hybrid_ops, the ops' schemas) or, when given, the config the caller serves (a transformers config or its
    `to_dict()`) and the KV cache's dtype."""
    here = library_versions()
    for name in ("torch", "hybrid_ops"):
        if getattr(info, name) != here[name]:
            raise HybridInputError(
                f"path: the package was built with {name} {getattr(info, name)}, this process has {name} "
                f"{here[name]}: package the model again with this one"
            )
    changed = sorted(op for op in info.schemas.keys() | SCHEMAS.keys() if info.schemas.get(op) != SCHEMAS.get(op))
    if changed:
        raise HybridInputError(
            f"path: the package calls the ops {changed} with other schemas than this hybrid_ops defines: package "
            f"the model again"
        )
    if config is not None:
        given = config_fields(config)
        fields = sorted(k for k in given.keys() | info.config.keys() if given.get(k, ...) != info.config.get(k, ...))
        if fields:
            shown = lambda fields, k: repr(fields[k]) if k in fields else "absent"
            differences = "; ".join(
                f"{k}: {shown(info.config, k)} in the package, {shown(given, k)} given" for k in fields[:3]
            )
            raise HybridInputError(f"config: the package was built for another config ({differences})")
    if kv_cache_dtype is not None and kv_cache_dtype != dtype_named(info.cache_dtype):
        raise HybridInputError(
            f"kv_cache_dtype: the package's KV cache is {info.cache_dtype}, got {kv_cache_dtype!r}: package the "
            f"model with kv_cache_dtype={kv_cache_dtype!r}"
        )


def _serving_sizes(info: PackageInfo, **sizes) -> list:
    """Each of `sizes` (None: the package's), at most the package's."""
    values = []
    for name, value in sizes.items():
        packaged = getattr(info, name)
        if value is None:
            value = packaged
        elif not is_int(value, 1):
            raise HybridInputError(f"{name} must be a positive int, got {value!r}")
        elif value > packaged:
            raise HybridInputError(f"{name} ({value}) exceeds the package's {packaged}: package with a larger one")
        values.append(value)
    return values


def load(path, config, kv_cache_dtype, max_batch_size, max_seq_len, prefill_chunk, num_pages, cuda_graphs,
         prefix_caching=False):  # fmt: skip
    """(the package's `PackageInfo`, a `StepRunner` of its step over a new cache, the hybrid model's new `StatePool`
    or None, the pages a slot of it counts as): the arguments as
    `HybridGenerator.from_package`'s, checked (`check_info`) before the package's code is loaded."""
    info = read_info(path)
    check_info(info, config, kv_cache_dtype)
    max_batch_size, max_seq_len, prefill_chunk = _serving_sizes(
        info, max_batch_size=max_batch_size, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk
    )
    if info.device == "cuda" and not torch.cuda.is_available():
        raise HybridInputError("path: the package runs on CUDA, which this process does not have")
    # The C++ loader itself: torch._inductor's Python one (`aoti_load_package`) imports Dynamo, seconds of a new
    # process's start for nothing a package uses. One runner, without the locking that concurrent callers need.
    loader = torch._C._aoti.AOTIModelPackageLoader(os.fspath(path), "model", True, 1, -1)
    shapes = [tuple(s) for s in info.layer_shapes]
    dtype = dtype_named(info.cache_dtype)
    states, state_pages = None, 0
    if info.state_shapes:
        layers = [[(tuple(shape), dtype_named(name)) for shape, name in layer] for layer in info.state_shapes]
        states = StatePool(
            layers, max_batch_size, info.device, num_snapshots=num_snapshots(max_batch_size, prefix_caching)
        )
        state_pages = slot_pages(states, shapes, info.page_size, dtype)
    num_pages = num_pages or max_batch_size * (info.pages_per_request + state_pages)
    cache = paged_cache(shapes, max_batch_size, info.pages_per_request, info.page_size, num_pages, dtype, info.device,
                        cuda_graphs, for_compile=False)  # fmt: skip
    step = PackagedStep(loader, cache, states)
    if cuda_graphs and info.device == "cuda":
        from .graphs import CudaGraphStep

        step = CudaGraphStep(step, cache, info.backends, dtype_named(info.dtype), states)
    return info, StepRunner(step, cache, max_batch_size, max_seq_len, prefill_chunk, cuda_graphs), states, state_pages
