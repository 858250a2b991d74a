"""Tiny local models for the engines' tests (nothing downloaded): each saved with a word-level tokenizer, and the
greedy ids transformers' own `generate` gives for the prompts."""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, Gemma2Config, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

VOCAB = 96
# Token ids from 3 on (0 pads, 1 and 2 are bos and eos); the second prompt crosses a page of 16 and the window.
PROMPTS = [[(7 * i + 3 * j) % 90 + 3 for j in range(n)] for i, n in enumerate([5, 23, 9])]
# The second prompt again, longer: its first 23 tokens are a radix-cache hit (16 of them with pages of 16).
HIT = PROMPTS[1] + [5, 6, 7]
# Longer than a step's token budget of 16 (chunked prefill) and than a page of 32 with a window of 6.
LONG = [(5 * j) % 90 + 3 for j in range(45)]
NEW_TOKENS = 8
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=128,  # heads of 32: the smallest vLLM's CPU backend takes
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=None,  # no end: every request generates its NEW_TOKENS
    pad_token_id=0,
    tie_word_embeddings=False,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SIZES),
    # Gemma 2: windows of 6 tokens (shorter than the second prompt; sglang's layers pass 5) on every other layer, the
    # others global, and soft-capped logits, over sglang's plain pool. (sglang's Llama, Mistral and Qwen2 ignore a
    # config's sliding_window, so they cannot carry windows here.) sglang's Gemma 2 reads `hidden_act`, which
    # transformers' config calls `hidden_activation` (both are given), and always ties the output to the embeddings.
    "gemma2": lambda: Gemma2Config(
        **{**SIZES, "tie_word_embeddings": True},
        head_dim=32,
        sliding_window=6,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=None,
        query_pre_attn_scalar=32,
        hidden_act="gelu_pytorch_tanh",
    ),  # fmt: skip
}


def save_model(name, directory):
    """A random `name` model of tiny sizes in fp32, with a word-level tokenizer that reads token id i as the word
    "t{i}"."""
    torch.manual_seed(0)
    # Eager attention: transformers' SDPA path leaves out soft-capping.
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").eval()
    model.save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", bos_token="t1", eos_token="t2"
    )
    fast.save_pretrained(directory)
    greedy = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
    ids = []
    with torch.no_grad():
        for prompt in [*PROMPTS, HIT, LONG]:
            out = model.generate(torch.tensor([prompt]), generation_config=greedy)
            ids.append(out[0, len(prompt) :].tolist())
    return ids
