"""Which strings a regular expression's every match must contain, so most log lines skip the search.

A 100-node job's tails are 50,000 lines and the rules hold about 400 patterns; Python's `re` tries
each pattern at each position of each line. Most lines contain none of the words a rule needs (a
rule on "No space left on device" cannot match a line without "no space left on device"), and a
substring test is far cheaper than a search. `required_literals` reads the pattern's parse tree
(the standard library's own parser) for a set of strings one of which every match contains; a rule
with no such set is always searched. The same idea as RE2's and Hyperscan's prefilters.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

try:  # the parser `re` itself uses; private, so a Python without it gets no prefilter (still correct)
    sre: Any = importlib.import_module("re._constants")
    sre_parse: Any = importlib.import_module("re._parser")
    _REPEATS = tuple(getattr(sre, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
                     if hasattr(sre, name))
except ImportError:  # pragma: no cover - Python 3.11+ has both
    sre_parse = None


def _more_selective(a: set[str] | None, b: set[str] | None) -> set[str] | None:
    """Of two sets either of which every match satisfies, the one whose shortest string is longer."""
    if a is None or b is None:
        return a if b is None else b
    return a if min(map(len, a)) >= min(map(len, b)) else b


def _required(items: Any) -> set[str] | None:
    """Strings one of which every match of the parsed sequence `items` contains (None: no such set)."""
    best: set[str] | None = None
    run: list[str] = []
    for op, argument in [*items, (None, None)]:  # a final sentinel ends the last literal run
        if op is sre.LITERAL:
            run.append(chr(argument))
            continue
        if run:
            best = _more_selective(best, {"".join(run)})
            run = []
        if op is sre.SUBPATTERN:
            best = _more_selective(best, _required(argument[-1]))
        elif op is sre.BRANCH:
            branches = [_required(branch) for branch in argument[1]]
            if all(branches):  # every branch needs something: one of those is in every match
                best = _more_selective(best, {s for b in branches if b for s in b})
        elif op in _REPEATS and argument[0] >= 1:
            best = _more_selective(best, _required(argument[2]))
    return best


def _caseless(text: str) -> bool:
    """True when lower-casing the text matches as `re.IGNORECASE` does (ASCII, or characters
    without case such as CJK)."""
    return text.isascii() or all(c.lower() == c.upper() for c in text)


def required_literals(pattern: str) -> tuple[str, ...] | None:
    """Lower-case strings one of which every case-insensitive match of `pattern` contains, or None
    when the pattern requires none (then the line must be searched)."""
    if sre_parse is None:
        return None
    found = _required(sre_parse.parse(pattern, re.IGNORECASE))
    if not found or not all(_caseless(s) for s in found):
        return None
    return tuple(sorted(s.lower() for s in found))


# re.IGNORECASE also matches ASCII i and s to dotless i (U+0131) and long s (U+017F), which
# str.lower() leaves as they are (https://docs.python.org/3/library/re.html#re.IGNORECASE).
_ASCII_FOLDS = str.maketrans({"\u0131": "i", "\u017f": "s"})


def lowered(line: str) -> str:
    """The line as the literals are compared with it: lower case, with IGNORECASE's ASCII folds."""
    return line.lower().translate(_ASCII_FOLDS)


def may_match(literals: tuple[str, ...] | None, lowered_line: str) -> bool:
    """Whether a line (as `lowered` gives it) can match a pattern with these required literals."""
    return literals is None or any(s in lowered_line for s in literals)
