"""Compiling constraints with xgrammar: the token table once per model, a grammar per key.

Used by the frontend (to refuse a bad schema, regex or grammar before anything is queued) and
by every worker (each compiles the grammars of its own requests), through the bounded cache in
workers/sample/grammar_cache.py. xgrammar's compiler releases the GIL, so a step in progress
keeps its core while a grammar compiles next to it.

The vocabulary comes from the frontend's tokenizer loader (workers/tokenizer.py) given the same
source the frontend uses (EngineConfig.tokenizer, else the model): one loader, so the frontend
and every rank see one table.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import TYPE_CHECKING, Any

from protocol.structured import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:line: ": noise to a client
_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message says what is wrong."""


def tokenizer_info(tokenizer: Any, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's token table for a workers.tokenizer.Tokenizer and a model's logits width.

    A tokenizer larger than the model (a real tokenizer on a small dummy model) is cut to the
    model's width: tokens the model cannot emit need no entry.
    """
    import xgrammar as xgr  # seconds to import: only ever on the compile pool

    backend = tokenizer.backend
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * min(vocab_size, max(vocab.values()) + 1)
    for text, i in vocab.items():
        if i < len(encoded):
            encoded[i] = text
    # special tokens ("<|im_start|>", "<s>") are control, not text: an empty entry keeps
    # xgrammar from ever allowing one inside a string (the stop token is allowed as a stop)
    for i, added in backend.get_added_tokens_decoder().items():
        if added.special and i < len(encoded):
            encoded[i] = ""
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    if "ByteLevel" in decoder:
        vocab_type = xgr.VocabType.BYTE_LEVEL
    elif "ByteFallback" in decoder:
        vocab_type = xgr.VocabType.BYTE_FALLBACK
    else:
        vocab_type = xgr.VocabType.RAW
    eos = tokenizer.eos_token_id
    stops = [eos] if eos is not None and eos < vocab_size else None
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stops)


def load_tokenizer_info(source: str, vocab_size: int) -> xgr.TokenizerInfo:
    """The token table of a tokenizer source (directory, .gguf, or model name)."""
    from workers.tokenizer import load_tokenizer  # the one loader the frontend uses

    tok = load_tokenizer(source)
    if tok is None:
        raise GrammarError(
            f"structured outputs need a tokenizer: {source!r} has none "
            "(pass tokenizer=... / --tokenizer with a tokenizer directory or .gguf file)"
        )
    return tokenizer_info(tok, vocab_size)


def compile_constraint(
    compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams
) -> xgr.CompiledGrammar:
    """Compile one constraint; GrammarError names what is wrong with it."""
    kind = spec.kind()
    try:
        if kind == "json":
            assert isinstance(spec.json, str)
            json.loads(spec.json)  # a clearer message than the compiler's for broken JSON
            return compiler.compile_json_schema(spec.json, any_whitespace=False)
        if kind == "json_object":
            # an object, not any JSON value (the builtin JSON grammar also takes arrays)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            assert spec.regex is not None
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            assert spec.choice is not None
            rule = " | ".join(json.dumps(c) for c in spec.choice)
            return compiler.compile_grammar(f"root ::= {rule}")
        assert spec.grammar is not None
        return compiler.compile_grammar(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        text = str(e).strip()
        first = _LOCATION.sub("", text.splitlines()[0]) if text else type(e).__name__
        raise GrammarError(f"invalid structured_outputs.{kind}: {first}") from None


def hold_until_file(path: str, limit_s: float = 120.0) -> None:
    """TEST-ONLY slow compile (TANDEM_TEST_GRAMMAR_HOLD=path on the workers): a compile waits
    until ``path`` exists, so a test decides when a grammar is ready without timing."""
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
