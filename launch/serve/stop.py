"""Stop strings, checked on the detokenized text in the frontend (the engine sees token ids).

While streaming, text that could be the start of a stop string is held back until it is known
not to be one, so a client never receives part of a stop string.
"""

from __future__ import annotations


class StopChecker:
    """Feed text deltas in; get back the text that is safe to emit and the stop string hit."""

    def __init__(self, stops: list[str], include_stop_str: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include_stop_str
        # a stop string not yet complete can have at most len - 1 of its characters out
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, delta: str, final: bool = False) -> tuple[str, str | None]:
        """(text to emit now, the stop string that matched or None)."""
        # A match must end inside the new text, so it starts at most hold chars before it.
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            end = best[0] + len(best[1]) if self.include else best[0]
            end = max(end, self.emitted)
            out = self.text[self.emitted : end]
            self.emitted = end
            self.text = self.text[:end]
            return out, best[1]
        safe = len(self.text) if final or not self.stops else len(self.text) - self.hold
        safe = max(safe, self.emitted)
        out = self.text[self.emitted : safe]
        self.emitted = safe
        return out, None
