"""The backend registry: one place maps a backend name to the `Backend` object that runs it.

"auto" tries the preferred backends (`register(..., prefer=True)`, newest first), then a fixed order per device type,
and takes the first that is available and supports the call's `Spec` (device, dtypes, head dims, features). Listeners
subscribed with `subscribe` hear of every change (the cpu backend's C++ entry points keep their own copy of the names
they serve).
"""

from ..errors import HybridInputError

# On the CPU: the native kernels (built at first use), else the torch backend; Triton runs there only in its (slow,
# debugging) interpreter.
AUTO_ORDER = {"cuda": ("flashinfer", "triton", "torch"), "cpu": ("cpu", "torch")}
AUTO_ORDER_OTHER_DEVICES = ("torch",)


class Registration:
    """What `Registry.register` returns: used as a context manager, it undoes the registration on exit (the backend
    it replaced, if any, comes back), which is how tests install a backend for a while."""

    def __init__(self, registry, name, replaced, was_preferred):
        self._registry, self._name, self._replaced, self._was_preferred = registry, name, replaced, was_preferred

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._replaced is None:
            self._registry.unregister(self._name)
        else:
            self._registry.register(self._replaced, prefer=self._was_preferred)


class Registry:
    def __init__(self):
        self._backends = {}
        self._preferred = []  # names "auto" tries first on every device, newest first
        self._auto = {}  # Spec -> the backend "auto" picked
        self._listeners = []

    def register(self, backend, prefer: bool = False) -> Registration:
        """Register `backend` under `backend.name` (replacing one of that name); with `prefer=True`, "auto" tries
        it first on every device."""
        name = backend.name
        registration = Registration(self, name, self._backends.get(name), name in self._preferred)
        self._backends[name] = backend
        if name in self._preferred:
            self._preferred.remove(name)
        if prefer:
            self._preferred.insert(0, name)
        self._changed()
        return registration

    def unregister(self, name: str) -> None:
        self.check_name(name, "name")
        del self._backends[name]
        if name in self._preferred:
            self._preferred.remove(name)
        self._changed()

    def subscribe(self, listener) -> None:
        """Call `listener(registry)` now and after every change."""
        self._listeners.append(listener)
        listener(self)

    def _changed(self):
        self._auto.clear()
        for listener in self._listeners:
            listener(self)

    def lookup(self, name: str):
        """The backend registered as `name`, or None."""
        return self._backends.get(name)

    def auto_order(self, device_type: str):
        """The names "auto" tries on `device_type`, in order."""
        order = AUTO_ORDER.get(device_type, AUTO_ORDER_OTHER_DEVICES)
        return [*self._preferred, *(n for n in order if n not in self._preferred)]

    def for_captured_steps(self, name: str, device_type: str) -> str:
        """The backend a step captured whole in a CUDA graph runs for `name`: `name` itself, or for "auto" the first
        of the device's order that is available and plans nothing on the host (FlashInfer plans every step)."""
        if name != "auto":
            return name
        for candidate in self.auto_order(device_type):
            backend = self._backends.get(candidate)
            if backend is not None and backend.is_available() and not backend.plans_on_host:
                return candidate
        raise HybridInputError(f"'auto' found no backend on {device_type} that a captured step can run")

    def names(self, available: bool = False):
        """The registered backends' names; with `available=True`, only those whose requirement is installed."""
        return sorted(name for name, b in self._backends.items() if not available or b.is_available())

    def check_name(self, name: str, arg: str = "backend") -> None:
        if name != "auto" and name not in self._backends:
            raise HybridInputError(f"{arg} must be 'auto' or one of {self.names()}, got {name!r}")

    def get(self, name: str, spec=None, arg: str = "backend"):
        """The backend that serves `name` for a call of `spec` (`base.Spec`); raises `HybridInputError` naming `arg`
        when that backend is not registered, not installed or does not serve it. Without a spec: the backend
        registered as `name` (not "auto"), its requirement installed and, for kernels built at first use, built."""
        if name == "auto":
            if spec is None:
                raise HybridInputError(f"{arg}='auto' names a backend only for a call: pass its Spec")
            backend = self._auto.get(spec)
            if backend is None:
                backend = next(
                    (
                        b
                        for b in map(self._backends.get, self.auto_order(spec.device.type))
                        if b is not None and b.is_available() and b.supports(spec) and spec.features <= b.features
                    ),
                    None,
                )
                if backend is None:
                    raise HybridInputError(
                        f"{arg}='auto' found no backend for {_describe(spec)} and {sorted(spec.features)} "
                        f"(registered: {self.names()})"
                    )
                self._auto[spec] = backend
            return backend
        self.check_name(name, arg)
        backend = self._backends[name]
        if not backend.is_available():
            raise HybridInputError(f"{arg}={name!r} needs {backend.requirement}, which is not installed")
        if spec is None:
            return backend
        if not backend.supports(spec):
            raise HybridInputError(f"{arg}={name!r} does not support {_describe(spec)}")
        if not spec.features <= backend.features:
            raise HybridInputError(
                f"{arg}={name!r} does not support {', '.join(sorted(spec.features - backend.features))}: "
                "use the torch backend or 'auto'"
            )
        return backend


def _describe(spec) -> str:
    """The call a `Spec` describes, for error messages."""
    head_dims = f"head dim {spec.head_dim}"
    if spec.v_head_dim != spec.head_dim:
        head_dims = f"head dims D = {spec.head_dim}, Dv = {spec.v_head_dim}"
    cache = f", {spec.cache_dtype} caches" if spec.cache_dtype != spec.dtype else ""
    return f"q on {spec.device} with dtype {spec.dtype}{cache} and {head_dims}"


registry = Registry()
