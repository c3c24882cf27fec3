"""SGLang's ``stop_regex``: the output ends where one of the patterns first matches, the match
kept in the text (SGLang trims a stop string, but not a pattern's match).

"First" is by text, not by the pieces it arrives in: the output ends at the shortest prefix of
its text in which a pattern finds a match, so AR decoding (a token at a time) and speculation
(several) end every output at the same character. Matching uses the ``regex`` package
(transformers' own dependency; Python's ``re`` syntax), whose partial matches say where a
match could still begin: text before that is safe to hand out, the rest is held back until it
matches or cannot. Each pattern's search starts there, so a long output is not searched again
from its start at every token, and a push spends at most ``MATCH_BUDGET_S`` matching (a
pattern that backtracks without end fails its request instead of stalling the gateway's event
loop, where the text of every request is read)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import regex

from specctl.errors import BadRequest

MAX_STOP_PATTERNS = 4
MAX_PATTERN_CHARS = 512
# the matching one push may take: it runs on the gateway's event loop, beside every other request
# (a pattern searches a few kilobytes in microseconds; one that backtracks fails its request)
MATCH_BUDGET_S = 0.05


def compile_stop_patterns(patterns: str | Sequence[str] | None) -> tuple[regex.Pattern, ...]:
    """A request's stop_regex (one pattern or a list), checked: at most MAX_STOP_PATTERNS of at
    most MAX_PATTERN_CHARS each, valid, and none that matches the empty text (it would end
    every output before its first character). BadRequest says which and why."""
    given = [patterns] if isinstance(patterns, str) else list(patterns or ())
    if len(given) > MAX_STOP_PATTERNS:
        raise BadRequest(f"at most {MAX_STOP_PATTERNS} stop_regex patterns, got {len(given)}")
    compiled = []
    for pattern in given:
        if not isinstance(pattern, str) or not pattern:
            raise BadRequest("a stop_regex pattern must be a non-empty string")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise BadRequest(f"a stop_regex pattern may be at most {MAX_PATTERN_CHARS} characters, got {len(pattern)}")
        try:
            one = regex.compile(pattern)
        except (regex.error, OverflowError, RecursionError) as exc:
            raise BadRequest(f"stop_regex {pattern!r} is not a valid regular expression: {exc}") from None
        if one.search("") is not None:
            raise BadRequest(f"stop_regex {pattern!r} matches the empty text, so it would end every output before "
                             "it starts: give a pattern that needs at least one character")
        compiled.append(one)
    return tuple(compiled)


@dataclass(slots=True)
class StopMatch:
    found_at: int  # the length of the shortest prefix of the text in which the pattern matches
    end: int  # where its match ends (the text ends there); at most found_at
    pattern: str


@dataclass(slots=True)
class StopPatterns:
    """The patterns' state over one growing output text."""

    patterns: tuple[regex.Pattern, ...]
    checked: int = 0  # every prefix of the text up to this length has been searched
    starts: list[int] = field(default_factory=list)  # per pattern, where a match could still begin

    def __post_init__(self) -> None:
        self.starts = [0] * len(self.patterns)

    def search(self, text: str, upto: int) -> StopMatch | None:
        """The first match in a prefix of ``text`` of length at most ``upto`` (the text's
        complete characters), searching only the prefixes not searched before."""
        deadline = time.perf_counter() + MATCH_BUDGET_S
        for end in range(self.checked + 1, upto + 1):
            for start, pattern in zip(self.starts, self.patterns):
                found = _search(pattern, text, start, end, deadline)
                if found is not None:
                    self.checked = end
                    return StopMatch(end, found.end(), pattern.pattern)
        self.checked = max(self.checked, upto)
        for i, pattern in enumerate(self.patterns):
            could = _search(pattern, text, self.starts[i], upto, deadline, partial=True)
            self.starts[i] = upto if could is None else could.start()
        return None

    @property
    def hold_from(self) -> int:
        """Text from here on may still become part of a match: not to be handed out yet."""
        return min(self.starts, default=self.checked)


def _search(pattern: regex.Pattern, text: str, start: int, end: int, deadline: float,
            partial: bool = False) -> regex.Match | None:
    try:
        left = deadline - time.perf_counter()
        if left > 0:
            return pattern.search(text, start, end, partial=partial, timeout=left)
    except TimeoutError:
        pass
    raise BadRequest(f"stop_regex {pattern.pattern!r} takes too long to match this output: give a simpler "
                     "pattern (one that does not backtrack over the whole text)")
