"""Encode/decode with a GGUF's own byte-level BPE vocabulary (GPT-2 style), for tests only."""

from __future__ import annotations

from gguf import GGUFReader


def gguf_bpe_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from tokenizer.ggml.tokens/merges; special tokens kept whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = GGUFReader(path)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Type 3 = control tokens such as <|im_start|>: match them verbatim, never split them.
    specials = [t for t, ty in zip(tokens, types, strict=True) if ty == 3]
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return tok


CHATML_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml_prompt(user: str, system: str = CHATML_SYSTEM) -> str:
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")
