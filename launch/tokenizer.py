"""The frontend's tokenizer: the loader lives in workers/tokenizer.py (the ranks' grammar
matchers need the same token table, and workers/ must not import launch/); this module keeps
the frontend's names where its callers import them."""

from __future__ import annotations

from workers.tokenizer import (
    Tokenizer,
    build_byte_level_bpe,
    build_sentencepiece_bpe,
    load_gguf_tokenizer,
    load_tokenizer,
)

__all__ = ["Tokenizer", "build_byte_level_bpe", "build_sentencepiece_bpe",
           "load_gguf_tokenizer", "load_tokenizer"]
