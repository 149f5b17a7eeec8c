"""PEFT's module-name patterns (``target_modules`` as a string, ``rank_pattern`` /
``alpha_pattern`` keys), matched as PEFT matches them but only when the match is cheap.

The patterns come from an adapter's adapter_config.json, a hostile file: a key such as
``(a+)+$`` or ``(.*a){20}`` makes Python's backtracking ``re`` run for minutes on one module
name. So a pattern is first checked against a subset whose matching cost is bounded, and
refused by name otherwise; what passes is matched with ``re`` itself, exactly PEFT's way
(peft 0.21: ``re.fullmatch(target_modules, name)`` and
``re.match(rf"(.*\\.)?({key})$", name)``), so the answers are PEFT's.

The subset: literals, ``.``, character classes (``[...]``, ``\\d``, ``\\w``), ``\\.`` and other
escapes, groups and alternation, ``^``/``$``, any quantifier on a single character (``.*``,
``[0-9]+``, ``a{2,3}``), ``?`` on a group without quantifiers inside, and at most
MAX_WIDE_QUANTIFIERS quantifiers that may repeat more than once. Refused: nested quantifiers
(a quantified group that holds a quantifier or a repeated group), backreferences, lookarounds,
conditionals, atomic groups and possessive quantifiers. With k quantifiers a match backtracks
O(n^(k+1)) steps over an n-character module name (peft's own ``(.*\\.)?`` prefix adds one
that only stops at dots), so two keeps a key's match well under a millisecond.
"""

from __future__ import annotations

import re
from functools import lru_cache
from re import _constants as C  # type: ignore[attr-defined]
from re import _parser as P  # type: ignore[attr-defined]
from typing import Any

MAX_PATTERN_CHARS = 512
MAX_WIDE_QUANTIFIERS = 2
# what one quantifier may repeat: one character
_SINGLE = {C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN}
_ANCHORS = {C.AT_BEGINNING, C.AT_BEGINNING_STRING, C.AT_END, C.AT_END_STRING}
_REPEATS = {C.MAX_REPEAT, C.MIN_REPEAT}


class _Refused(Exception):
    pass


def _walk(items: Any, state: dict[str, int]) -> None:
    """Check one parsed sequence; raise _Refused with the construct's name."""
    for op, av in items:
        if op in _SINGLE:
            continue
        if op is C.AT:
            if av not in _ANCHORS:
                raise _Refused("word-boundary anchors are not allowed")
        elif op is C.SUBPATTERN:
            _walk(av[3], state)  # inline flags change no cost: re matches them as PEFT does
        elif op is C.BRANCH:
            for branch in av[1]:
                _walk(branch, state)
        elif op in _REPEATS:
            lo, hi, sub = av
            if hi > 1:
                if len(sub) != 1 or sub[0][0] not in _SINGLE:
                    raise _Refused("a quantifier over a group (nested repetition) is not "
                                   "allowed; only a single character may repeat")
                state["wide"] += 1
                if state["wide"] > MAX_WIDE_QUANTIFIERS:
                    raise _Refused(f"more than {MAX_WIDE_QUANTIFIERS} repeating quantifiers")
            else:  # ? or {0,1}: at most two ways through, if nothing inside repeats
                inner = {"wide": 0}
                _walk(sub, inner)
                if inner["wide"]:
                    raise _Refused("an optional group holding a quantifier is not allowed")
        elif op is C.GROUPREF or op is C.GROUPREF_EXISTS:
            raise _Refused("backreferences and conditionals are not allowed")
        elif op is C.ASSERT or op is C.ASSERT_NOT:
            raise _Refused("lookarounds are not allowed")
        else:  # atomic groups, possessive quantifiers, anything newer
            raise _Refused(f"{str(op).lower()} is not allowed")


@lru_cache(maxsize=1024)
def why_refused(pattern: str) -> str | None:
    """Why ``pattern`` cannot be matched in bounded time (or is no regex); None if it can."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"longer than {MAX_PATTERN_CHARS} characters"
    try:
        parsed = P.parse(pattern, 0)
    except (re.error, RecursionError, OverflowError) as e:
        return f"not a valid regex ({e})"
    try:
        _walk(parsed, {"wide": 0})
    except _Refused as e:
        return str(e)
    return None


@lru_cache(maxsize=4096)
def _compiled(pattern: str, as_key: bool) -> re.Pattern[str]:
    why = why_refused(pattern)  # the pattern alone: the prefix PEFT adds to a key is safe
    if why is not None:  # a caller that did not check first: refuse, never backtrack
        raise ValueError(f"pattern {pattern[:80]!r} is refused: {why}")
    return re.compile(rf"(.*\.)?({pattern})$" if as_key else pattern)


def fullmatch(pattern: str, name: str) -> bool:
    """PEFT's ``target_modules`` string: the whole module name matches."""
    return _compiled(pattern, False).fullmatch(name) is not None


def key_matches(key: str, name: str) -> bool:
    """PEFT's rank_pattern / alpha_pattern key: it matches a dotted suffix of the name."""
    return _compiled(key, True).match(name) is not None
