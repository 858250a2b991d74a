"""Launch configurations: where the kernels run, and their tiles, warps and stages per shape.

The GPU tables were chosen by compiling every supported shape for sm_80 (A100) and sm_90 (H200) and reading
shared memory, registers and spills (`scripts/triton_resources.py`, checked by `tests/test_triton_compile.py`,
table in `bench/results/triton_resources.md`): shared memory within both targets' per-block limit for every shape,
no spills for fp16/bf16 at head dims up to 128 on sm_90, and none for the state ops at any size. The state ops'
tiles are reasoned (registers per thread, programs for a decode batch), not yet timed on a GPU.
"""

from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class Target:
    """Where the kernels run.

    num_sms: decode splits each request's KV range so that the programs fill this many SMs twice over.
    gpu_tiles: the GPU tables below; False takes the interpreter's large tiles (numpy runs a whole tile per step,
        so large tiles are far faster there and change nothing else).
    interpret: Triton's interpreter on the CPU, which computes bf16 dots wrongly: there bf16 is loaded as fp32.
    """

    num_sms: int
    gpu_tiles: bool = True
    interpret: bool = False


INTERPRETER = Target(num_sms=4, gpu_tiles=False, interpret=True)


@dataclass(frozen=True)
class Tiles:
    block_rows: int  # decode: query rows (tokens x heads of a kv group) per program; prefill: tokens per program
    block_n: int  # keys per step of the online softmax
    num_warps: int
    num_stages: int
    block_heads: int = 1  # prefill: heads of a kv group per program (a larger group takes several programs)


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two, at least 16: a 16-bit `tl.dot` needs K >= 16 (the pad is masked)."""
    return max(triton.next_power_of_2(head_dim), 16)


# Up to this head dim (D and Dv) a K row is one block of block_d(D) columns.
ONE_BLOCK_HEAD_DIM = 256
# Past it, rows of D = Dv + a rope part (MLA's latent cache: DeepSeek's 512 + 64) are read as V's padded width
# (at most SPLIT_MAX_DV) and the rest (at most SPLIT_MAX_ROPE): 576 as 512 + 64 rather than padded to 1024.
SPLIT_MAX_DV = 512
SPLIT_MAX_ROPE = 64


def head_blocks(head_dim: int, v_head_dim: int) -> tuple[int, int, int] | None:
    """(BLOCK_D, BLOCK_ROPE, BLOCK_DV) of the attention kernels for D = head_dim and Dv = v_head_dim, or None where no
    table below holds tiles for them.

    q and K rows are read as columns [0, BLOCK_D) and [BLOCK_D, BLOCK_D + BLOCK_ROPE) (BLOCK_ROPE 0: no second
    block), each masked at D, their scores the sum of one `tl.dot` per block; V rows as [0, BLOCK_DV). Past
    ONE_BLOCK_HEAD_DIM only D > Dv is served, with BLOCK_D = BLOCK_DV: then V's columns are K's first block, which
    the kernels read once when V is K's leading columns (a latent cache).
    """
    if max(head_dim, v_head_dim) <= ONE_BLOCK_HEAD_DIM:
        return block_d(head_dim), 0, block_d(v_head_dim)
    block_dv = block_d(v_head_dim)
    rope = head_dim - block_dv
    if v_head_dim >= head_dim or block_dv > SPLIT_MAX_DV or rope > SPLIT_MAX_ROPE:
        return None
    return block_dv, block_d(rope) if rope > 0 else 0, block_dv


# (fp32, head dim up to) -> (row cap, BLOCK_N, warps): decode rows per program are min(next_pow2(rows), cap), >= 16.
# The head dim is max(D, Dv); past 256 the rows are MLA's, D = Dv + rope (`head_blocks`).
DECODE_TILES = {
    (False, 128): (32, 64, 4),
    (False, 256): (16, 32, 4),
    (False, 576): (32, 32, 8),
    (True, 128): (16, 32, 4),
    (True, 256): (16, 32, 8),
    (True, 576): (16, 16, 16),
}
# (fp32, head dim up to) -> (query rows, BLOCK_N, warps): prefill rows = tokens x heads, the heads of a kv group
# (padded to a power of two) or as many as the rows hold, the rest of the group in more programs.
PREFILL_TILES = {
    (False, 64): (128, 64, 4),
    (False, 128): (64, 64, 4),
    (False, 256): (64, 32, 8),
    (False, 576): (32, 32, 8),
    (True, 128): (32, 32, 4),
    (True, 256): (32, 32, 8),
    (True, 576): (16, 16, 16),
}
GPU_STAGES = 2
# The decode reduction holds [splits, columns] fp32 partials per program (4 warps): at most this many, 128 per
# thread, as [64, 256] at D 256. Wider rows (Dv 512 over 64 splits) take more programs, each a block of columns.
REDUCE_ELEMENTS = 64 * 256


def _lookup(table, dtype, head_dim):
    fp32 = dtype == torch.float32
    return next(value for (is_fp32, max_d), value in sorted(table.items()) if is_fp32 == fp32 and head_dim <= max_d)


def decode_tiles(dtype: torch.dtype, head_dim: int, rows: int, target: Target) -> Tiles:
    """Tiles of the split-KV decode kernel for `rows` = q_len x group query rows per (request, kv head).

    Rows beyond the cap go to more programs (a grid axis over row tiles): an uncapped tile of 32+ fp32 rows at
    D 256 needs more shared memory than an A100 block has. At least 16 rows: `tl.dot` needs M >= 16.
    """
    if not target.gpu_tiles:
        return Tiles(max(triton.next_power_of_2(rows), 16), 128, 4, 1)
    cap, block_n, num_warps = _lookup(DECODE_TILES, dtype, head_dim)
    return Tiles(min(max(triton.next_power_of_2(rows), 16), cap), block_n, num_warps, GPU_STAGES)


def prefill_tiles(dtype: torch.dtype, head_dim: int, group: int, target: Target, tree: bool = False) -> Tiles:
    """Tiles of the prefill kernel; `block_rows` tokens x `block_heads` heads per program: next_pow2(group), or the
    table's rows where a group is larger (a program of 128 heads x Dv 512 would hold 256 KB of fp32 outputs). With
    a tree mask, half the keys per step on a GPU: the tree's bits would otherwise make the largest tiles spill
    registers."""
    if target.gpu_tiles:
        rows, block_n, num_warps = _lookup(PREFILL_TILES, dtype, head_dim)
        block_n = block_n // 2 if tree else block_n
        num_stages = GPU_STAGES
    else:
        rows, block_n, num_warps, num_stages = 128, 128, 8 if head_dim > 64 else 4, 1
    block_heads = min(triton.next_power_of_2(group), rows)
    return Tiles(rows // block_heads, block_n, num_warps, num_stages, block_heads)


def reduce_columns(num_splits: int, block_dv: int) -> int:
    """Columns of Dv (padded: block_dv) per program of the decode reduction over num_splits partials."""
    return min(block_dv, REDUCE_ELEMENTS // triton.next_power_of_2(num_splits))


@dataclass(frozen=True)
class StateTiles:
    """Tiles of a state op's kernel (`causal_conv1d`, `gated_delta_rule`, `selective_scan`).

    block_v: the state's columns a program holds: Dv of the gated delta rule (its Dk whole), P of the scan (its N
        whole); the channels of the convolution.
    block_h: heads per program of the scan (several when P is small: Mamba1's P = 1), 1 for the others.
    block_t: tokens per step of the convolution's window over a plain sequence, 1 for the others.
    """

    block_v: int
    block_h: int = 1
    block_t: int = 1
    num_warps: int = 4


# The recurrent kernels hold a state tile in registers across the tokens: about 32 fp32 values per thread for the
# gated delta rule, 8 for the scan (whose loads per element are more), small tiles that give a decode batch enough
# programs to fill the GPU's bandwidth. padded Dk -> (value columns, warps).
DELTA_TILES = {64: (32, 2), 128: (16, 2), 256: (16, 4)}
# padded N -> P-rows (heads x channels) per program, at 4 warps.
SCAN_ROWS = {16: 64, 32: 32, 64: 16, 128: 8, 256: 4}
# The convolution: channels per program, tokens per window step, warps.
CONV_TILES = (64, 16, 4)
# The interpreter: one numpy operation per tile, so tiles as large as this many elements.
INTERPRETER_STATE_ELEMENTS = 1 << 14


def delta_tiles(k_head_dim: int, v_head_dim: int, target: Target) -> StateTiles:
    """Tiles of the gated delta rule: a program holds S[:, block_v columns] of a head's [Dk, Dv] state."""
    block_k, columns = triton.next_power_of_2(k_head_dim), triton.next_power_of_2(v_head_dim)
    if not target.gpu_tiles:
        return StateTiles(block_v=min(columns, max(INTERPRETER_STATE_ELEMENTS // block_k, 1)))
    block_v, num_warps = DELTA_TILES[max(block_k, 64)]
    return StateTiles(block_v=min(block_v, columns), num_warps=num_warps)


def scan_tiles(num_heads: int, head_dim: int, state_size: int, target: Target) -> StateTiles:
    """Tiles of the selective scan: a program holds block_h heads x block_v channels of [P, N] states, N whole.
    Rows left over by a small P (Mamba1's 1) go to more heads."""
    block_n = max(triton.next_power_of_2(state_size), 16)
    rows = INTERPRETER_STATE_ELEMENTS // block_n if not target.gpu_tiles else SCAN_ROWS[block_n]
    block_p = min(triton.next_power_of_2(head_dim), rows)
    return StateTiles(block_v=block_p, block_h=min(rows // block_p, triton.next_power_of_2(num_heads)))


def conv_tiles(channels: int, decode_len: int, target: Target) -> StateTiles:
    """Tiles of the convolution; decode_len: the decode path's tokens per request (a window step needs no more),
    else 0."""
    block_c, block_t, num_warps = CONV_TILES
    if not target.gpu_tiles:
        block_t = 64
        block_c = INTERPRETER_STATE_ELEMENTS // block_t
    if decode_len:
        block_t = min(block_t, triton.next_power_of_2(decode_len))
    return StateTiles(block_v=min(block_c, triton.next_power_of_2(channels)), block_t=block_t, num_warps=num_warps)
