"""Packages: the generator's forward step exported with torch.export and compiled by AOTInductor into one .pt2 file,
which a new process serves from with neither the model's code, transformers nor a compile.

`package(model, path, ...)` writes it; `HybridGenerator.from_package(path, ...)` serves from it (`packaged.py`). The
step is `ModelRunner.forward`'s, as a function of tensors only:

    (input_ids [1, T], position_ids [1, T], logits_index [n], forward_mode [] int64 on the CPU, cu_seqlens_q [B + 1],
     seq_lens [B], block_table [B, pages_per_request], k_caches, v_caches, k_scales, v_scales, state_slots [B],
     states) -> logits [n, vocab]

T, B, n and the caches' page count are dynamic within the sizes packaged; the mode is read with `.item()`, so one
program serves every mode; the caches (and fp8 scales) are the caller's, written in place. A hybrid model's states
(every state tensor of its `StatePool`, in order; none for other models, whose state_slots is an empty tensor) are
the caller's too, their slot count dynamic. v_caches holds the layers' that are not latent: an MLA layer's values are
a view of its keys (`cache.LayerShape`), made inside the step. The archive also holds
`extra/hybrid_ops.json` (`packaged.PackageInfo`): what a serving process is checked against.
"""

import dataclasses
import json
import os

import torch

from ..errors import HybridInputError, HybridOpsError
from .cache_manager import paged_cache
from .checks import check_model_sizes
from .packaged import INFO, PackageInfo, config_fields, library_versions, stored_values
from .runner import graph_backends, model_step, step_buckets


class _Step(torch.nn.Module):
    """`ModelRunner._forward` with the mode as a 0-d tensor and the caches as inputs: what torch.export traces."""

    def __init__(self, model, backends, state_counts, layer_shapes):
        super().__init__()
        from ..integrations.transformers import HybridStep

        self.model, self.backends, self.step_type = model, backends, HybridStep
        self.state_counts = state_counts  # states per stateful layer: how the flat list of states nests
        self.layer_shapes = layer_shapes

    def forward(
        self,
        input_ids,
        position_ids,
        logits_index,
        forward_mode,
        cu_seqlens_q,
        seq_lens,
        block_table,
        k_caches,
        v_caches,
        k_scales,
        v_scales,
        state_slots,
        states,
    ):
        nested, start = [], 0
        for count in self.state_counts:
            nested.append(states[start : start + count])
            start += count
        stored = iter(v_caches)
        v_caches = [k[..., : s.v_head_dim] if s.latent else next(stored) for k, s in zip(k_caches, self.layer_shapes)]
        step = self.step_type(
            forward_mode.item(),
            cu_seqlens_q,
            seq_lens,
            block_table,
            k_caches,
            v_caches,
            *self.backends,
            k_scales=k_scales or None,
            v_scales=v_scales or None,
            state_slots=state_slots if nested else None,
            states=nested or None,
        )
        return model_step(self.model, step, input_ids, position_ids, logits_index)


def package(
    model,
    path,
    *,
    max_batch_size: int = 8,
    max_seq_len: int | None = None,
    page_size: int = 16,
    prefill_chunk: int = 256,
    kv_cache_dtype=None,
    prefill_backend: str = "auto",
    decode_backend: str = "auto",
) -> str:
    """Exports `model`'s forward step (embedding to logits, every layer's `hybrid::attn`) with torch.export, compiles
    it with AOTInductor for the model's device and writes one .pt2 file at `path` (a name ending in .pt2) -> path.

    The sizes are `HybridGenerator`'s and bound what a generator serving from the package may use: at most
    `max_batch_size` requests of `max_seq_len` tokens, `prefill_chunk` prompt tokens a step, pages of `page_size`
    tokens; any number of pages. kv_cache_dtype: None (the model's dtype) or an fp8 dtype. On CUDA, "auto" backends
    mean "triton", which CUDA graphs capture. Raises `HybridInputError` naming the model and the reason where the
    step cannot be packaged: a model the generator cannot serve, stateful layers served through `hybrid::mixer`
    (stateful.py: MiniMax, RecurrentGemma, Zaya), a tensor-parallel model, the flashinfer backend (its host-side plan
    has no AOT path), a device other than the CPU or CUDA, or a forward that torch.export or AOTInductor cannot take
    (data-dependent control flow, ...). `HybridGenerator(model, compile=True)` serves those. A hybrid model's states
    are inputs of the step like the caches: a serving process's `StatePool` holds them.
    """
    from torch.export import Dim

    from ..integrations.servable import check_servable
    from ..integrations.transformers import tensor_parallel_group

    model_type = getattr(model.config, "model_type", type(model).__name__)

    def refuse(reason):
        raise HybridInputError(f"{model_type} cannot be packaged: {reason}; serve it with HybridGenerator(model)")

    max_seq_len, kv_cache_dtype = check_model_sizes(
        model, max_seq_len, kv_cache_dtype, max_batch_size=max_batch_size, page_size=page_size,
        prefill_chunk=prefill_chunk,
    )  # fmt: skip
    if not (isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(".pt2")):
        raise HybridInputError(f"path must be a file name ending in .pt2, got {path!r}")
    param = next(model.parameters())
    if param.device.type not in ("cpu", "cuda"):
        refuse(f"it is on {param.device.type}; packages run on the CPU or CUDA")
    if "flashinfer" in (prefill_backend, decode_backend):
        refuse("the flashinfer backend plans each step on the host, which has no AOT path: package with triton")
    if tensor_parallel_group(model) is not None:
        refuse("it is sharded with tp_plan; a package holds one rank's step")
    model.set_attn_implementation("hybrid")
    model.eval()
    layer_shapes, mixers = check_servable(model)
    per_request = [m for m in mixers if m.family is None]
    if per_request:
        name = per_request[0].name
        refuse(f"its layer {name} keeps state through hybrid::mixer, which reads the metadata on the host")
    backends = graph_backends(param.device, True, (prefill_backend, decode_backend))
    pages_per_request = -(-max_seq_len // page_size)
    # Never a page count of 1, which export would specialise.
    num_pages = max_batch_size * pages_per_request + 2
    cache = paged_cache(layer_shapes, max_batch_size, pages_per_request, page_size, num_pages, kv_cache_dtype,
                        param.device, False)  # fmt: skip
    token_counts, batch_sizes = step_buckets(cache, max_batch_size, prefill_chunk)
    max_tokens, max_requests = token_counts[-1], batch_sizes[-1]
    # A hybrid model's states, of a slot count that export does not specialise (not 1).
    state_list = [
        torch.zeros((max_batch_size + 2, *spec.shape), dtype=spec.dtype, device=param.device)
        for mixer in mixers
        for spec in mixer.states
    ]
    example = _example(cache, max_tokens, state_list)
    tokens, requests = Dim("tokens", min=1, max=max_tokens), Dim("requests", min=1, max=max_requests)
    rows, pages = Dim("rows", min=1, max=max_requests), Dim("pages", min=1)
    scales = [None] * len(cache.k_scales or ())
    dynamic_shapes = (
        {1: tokens},
        {1: tokens},
        {0: rows},
        None,
        {0: requests + 1},
        {0: requests},
        {0: requests},
        [{0: pages}] * len(layer_shapes),
        [{0: pages}] * sum(not s.latent for s in cache.layer_shapes),
        scales,
        scales,
        {0: requests} if state_list else None,
        [{0: Dim("slots", min=2)}] * len(state_list),
    )
    state_counts = [len(m.states) for m in mixers]
    try:
        with torch.no_grad():
            exported = torch.export.export(
                _Step(model, backends, state_counts, cache.layer_shapes), example, dynamic_shapes=dynamic_shapes
            )
    except HybridOpsError:
        raise
    except Exception as e:
        refuse(f"torch.export cannot trace its forward step ({type(e).__name__}: {_first_line(e)})")
    info = PackageInfo(
        **library_versions(),
        model_type=model_type,
        config=config_fields(model.config),
        vocab_size=model.config.get_text_config().vocab_size,
        eos_token_id=getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        device=param.device.type,
        dtype=str(param.dtype).removeprefix("torch."),
        cache_dtype=str(kv_cache_dtype).removeprefix("torch."),
        layer_shapes=[list(s) for s in layer_shapes],
        state_shapes=[[[list(s.shape), str(s.dtype).removeprefix("torch.")] for s in m.states] for m in mixers],
        page_size=page_size,
        pages_per_request=pages_per_request,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        prefill_chunk=prefill_chunk,
        backends=list(backends),
    )
    try:
        files = torch._inductor.aot_compile(
            exported.module(check_guards=False), example, options={"aot_inductor.package": True}
        )
    except Exception as e:
        refuse(f"AOTInductor cannot compile its forward step ({type(e).__name__}: {_first_line(e)})")
    from torch.export.pt2_archive._package import package_pt2

    package_pt2(os.fspath(path), aoti_files=files, extra_files={INFO: json.dumps(dataclasses.asdict(info))})
    return os.fspath(path)


def _example(cache, max_tokens, states):
    """The inputs of a step for torch.export to trace: an EXTEND step of two requests, every dynamic size at least
    2 (export specialises sizes 0 and 1); states: a hybrid model's state tensors (none for others)."""
    counts = [1, 1] if max_tokens < 3 else [1, 2]
    for rid in range(2):
        cache.add(rid)
    batch = cache.step([0, 1], counts)
    tokens = sum(counts)
    return (
        torch.zeros(1, tokens, dtype=torch.long, device=cache.device),
        torch.tensor([[0, 0, 1][:tokens]], device=cache.device),
        torch.tensor([0, tokens - 1], device=cache.device),
        torch.tensor(int(batch.forward_mode)),
        *batch.metadata,
        cache.k_caches,
        stored_values(cache),
        cache.k_scales or [],
        cache.v_scales or [],
        torch.tensor([0, 1] if states else [], dtype=torch.int32, device=cache.device),
        states,
    )


def _first_line(error) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]
