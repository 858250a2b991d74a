"""The Triton kernels and the cpu backend's C++ sources, installed as `hybrid_ops.kernels`."""

if __name__ == "kernels":
    # Python run from the repository's root finds this folder first as a top-level `kernels`, the name of a PyPI
    # package that transformers looks for: that package takes this module's place where installed, and where not an
    # empty namespace package does, which transformers counts as not installed (no version, no file).
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    ) or importlib.machinery.ModuleSpec("kernels", None, is_package=True)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
