"""Placeholders for the names of the stand-ins beside it (torchvision, sgl_kernel): see their docstrings."""


class Unavailable:
    """Any name of a stand-in module: attribute access gives another placeholder (enums such as torchvision's
    `InterpolationMode.BICUBIC` are read at import), a call raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str) -> "Unavailable":
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Unavailable(f"{self._name}.{attribute}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self._name} is unavailable: this environment has a stand-in for its package")

    def __repr__(self) -> str:
        return f"<unavailable {self._name}>"


def stand_in(module_name: str):
    """A module's `__getattr__`: every name of `module_name` is a placeholder."""

    def module_getattr(name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{module_name}.{name}")

    return module_getattr
