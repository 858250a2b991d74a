"""Forward modes and the routing table of `torch.ops.hybrid.attn`.

`ForwardMode` has sglang 0.5.23's values (`sglang.srt.model_executor.forward_batch_info.ForwardMode`), so an engine
passes its own mode through unchanged, and `ROUTING` is what sglang's `HybridAttnBackend._select_backend` picks for
each: DECODE and IDLE go to the decode backend, TARGET_VERIFY to the one `speculative_attention_mode` names, every
other mode to prefill. The design's DRAFT_EXTEND (the draft model extending over the accepted tokens) is sglang's
DRAFT_EXTEND_V2: a ragged causal extend, routed to prefill under either speculative_attention_mode. PREBUILT (a
batch whose KV came from elsewhere: it runs no attention) and DLLM_EXTEND (diffusion models' blocks, which attend
bidirectionally within a block) are refused by name.
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
    DRAFT_EXTEND_V2 = 6  # the draft model extends over the tokens of a verify step, causally
    PREBUILT = 7  # sglang's disaggregated decode: the KV arrived from a prefill server, no forward runs
    SPLIT_PREFILL = 8  # an EXTEND run a few layers at a time (sglang's prefill-decode multiplexing)
    DLLM_EXTEND = 9  # diffusion LLMs: a block of tokens attending to each other in both directions

    # The group sglang's backend interface asks about; a single mode is a comparison (`mode == ForwardMode.DECODE`).
    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


# The modes the ops do not serve, with the reason.
REFUSED_MODES = {
    ForwardMode.PREBUILT: "its batches run no forward (their KV was written by a prefill server)",
    ForwardMode.DLLM_EXTEND: "its blocks attend bidirectionally, which the ops' causal attention does not serve",
}


def check_speculative_attention_mode(speculative_attention_mode: str) -> None:
    if speculative_attention_mode not in SPECULATIVE_ATTENTION_MODES:
        raise HybridInputError(
            f"speculative_attention_mode must be one of {SPECULATIVE_ATTENTION_MODES}, "
            f"got {speculative_attention_mode!r}"
        )


def to_forward_mode(forward_mode: int) -> ForwardMode:
    """`forward_mode` as a served `ForwardMode`; a clear error for a value that is none, or one the ops refuse."""
    try:
        mode = ForwardMode(forward_mode)
    except ValueError:
        valid = ", ".join(f"{m.name}={m.value}" for m in ROUTING)
        raise HybridInputError(f"forward_mode must be one of {valid}, got {forward_mode!r}") from None
    if mode in REFUSED_MODES:
        raise HybridInputError(f"forward_mode {mode.name} ({mode.value}) is not served: {REFUSED_MODES[mode]}")
    return mode


# The routing table, as sglang's `HybridAttnBackend._select_backend`: forward mode -> path, for
# speculative_attention_mode = "prefill" and = "decode".
ROUTING = {
    ForwardMode.EXTEND: ("prefill", "prefill"),
    ForwardMode.DECODE: ("decode", "decode"),
    ForwardMode.MIXED: ("prefill", "prefill"),
    ForwardMode.IDLE: ("decode", "decode"),
    ForwardMode.TARGET_VERIFY: ("prefill", "decode"),
    ForwardMode.DRAFT_EXTEND_V2: ("prefill", "prefill"),
    ForwardMode.SPLIT_PREFILL: ("prefill", "prefill"),
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
