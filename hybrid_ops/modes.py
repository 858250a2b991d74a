"""Forward modes and the routing table of `torch.ops.hybrid.attn`.

The values match sglang's `ForwardMode`, so an engine can pass its own mode through unchanged.
"""

import enum

from .errors import HybridInputError

SPECULATIVE_ATTENTION_MODES = ("prefill", "decode")


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill, or chunked prefill over a cached prefix
    DECODE = 2  # one new token per request
    MIXED = 3  # prefill chunks and decode tokens in one batch
    IDLE = 4  # no tokens on this rank (data parallel), T = 0
    TARGET_VERIFY = 5  # the target model checks draft tokens, the same number per request
    DRAFT_EXTEND = 6  # the draft model extends over accepted tokens

    # The group sglang's backend interface asks about; a single mode is a comparison (`mode == ForwardMode.DECODE`).
    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


def check_speculative_attention_mode(speculative_attention_mode: str) -> None:
    if speculative_attention_mode not in SPECULATIVE_ATTENTION_MODES:
        raise HybridInputError(
            f"speculative_attention_mode must be one of {SPECULATIVE_ATTENTION_MODES}, "
            f"got {speculative_attention_mode!r}"
        )


def to_forward_mode(forward_mode: int) -> ForwardMode:
    try:
        return ForwardMode(forward_mode)
    except ValueError:
        valid = ", ".join(f"{m.name}={m.value}" for m in ForwardMode)
        raise HybridInputError(f"forward_mode must be one of {valid}, got {forward_mode!r}") from None


# The routing table, as sglang's `HybridAttnBackend._select_backend`: forward mode -> path, for
# speculative_attention_mode = "prefill" and = "decode".
ROUTING = {
    ForwardMode.EXTEND: ("prefill", "prefill"),
    ForwardMode.DECODE: ("decode", "decode"),
    ForwardMode.MIXED: ("prefill", "prefill"),
    ForwardMode.IDLE: ("decode", "decode"),
    ForwardMode.TARGET_VERIFY: ("prefill", "decode"),
    ForwardMode.DRAFT_EXTEND: ("prefill", "decode"),
}
_PATHS = {
    (int(mode), spec): paths[i] for mode, paths in ROUTING.items() for i, spec in enumerate(SPECULATIVE_ATTENTION_MODES)
}


def select_path(forward_mode: int, speculative_attention_mode: str = "prefill") -> str:
    """ "prefill" or "decode": which backend serves `forward_mode` (a dict lookup on the per-call path)."""
    path = _PATHS.get((forward_mode, speculative_attention_mode))
    if path is None:
        to_forward_mode(forward_mode)
        check_speculative_attention_mode(speculative_attention_mode)
    return path
