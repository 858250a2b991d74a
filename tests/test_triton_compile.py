"""The Triton kernels compile for real GPUs (sm_80, sm_90) and fit them, checked without a GPU.

`scripts/triton_resources.py` runs the backend's launch path on CPU tensors with Triton's launcher replaced by a
recorder, compiles every recorded launch as Triton specialises it on a GPU (in a fresh process: no interpreter),
and checks shared memory against each target's per-block limit and spills on sm_90 (attention at fp16/bf16 up to
D 128 and over MLA's latent cache, the state ops at every size). 443 specialisations (106 of them the state ops'),
230-510 s on 2 cores shared with other work (a cold Triton cache in a temporary directory).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_compile_and_fit(tmp_path):
    table = tmp_path / "triton_resources.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "triton_resources.py"), "--write", str(table)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert ", 0 failing" in result.stdout
    # The committed table lists the launches this code makes, with their shared memory; register counts may move
    # by a few between runs of ptxas, so they are compared by the limits above, not to the table.
    assert launches(table) == launches(ROOT / "bench" / "results" / "triton_resources.md")


def launches(table):
    """(kernel, target, shared bytes, specialisation, cases) of each row of a resource table."""
    rows = [line.split(" | ") for line in table.read_text().splitlines() if line.startswith("| _")]
    return [(r[0], r[1], r[2], *r[5:]) for r in rows]
