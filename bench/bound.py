"""What bounds decode: the cpu kernel beside a sum of the same bytes, in alternating rounds, the best call of each,
with the keys in cache (16 requests of 64 keys, called again and again) and from memory (the op section's decode
case, twice the last-level cache read before each call so that none of it is there; `--scale N`: N times its
lengths). Then the kernel's arithmetic alone: the marginal cost of a key per kv head on one thread between a request of
64 keys and one of 192, two more full tiles of 64 (most of the decode case's), whose K/V (1.5 MiB of fp32, 0.75 of bf16)
a 1-2 MiB L2 holds or nearly, where "in cache" is 4-8 MiB.

    python -m bench.bound                  # one thread, 200 rounds in cache, 20 from memory
    python -m bench.bound --threads 2 --reps 50
    python -m bench.bound --scale 4        # the decode case 4 times as long (300 MB of bf16 K/V)

bench/overlap.c measures how much arithmetic one core hides under its reads from memory, without the kernel.
`--floor` (one thread, a CPU with AVX512-BF16) also times bench/decode_floor.c, a lean loop of the bf16 kernel's
reads, products and softmax, slices and merges (not its results), built here with gcc, in the same rounds from memory
and in the arithmetic's table: as it is, and built with parts of its work switched off or added (FLOOR_PARTS).

Prints ns per (key, kv head), the GB/s of K/V consumed and the kernel's time over the read's; and the share of the read
from memory that the arithmetic alone leaves the kernel, were every read hidden under it.
"""

import argparse
import ctypes
import functools
import glob
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from .run import DECODE_LENS, HKV, HQ, PAGE, Batch, D


def last_level_cache_bytes(default=256 << 20):
    """The size of the CPU's last-level cache (Linux's sysfs), or `default` where the system does not say."""
    sizes = {}
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        level, size = (Path(index, name).read_text().strip() for name in ("level", "size"))
        if size.endswith("K"):
            sizes[int(level)] = int(size[:-1]) << 10
    return sizes[max(sizes)] if sizes else default


def best_seconds(fns, reps, warmup=5, before=None):
    """The fastest of `reps` alternating calls of each function, `before()` (untimed) ahead of each call."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


# bench/decode_floor.c's builds that --floor times: its -D flags (its header says what each switches off or adds).
FLOOR_PARTS = {
    "bench/decode_floor.c": (),
    "no 4 x 4 reductions": ("NO_SCORE_SUMS",),
    "no softmax": ("NO_SOFTMAX",),
    "P V sums kept across passes": ("PV_SUMS_KEPT",),
    "none of those three": ("NO_SCORE_SUMS", "NO_SOFTMAX", "PV_SUMS_KEPT"),
    "none of the three, no products": ("NO_SCORE_SUMS", "NO_SOFTMAX", "PV_SUMS_KEPT", "NO_PRODUCTS"),
    "the next pass's lines prefetched again": ("PREFETCH_AGAIN",),
}


def decode_floor(batch, defines=()):
    """A call of bench/decode_floor.c, built with `defines`, over the batch's bf16 caches: 8 kv heads of 128, 4 query
    rows each."""
    assert (HQ, HKV, D, PAGE) == (32, 8, 128, 16), "bench/decode_floor.c is written for the op section's shape"
    so = Path(tempfile.mkdtemp()) / "decode_floor.so"
    flags = ["-O3", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512bf16"]
    flags += [f"-D{name}" for name in defines]
    subprocess.run(["gcc", *flags, str(Path(__file__).with_name("decode_floor.c")), "-o", str(so), "-lm"], check=True)
    lib = ctypes.CDLL(str(so))
    lib.decode_floor_init()
    block_table = batch.meta[2].to(torch.int32).contiguous()
    lens = batch.meta[1].to(torch.int32).contiguous()
    rows = sum(-(-n // 256) for n in batch.seq_lens) * 32
    partial_out, partial_lse = torch.empty(rows, 128), torch.empty(rows)
    out = torch.empty(len(batch.seq_lens) * 32, 128, dtype=torch.bfloat16)
    ptr = [ctypes.c_void_p(t.data_ptr()) for t in (batch.k_cache, batch.v_cache, block_table)]
    args = (*ptr, ctypes.c_long(block_table.shape[1]), ctypes.c_void_p(lens.data_ptr()), ctypes.c_int(len(lens)))
    args += tuple(ctypes.c_void_p(t.data_ptr()) for t in (partial_out, partial_lse, out))
    call = functools.partial(lib.decode_floor, *args)
    call.buffers = (block_table, lens, partial_out, partial_lse, out)  # alive as long as the call
    return call


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--scale", type=int, default=1, help="the decode case's lengths times this")
    parser.add_argument("--floor", action="store_true", help="bench/decode_floor.c beside bf16 decode from memory")
    args = parser.parse_args(argv)
    if args.floor and (args.threads != 1 or "avx512_bf16" not in Path("/proc/cpuinfo").read_text()):
        parser.error("--floor runs on one thread of a CPU with AVX512-BF16")
    torch.set_num_threads(args.threads)
    print(
        f"| {args.threads} thread(s) | keys | ns per (key, kv head): kernel, read | K/V GB/s: kernel, read "
        "| kernel / read |\n|---|---|---:|---:|---:|"
    )
    evict = torch.ones(2 * last_level_cache_bytes() // 4)
    places = {
        "in cache (16 x 64)": ([63] * 16, args.reps, None),
        "from memory (decode case)": ([n * args.scale - 1 for n in DECODE_LENS], args.reps // 10, evict.sum),
    }
    read_from_memory = {}  # ns per (key, kv head)
    for dtype in (torch.float32, torch.bfloat16):
        for place, (prefixes, reps, before) in places.items():
            batch = Batch(prefixes, [1] * 16, dtype, shuffle_pages=True)
            fns = {"kernel": batch.hybrid(torch.ops.hybrid.decode, "cpu"), "read": batch.read_floor()}
            floor = args.floor and dtype == torch.bfloat16 and before is not None
            if floor:
                fns.update({name: decode_floor(batch, defines) for name, defines in FLOOR_PARTS.items()})
            best = best_seconds(fns, reps, before=before)
            ns = {k: best[k] / (sum(batch.seq_lens) * HKV) * 1e9 for k in fns}
            gbps = {k: batch.kv_bytes / best[k] / 1e9 for k in fns}
            dtype_name = str(dtype).removeprefix("torch.")
            if before is not None:
                read_from_memory[dtype] = ns["read"]
            for name in (k for k in fns if k != "read"):
                label = place if name == "kernel" else f"{place}: {name}"
                print(
                    f"| {dtype_name} | {label} | {ns[name]:.1f}, {ns['read']:.1f} | {gbps[name]:.1f}, "
                    f"{gbps['read']:.1f} | {best[name] / best['read']:.2f} |",
                    flush=True,
                )
    torch.set_num_threads(1)
    # Decode takes at least its arithmetic: were every read hidden under it, shared evenly by the threads, the kernel
    # would still read at most this share of the read.
    print(
        "\n| 1 thread | marginal ns per (key, kv head), 1 x 64 to 1 x 192 keys | the read from memory (ns) x threads / "
        "it: the share decode can reach |\n|---|---:|---:|"
    )
    for dtype in (torch.float32, torch.bfloat16):
        batches = {n: Batch([n - 1], [1], dtype, shuffle_pages=True) for n in (64, 192)}
        fns = {("kernel", n): b.hybrid(torch.ops.hybrid.decode, "cpu") for n, b in batches.items()}
        if args.floor and dtype == torch.bfloat16:
            fns |= {
                (name, n): decode_floor(b, defines) for name, defines in FLOOR_PARTS.items() for n, b in batches.items()
            }
        best = best_seconds(fns, args.reps)
        dtype_name = str(dtype).removeprefix("torch.")
        for name in dict.fromkeys(name for name, _ in fns):
            arithmetic = (best[name, 192] - best[name, 64]) / (128 * HKV) * 1e9
            ceiling = read_from_memory[dtype] * args.threads / arithmetic
            label = dtype_name if name == "kernel" else f"{dtype_name}: {name}"
            print(
                f"| {label} | {arithmetic:.1f} | {read_from_memory[dtype]:.1f} x {args.threads}: {ceiling:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
