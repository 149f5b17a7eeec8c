"""N-gram (prompt-lookup) draft proposer for speculative decoding.

For a request whose tokens end in n-gram G, find the latest *earlier* place where G occurred
(in the prompt or the output) and propose the tokens that followed it. Longer n-grams are
tried first (max_n down to min_n). Repetitive text (code edits, quoting, lists) gets long runs
of correct drafts for the price of one dictionary lookup per n.

Each request keeps an incremental index, n-gram -> end position of its latest occurrence, that
is extended only by the tokens appended since the last proposal, so a proposal costs O(max_n)
per new token instead of a scan of the whole sequence.
"""

from __future__ import annotations

from engine_core.request import Request


class NgramIndex:
    """n-gram (as a tuple, 1 <= n <= max_n) -> index of its last token, latest occurrence.

    Only occurrences with at least one following token are indexed, so a hit always has a
    continuation to propose and never matches the suffix itself.
    """

    __slots__ = ("max_n", "ends", "num_indexed")

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending at j < num_indexed are in `ends`

    def extend(self, tokens: list[int]) -> None:
        ends = self.ends
        max_n = self.max_n
        # an n-gram ending at j is indexed once token j + 1 exists
        for j in range(self.num_indexed, len(tokens) - 1):
            for n in range(1, min(max_n, j + 1) + 1):
                ends[tuple(tokens[j - n + 1 : j + 1])] = j
        self.num_indexed = max(self.num_indexed, len(tokens) - 1)

    def lookup(self, tokens: list[int], min_n: int, k: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.max_n, length), min_n - 1, -1):
            j = self.ends.get(tuple(tokens[length - n :]))
            if j is not None:
                return tokens[j + 1 : j + 1 + k]
        return []


class NgramProposer:
    def __init__(self, max_n: int, num_speculative_tokens: int, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.max_n = max_n
        self.min_n = min_n
        self.k = num_speculative_tokens

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to min(K, max_drafts) draft tokens for the request's next positions."""
        k = min(self.k, max_drafts)
        if k <= 0:
            return []
        index = request.ngram_index
        if index is None:
            index = request.ngram_index = NgramIndex(self.max_n)
        tokens = request.all_token_ids
        index.extend(tokens)
        return index.lookup(tokens, self.min_n, k)
