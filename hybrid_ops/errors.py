"""The error types of hybrid_ops; `except HybridOpsError` catches all of them."""

import torch


class HybridOpsError(Exception):
    pass


class HybridInputError(HybridOpsError, ValueError):
    """An argument has the wrong dtype, device, rank, shape or value. The message names the argument."""


class OutOfPagesError(HybridOpsError, RuntimeError):
    """A `PagedKVCache` has no free page left for a request."""


def check_input(cond, message) -> None:
    """Raises `HybridInputError(message())` unless `cond`. Works for plain bools and for the SymBools of the fake
    implementations, where it is a runtime assert, not a guard."""
    if cond is True:  # a plain bool that holds: the real implementations' every call, at no cost
        return
    torch._check_with(HybridInputError, cond, message)
