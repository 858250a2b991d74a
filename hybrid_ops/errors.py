"""The error types of hybrid_ops; `except HybridOpsError` catches all of them."""


class HybridOpsError(Exception):
    pass


class HybridInputError(HybridOpsError, ValueError):
    """An argument has the wrong dtype, device, rank, shape or value. The message names the argument."""


class OutOfPagesError(HybridOpsError, RuntimeError):
    """A `PagedKVCache` has no free page left for a request."""
