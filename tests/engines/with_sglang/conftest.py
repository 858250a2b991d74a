"""sglang's tests run in the engines' environment (.ci/run), on sglang's CPU platform.

`SGLANG_USE_CPU_ENGINE=1` selects sglang's CPU platform, whose graph runner serves `--enable-torch-compile`. Two
packages that sglang imports have no build for the CPU torch in the package registry, and `stand_ins/` holds a
stand-in for each (their docstrings say what they stand for and why attention never reaches them): torchvision and
sgl_kernel. They come first on the path here and in every process sglang starts.
"""

import os
import sys
from pathlib import Path

STAND_INS = str(Path(__file__).with_name("stand_ins"))
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [STAND_INS, os.environ.get("PYTHONPATH")]))
sys.path.insert(0, STAND_INS)
