"""The repository's paths, and its scripts run in a process of their own."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run_script(*args, **kwargs):
    """`python args...` in a process of its own (kwargs: subprocess.run's); its stdout, once it has exited with 0."""
    result = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
