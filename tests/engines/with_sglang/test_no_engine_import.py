"""`import hybrid_ops` imports no engine, even where the engines are installed (their plugins import our modules,
never the reverse)."""

import subprocess
import sys


def test_import_hybrid_ops_imports_no_engine():
    code = "import sys, hybrid_ops; print(sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'vllm'}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
