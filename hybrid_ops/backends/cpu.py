"""The native CPU backend ("cpu"): the C++ kernels of `kernels/cpu/` (entry: `paged_attention.cpp`).

One call stores the new k, v and attends, reading the pages where they lie (no gather), split across the threads
of `at::parallel_for`; the caches in q's dtype, or fp8 with their scales (`options`: "fp8_kv"). The kernels build at
first use with `torch.utils.cpp_extension` (g++ or clang, and ninja) into torch's extension directory, for the vector
instructions ATen detected on this machine (`torch.backends.cpu.get_cpu_capability()`: DEFAULT, AVX2 or AVX512), so a
build never uses instructions the CPU lacks; later processes load the cached library (one per source text). Where
ATen's capability is AVX512, the build adds the extensions the CPU also reports (`kernel_capability()`): VBMI
(AVX512_VBMI: Ice Lake and later, Zen 4 and later; the `avx512vbmi` flag of /proc/cpuinfo), which widens fp8 caches
by byte look-ups, and BF16 (AVX512_BF16: Cooper Lake, Sapphire Rapids and later, Zen 4 and later; `avx512_bf16`), whose
decode multiplies bf16 caches in bf16 pairs; AVX512_VBMI_BF16 with both. `ATEN_CPU_CAPABILITY=avx2` or `default`
still forces those builds. The module's `FP8_WIDE_VECS` says which widening it compiled (4: look-ups, 1: shifts), and
`BF16_PAIRS` whether it multiplies pairs. Without a compiler, "auto" warns once and takes the torch backend, and
`backend="cpu"` is an error.

The metadata lives on the host, so the kernel checks its values (a tree mask's included) on every call before writing
anything (`checks_values`); on bad values it returns None and `check_metadata_values` names the culprit. A tree
(`tree_mask`) hides the new keys its rows do not name from the same computation, its tokens' positions (prefix +
depth) computed once per call: a causal tree gives the output of none, bit for bit.

The state ops (`hybrid_ops.state_ops`: "causal_conv1d", "gated_delta_rule", "selective_scan") run their kernels
(`kernels/cpu/state_ops.h`) as one call over the batch's requests, split across the threads by (request, head),
(request, block of 16 heads) for Mamba1's one-channel heads, or (request, block of channels); they too check the
metadata's values before writing anything, and on bad values `check_state_metadata_values` names the culprit.

Loading the kernels also registers their C++ entry points with the dispatcher (`kernels/cpu/dispatch.cpp`): from
then on, `torch.ops.hybrid.*` calls on CPU tensors that this backend serves skip Python entirely, and the others go
to the ops' Python implementation. The backend that loaded them subscribes to the registry
(`CpuBackend.configure_entry_points`) and tells them, on every change, which backend names they answer to.
"""

import hashlib
import importlib.util
import os
import sys
import time
import warnings
from importlib import resources
from pathlib import Path

import torch
from torch._appdirs import user_cache_dir

from ..check_rows import FLOAT_DTYPES
from ..errors import HybridInputError
from ..modes import ROUTING, SPECULATIVE_ATTENTION_MODES
from ..options import cpp_header as options_header
from ..validation import check_metadata_values, check_state_metadata_values, values_header
from ..validation import cpp_header as checks_header
from .base import STATE_OPS, Backend
from .registry import registry

# ATen's compile flags for each CPU capability (cmake/Codegen.cmake); at::vec picks its implementation from the
# CPU_CAPABILITY_* macro.
_CAPABILITY_FLAGS = {
    "DEFAULT": [],
    "AVX2": [
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mbmi",
        "-mbmi2",
        "-mlzcnt",
        "-DCPU_CAPABILITY=AVX2",
        "-DCPU_CAPABILITY_AVX2",
    ],
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-mf16c",
        "-mbmi",
        "-mbmi2",
        "-mlzcnt",
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
    ],
}
# The AVX512 build's extensions, each taken where the CPU reports its /proc/cpuinfo flag, in the build's name in this
# order: fp8 widened by byte look-ups (VBMI, kernels/cpu/fp8.h), and decode's bf16 scores as products of bf16 pairs
# (BF16, kernels/cpu/attend_inplace.cpp).
_AVX512_EXTENSIONS = {"VBMI": ("avx512vbmi", "-mavx512vbmi"), "BF16": ("avx512_bf16", "-mavx512bf16")}


def capability_flags(capability: str) -> list[str]:
    """The compile flags of a build (`kernel_capability()`): ATen's for its level, and its extensions'."""
    level, *extensions = capability.split("_")
    return [*_CAPABILITY_FLAGS[level], *(_AVX512_EXTENSIONS[e][1] for e in extensions)]


# modes.ROUTING for the C++ entry points: (forward_mode, speculative_attention_mode, routed to decode?).
_ROUTES = [
    (int(mode), spec, paths[i] == "decode")
    for mode, paths in ROUTING.items()
    for i, spec in enumerate(SPECULATIVE_ATTENTION_MODES)
]


def _files(suffix: str) -> list[str]:
    """The files of kernels/cpu/ that end in `suffix`, sorted: every .cpp is compiled, every .cpp and .h hashed."""
    folder = resources.files("hybrid_ops.kernels").joinpath("cpu")
    return sorted(str(f) for f in folder.iterdir() if f.name.endswith(suffix))


def cpuinfo_field(name: str) -> str:
    """The first CPU's `name` field of /proc/cpuinfo ("flags", "vendor_id"); "" where there is none (elsewhere than
    Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == name), "")
    except OSError:
        return ""


def kernel_capability() -> str:
    """The build the kernels take here: ATen's CPU capability, and where it is AVX512, the extensions of
    `_AVX512_EXTENSIONS` that the CPU has (AVX512, AVX512_VBMI, AVX512_BF16 or AVX512_VBMI_BF16)."""
    aten = torch.backends.cpu.get_cpu_capability()
    if aten != "AVX512":
        return aten
    flags = set(cpuinfo_field("flags").split())
    return "_".join([aten, *(name for name, (flag, _) in _AVX512_EXTENSIONS.items() if flag in flags)])


def build():
    """Compile (or load the cached) extension module; prints a line while a build runs."""
    capability = kernel_capability()
    flags = capability_flags(capability)
    name = f"hybrid_ops_cpu_{capability.lower()}"
    sources = _files(".cpp")
    # One directory per source text (the generated headers included) and place: checkouts that share the build root
    # never load each other's kernels, nor rebuild in turn (ninja's build file names the sources' paths).
    files = sources + _files(".h")
    headers = {
        "options.h": options_header().encode(),
        "checks.h": checks_header().encode(),
        "value_checks.h": values_header().encode(),
    }
    digest = hashlib.sha1(
        b"".join(Path(p).read_bytes() + os.fsencode(os.path.abspath(p)) for p in files) + b"".join(headers.values())
    )
    # cpp_extension's build root (`get_default_build_root`), without importing it.
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.realpath(user_cache_dir("torch_extensions"))
    build_dir = os.path.join(root, f"{name}_torch{torch.__version__.replace('+', '_')}_{digest.hexdigest()[:12]}")
    os.makedirs(os.path.join(build_dir, "generated"), exist_ok=True)
    for file_name, header in headers.items():
        generated = Path(build_dir, "generated", file_name)
        if not generated.exists() or generated.read_bytes() != header:  # a new mtime: ninja would rebuild includers
            generated.write_bytes(header)
    library = os.path.join(build_dir, f"{name}.so")
    # Built (the directory is this source text's, and a build in progress holds cpp_extension's lock file until it
    # has linked): loaded directly, as cpp_extension would, without importing cpp_extension (setuptools), which costs
    # a new process about a second.
    if os.path.exists(library) and not os.path.exists(os.path.join(build_dir, "lock")):
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    fresh = not os.path.exists(library)
    if fresh:
        print(
            f"hybrid_ops: building the native CPU kernels ({capability}) into {build_dir}, once...",
            file=sys.stderr,
            flush=True,
        )
    from torch.utils import cpp_extension

    start = time.perf_counter()
    module = cpp_extension.load(
        name,
        sources,
        extra_cflags=["-O3", "-fopenmp", *flags],
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[os.path.join(build_dir, "generated")],
        build_directory=build_dir,
    )
    if fresh:
        print(f"hybrid_ops: built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return module


class CpuBackend(Backend):
    name = "cpu"
    requirement = "a C++ compiler and ninja to build its kernels (pip install ninja)"
    checks_values = True  # the kernels check the metadata's values before they write anything (see `prefill`)
    features = frozenset({"sinks", "attention_chunk", "fp8_kv", "tree_mask", *STATE_OPS})

    def __init__(self):
        self._module = None
        self._error = None

    @property
    def loaded(self) -> bool:
        return self._module is not None

    def is_available(self) -> bool:
        if self._module is None and self._error is None:
            try:
                self._module = build()
            except Exception as e:  # no compiler, no ninja, a failed build: any of them means the torch backend
                self._error = e
                last_line = (str(e).strip().splitlines() or [""])[-1]
                warnings.warn(
                    f"hybrid_ops: the cpu backend's kernels could not be built ({type(e).__name__}: "
                    f"{last_line}); 'auto' uses the torch backend on the CPU",
                    stacklevel=2,
                )
            else:
                # The entry points stay registered for the process: from now on, every registry change configures them.
                registry.subscribe(self.configure_entry_points)
        return self._module is not None

    def configure_entry_points(self, registry) -> None:
        """Tell the C++ entry points which backend names they serve: "cpu" while the backend registered under it has
        its kernels loaded, and "auto" while "auto" also tries it first on the CPU; and every valid name (the other
        backend of an `attn` call must be one). With no names, every call goes through Python."""
        backend = registry.lookup("cpu")
        names = []
        if isinstance(backend, CpuBackend) and backend.loaded:
            names = ["cpu", "auto"] if registry.auto_order("cpu")[0] == "cpu" else ["cpu"]
        self._module.configure(_ROUTES, names, ["auto", *registry.names()])

    def supports(self, spec) -> bool:
        return spec.device.type == "cpu" and spec.dtype in FLOAT_DTYPES

    def prefill(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options, decode=False):
        metadata = (cu_seqlens_q, seq_lens, block_table)
        out = self._module.forward(q, k, v, k_cache, v_cache, *metadata, **options.keywords(), decode=decode)
        if out is None:
            sizes = (q.shape[0], k_cache.shape[0], k_cache.shape[1], decode)
            check_metadata_values(*metadata, *sizes, options.tree_mask)
            raise HybridInputError(
                "the metadata's values are inconsistent (cu_seqlens_q, seq_lens, block_table, tree_mask)"
            )
        return out

    def decode(self, *args):
        return self.prefill(*args, decode=True)

    # The state ops' entry points take the step's fields in StateMetadata's order, after the op's tensors.
    def causal_conv1d(self, x, weight, bias, conv_state, step, activation):
        out = self._module.causal_conv1d(x, weight, bias, conv_state, *step, activation=activation)
        return self._state_output(out, step, x.shape[0], conv_state.shape[0])

    def gated_delta_rule(self, q, k, v, g, beta, state, step, scale):
        out = self._module.gated_delta_rule(q, k, v, g, beta, state, *step, scale=scale)
        return self._state_output(out, step, q.shape[0], state.shape[0])

    def selective_scan(self, x, dt, A, B, C, state, step, D, z, dt_bias, dt_softplus, dt_min, dt_max):
        options = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max)
        out = self._module.selective_scan(x, dt, A, B, C, state, *step, **options)
        return self._state_output(out, step, x.shape[0], state.shape[0])

    @staticmethod
    def _state_output(out, step, num_tokens, num_slots):
        """A state kernel's output; None (bad metadata values, nothing written): the error that names the value."""
        if out is None:
            verify_len = step.intermediate_states.shape[1] if step.verify else None
            check_state_metadata_values(*step[:3], num_tokens, num_slots, step.decode, step.tree_mask, verify_len)
            raise HybridInputError(
                "the metadata's values are inconsistent (cu_seqlens_q, seq_lens, state_slots, tree_mask, "
                "intermediate_states)"
            )
        return out
