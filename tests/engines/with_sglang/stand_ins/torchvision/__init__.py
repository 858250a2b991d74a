"""A stand-in for torchvision in the engine tests' environment, where no torchvision fits the CPU torch.

PyPI's torchvision wheels are built for CUDA torch: with torch's CPU wheel, `import torchvision` fails (its C++
operators do not load), and an unpinned `pip install torchvision` replaces the CPU torch with a CUDA one. sglang
imports `torchvision.transforms` at module level for multimodal preprocessing (image resizing and normalisation),
which text-only models and attention never reach. Every name here is a placeholder that raises when called, so a
multimodal path that does run fails loudly instead of computing anything. It has no distribution metadata;
transformers' probes read its version, 0.0, as older than any they need.
"""

from _unavailable import stand_in

__version__ = "0.0"
__getattr__ = stand_in(__name__)
