"""The Triton kernels and the cpu backend's C++ sources, installed as `hybrid_ops.kernels`."""

if __name__ == "kernels":
    # Python run from the repository's root finds this folder first as the top-level `kernels`, which is the PyPI
    # package of that name that transformers imports: load that package in this module's place.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    )
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels' (the repository's kernels/ is hybrid_ops.kernels)")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
