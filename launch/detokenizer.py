"""Streaming detokenization: turn token ids into text deltas as they are generated.

Decoding one token at a time is wrong in two ways: a byte-level BPE token can hold half of a UTF-8
character (an emoji often spans two or three tokens), and some decoders (SentencePiece) render a
token differently at the start of a string than after another token. So we decode a short
*window* of recent tokens, whose first few tokens are already-emitted context, and emit only the
part of its text that is new and final: trailing U+FFFD replacement characters mean "character
not complete yet" and are held back until a later token completes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launch.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Tokens of already-emitted context kept at the front of the window when it is re-anchored.
_CONTEXT_TOKENS = 6
# Re-anchor once the window holds this many tokens, so each add() decodes O(1) tokens, not O(n).
_MAX_WINDOW_TOKENS = 48


class IncrementalDetokenizer:
    """Text deltas for one request's output tokens.

    The concatenation of every `add()` result plus `finish()` is the output's text as it reads
    after the prompt: `decode(prompt + output)` minus `decode(prompt)`. For byte-level BPE that
    is exactly `decode(output)`; a SentencePiece model's first output word keeps the leading
    space that `decode(output)` alone would strip.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # The prompt's tail is context only: it fixes how the first output token renders.
        self._window: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []
        # Characters of the window's text that are context or already emitted. An incomplete
        # character at the prompt's end is not counted, so the output completes and shows it.
        self._emitted = len(self._decode(self._window).rstrip(_REPLACEMENT))
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, new_ids: Sequence[int]) -> str:
        """Append generated token ids; return the text they make final (may be "")."""
        if not new_ids:
            return ""
        self._window.extend(new_ids)
        text = self._decode(self._window)
        stable_end = len(text.rstrip(_REPLACEMENT))
        delta = ""
        if stable_end > self._emitted:
            delta = text[self._emitted : stable_end]
            self._emitted = stable_end
            self._pieces.append(delta)
        if stable_end == len(text) and len(self._window) > _MAX_WINDOW_TOKENS:
            self._reanchor()
        return delta

    def finish(self) -> str:
        """Flush text held back at the end: a genuine U+FFFD or bytes that never completed."""
        text = self._decode(self._window)
        delta = text[self._emitted :]
        self._emitted = len(text)
        if delta:
            self._pieces.append(delta)
        return delta

    def _reanchor(self) -> None:
        # Only called when nothing is held back, so the kept tail decodes to final text.
        self._window = self._window[-_CONTEXT_TOKENS:]
        self._emitted = len(self._decode(self._window))

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
