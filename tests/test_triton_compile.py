"""The Triton kernels compile for real GPUs (sm_80, sm_90) and fit them, checked without a GPU.

`scripts/triton_resources.py` runs the backend's launch path on CPU tensors with Triton's launcher replaced by a
recorder and specialises every recorded launch as Triton does on a GPU (443 specialisations, 106 of them the state
ops'). Compiled, all of them take 5-7 minutes on 2 cores, so bench/results/triton_resources.md keeps what
compiling each gave, under a hash of the kernel's source and its specialisation; `--check` fails on any launch that
differs from the table's, compiles again a sample of it in a fresh process (no interpreter) to show that its shared
memory is this Triton's and within the limits, and checks the table against each target's limits.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "triton_resources.py"
TABLE = ROOT / "bench" / "results" / "triton_resources.md"


def run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT
    )


def test_kernels_compile_and_fit():
    result = run("--check", TABLE)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert ", 0 failing" in result.stdout and "specialisations compiled again" in result.stdout


def test_a_stale_table_fails(tmp_path):
    """A row whose kernel or specialisation changed (its key), or whose shared memory is not what compiling gives,
    fails the check."""
    lines = TABLE.read_text().splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("| _")]
    changed_key = list(lines)
    cells = changed_key[rows[0]].split(" | ")
    cells[2] = "0" * 12
    changed_key[rows[0]] = " | ".join(cells)
    (tmp_path / "key.md").write_text("\n".join(changed_key) + "\n")
    result = run("--check", tmp_path / "key.md")
    assert result.returncode == 1 and "STALE not in the table: " in result.stdout
    # The largest shared memory of the decode kernel on sm_90 (a row the sample compiles), said to be 16 B more.
    decode = [i for i in rows if lines[i].startswith("| _decode_split_kernel | sm_90 |")]
    largest = max(decode, key=lambda i: int(lines[i].split(" | ")[3]))
    cells = lines[largest].split(" | ")
    cells[3] = str(int(cells[3]) + 16)
    wrong = list(lines)
    wrong[largest] = " | ".join(cells)
    (tmp_path / "wrong.md").write_text("\n".join(wrong) + "\n")
    result = run("--check", tmp_path / "wrong.md")
    assert result.returncode == 1 and "the table says" in result.stdout, result.stdout[-3000:]
