"""The built-in backends, registered at import. `Backend` (base.py) is the contract; the registry (registry.py) maps
names to backends and picks one for "auto".

    torch       plain PyTorch on any device: the reference (torch_ref.py)
    cpu         native C++ kernels for the CPU, built at first use (cpu.py, kernels/cpu/)
    triton      Triton kernels for CUDA; on the CPU only in Triton's interpreter (triton.py, kernels/)
    flashinfer  FlashInfer's paged kernels on CUDA (flashinfer.py)
"""

from .base import Backend, Spec
from .cpu import CpuBackend
from .flashinfer import FlashInferBackend
from .registry import Registration, Registry, registry
from .torch_ref import TorchBackend
from .triton import TritonBackend

register_backend = registry.register
unregister_backend = registry.unregister
backend_names = registry.names
check_backend_name = registry.check_name
get_backend = registry.get

for _backend in (TorchBackend(), TritonBackend(), FlashInferBackend(), CpuBackend()):
    register_backend(_backend)

__all__ = [
    "Backend",
    "backend_names",
    "check_backend_name",
    "CpuBackend",
    "FlashInferBackend",
    "get_backend",
    "register_backend",
    "Registration",
    "Registry",
    "registry",
    "Spec",
    "TorchBackend",
    "TritonBackend",
    "unregister_backend",
]
