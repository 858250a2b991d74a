"""vLLM's tests run in the engines' environment (.ci/run) on vLLM's CPU platform: its compute threads left unbound
(`VLLM_CPU_OMP_THREADS_BIND=nobind`; `auto` keeps a core for its scheduler, and under pytest-xdist two engines run at
once, each with the threads tests/conftest.py gives a worker), and vLLM's caches and sockets in a folder of the
session's own rather than shared places."""

import os
import tempfile

PRIVATE = tempfile.mkdtemp(prefix="vllm_tests_")
for name, value in {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CACHE_ROOT": os.path.join(PRIVATE, "cache"),
    "VLLM_RPC_BASE_PATH": os.path.join(PRIVATE, "rpc"),
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(PRIVATE, "inductor"),
}.items():
    os.makedirs(value, exist_ok=True)
    os.environ.setdefault(name, value)
