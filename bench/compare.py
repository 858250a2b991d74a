"""The cpu backend's kernel of another checkout against this checkout's, side by side in one process.

    python -m bench.compare ../other-checkout                    # this machine's threads, 9 calls a case
    python -m bench.compare ../other-checkout --threads 1 --reps 15 -k fp8   # the cases whose name holds "fp8"

Each kernel builds as the backend builds it (its flags), from its checkout's kernels/cpu/*.cpp but dispatch.cpp (the
dispatcher entry points of two copies cannot both register), with a bare `forward` binding and a name of its own. The
op section's cases on scattered pages, an fp8 (e4m3) copy of each bf16 one and a 4-token verify run through both
kernels' `forward` in turn, call by call, so that both see the same moments of a shared machine. Prints the medians
and this / other; on a loaded machine, read several runs.
"""

import argparse
import hashlib
import math
import os
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

from hybrid_ops.backends import cpu

from .run import DECODE_LENS, OP_CASES, Batch, timeit_side_by_side

THIS = Path(__file__).resolve().parent.parent
_BINDING = """#include <torch/csrc/utils/pybind.h>

#include "paged_attention.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &hybrid_ops::paged_attention); }
"""


def build(checkout: Path, label: str):
    """The kernel of `checkout` as a module named after `label`, built once per source text and place."""
    folder = checkout / "kernels" / "cpu"
    sources = sorted(p for p in folder.glob("*.cpp") if p.name != "dispatch.cpp")
    digest = hashlib.sha1(b"".join(p.read_bytes() + os.fsencode(p) for p in [*sources, *sorted(folder.glob("*.h"))]))
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = Path(root, f"hybrid_ops_compare_{label}_{digest.hexdigest()[:12]}")
    build_dir.mkdir(parents=True, exist_ok=True)
    binding = build_dir / "binding.cpp"
    binding.write_text(_BINDING)
    flags = cpu._CAPABILITY_FLAGS.get(cpu.kernel_capability(), [])
    return cpp_extension.load(
        f"hybrid_ops_compare_{label}",
        [str(p) for p in [*sources, binding]],
        extra_cflags=["-O3", "-fopenmp", f"-I{folder}", *flags],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
    )


def cases(selected):
    """(name, batch, decode?, fp8 caches?) of the cases whose name contains `selected`, one batch at a time: the op
    section's cases and an fp8 copy of each bf16 one, then a 4-token verify."""
    specs = [
        (f"{name} {dtype_name}{', fp8 e4m3 cache' if fp8 else ''}", prefixes, news, dtype, name == "decode", fp8)
        for name, dtype_name, prefixes, news, dtype, _ in OP_CASES
        for fp8 in ((False, True) if dtype == torch.bfloat16 else (False,))
    ]
    specs.append(("verify (4 tokens) bf16", [n - 4 for n in DECODE_LENS], [4] * 16, torch.bfloat16, True, False))
    for name, prefixes, news, dtype, decode, fp8 in specs:
        if selected in name:
            yield name, Batch(prefixes, news, dtype, shuffle_pages=True), decode, fp8


def make_caller(module, kv_args, options):
    """A maker (as `timeit_side_by_side` takes) of a call of `module`'s forward: with every option, or, for a kernel
    from before `tree_mask` (the last), without it (a first call finds which: it stores the k, v every call stores)."""
    try:
        module.forward(*kv_args, *options)
    except TypeError:
        options = options[:-1]
    return lambda: lambda: module.forward(*kv_args, *options)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", type=Path, help="the other checkout (its kernels/cpu/)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("-k", dest="name", default="", help="only the cases whose name contains this")
    args = parser.parse_args(argv)
    kernels = {"other": build(args.other.resolve(), "other"), "this": build(THIS, "this")}
    torch.set_num_threads(args.threads)
    print(f"| case ({args.threads} threads) | other ms | this ms | this / other |\n|---|---:|---:|---:|")
    for name, batch, decode, fp8 in cases(args.name):
        caches = batch.fp8_caches() if fp8 else (batch.k_cache, batch.v_cache, None, None)
        kv_args = (batch.q, batch.k_new, batch.v_new, *caches[:2], *batch.meta)
        # scale, window, logit_cap, sinks, attention_chunk, decode, k_scale, v_scale, tree_mask
        options = (1 / math.sqrt(batch.q.shape[-1]), -1, 0.0, None, -1, decode, *caches[2:], None)
        fns = {label: make_caller(m, kv_args, options) for label, m in kernels.items()}
        times = timeit_side_by_side(fns, args.reps)
        other, this = times["other"] * 1e3, times["this"] * 1e3
        print(f"| {name} | {other:.2f} | {this:.2f} | {this / other:.3f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
