"""SGLang's stop_regex (engine.stop_regex, through engine.text.IncrementalText): the text ends
with a pattern's first match — the shortest prefix of the text in which one matches — whatever
pieces the tokens arrive in, no text past it is ever handed out, and bad patterns are refused
saying why (byte-level tiny tokenizer: one token per byte)."""

import pytest
import regex
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specctl.engine import stop_regex
from specctl.engine.stop_regex import compile_stop_patterns
from specctl.engine.text import IncrementalText
from specctl.engine.tiny import make_byte_tokenizer
from specctl.errors import BadRequest


@pytest.fixture(scope="module")
def tok():
    return make_byte_tokenizer()


def streamed(tok, text: str, patterns: list[str], step: int, stop: tuple[str, ...] = ()) -> tuple[list[str], str | None]:
    """The deltas handed out when ``text``'s tokens arrive ``step`` at a time, and what matched."""
    out = IncrementalText(tok, stop, stop_regex=compile_stop_patterns(patterns))
    ids = tok.encode(text, add_special_tokens=False)
    deltas = []
    for i in range(0, len(ids), step):
        deltas.append(out.push(ids[i : i + step]))
        if out.stopped:
            return deltas, out.matched
    return [*deltas, out.finish()], out.matched


def reference(text: str, patterns: list[str]) -> tuple[str, str | None]:
    """The definition: the shortest prefix in which a pattern matches; the text ends with that match."""
    for end in range(1, len(text) + 1):
        for pattern in patterns:
            found = regex.search(pattern, text[:end])
            if found is not None:
                return text[: found.end()], pattern
    return text, None


def test_the_text_ends_with_the_first_match_kept():
    tok = make_byte_tokenizer()
    deltas, matched = streamed(tok, "the answer is 42 and more", [r"\d+"], step=1)
    assert ("".join(deltas), matched) == ("the answer is 4", r"\d+")  # the first prefix with a match: one digit
    deltas, matched = streamed(tok, "x = 1; END; y = 2", [r"END;"], step=4)
    assert ("".join(deltas), matched) == ("x = 1; END;", "END;")
    assert "".join(streamed(tok, "no digits here", [r"\d"], step=3)[0]) == "no digits here"  # no match: all of it


def test_text_that_may_become_a_match_is_held_back_until_it_does_or_cannot():
    tok = make_byte_tokenizer()
    out = IncrementalText(tok, stop_regex=compile_stop_patterns([r"END\d"]))
    assert out.push(tok.encode("abc EN", add_special_tokens=False)) == "abc "  # "EN" may start "END7"
    assert out.push(tok.encode("D", add_special_tokens=False)) == ""
    assert out.push(tok.encode("x", add_special_tokens=False)) == "ENDx"  # it cannot any more: released
    assert out.push(tok.encode(" END7 tail", add_special_tokens=False)) == " END7"
    assert out.stopped and out.matched == r"END\d" and out.finish() == ""
    # a lookahead's match ends before the text that completed it: that text was held back, never handed out
    out = IncrementalText(tok, stop_regex=compile_stop_patterns([r"a(?=bc)"]))
    assert out.push(tok.encode("xab", add_special_tokens=False)) == "x"
    assert out.push(tok.encode("c", add_special_tokens=False)) == "a" and out.text == "xa"


def test_the_stop_string_or_pattern_whose_end_comes_first_ends_the_text():
    tok = make_byte_tokenizer()
    deltas, matched = streamed(tok, "one two 3 four", [r"\d"], step=5, stop=("four",))
    assert ("".join(deltas), matched) == ("one two 3", r"\d")
    deltas, matched = streamed(tok, "one two 3 four", [r"\d"], step=14, stop=("two",))
    assert ("".join(deltas), matched) == ("one ", "two")  # the string is trimmed, as always


def test_a_pattern_is_matched_at_the_outputs_end_too():
    tok = make_byte_tokenizer()
    out = IncrementalText(tok, stop_regex=compile_stop_patterns([r"x$"]))
    assert out.push(tok.encode("ax", add_special_tokens=False)) == "ax"  # "$": the text so far ends here
    assert out.stopped and out.matched == "x$"
    out = IncrementalText(tok, stop_regex=compile_stop_patterns([r"ab\b"]))
    assert out.push(tok.encode("ab", add_special_tokens=False)) == "ab"  # as SGLang searches the text so far
    assert out.stopped


PATTERNS = [r"\d+", r"a(?=bc)", r"x$", r"\bfoo\b", r"(?<=q)z", r"b{2,}", r"c.a"]


@settings(max_examples=300, deadline=None)
@example(text="abc", step=1, patterns=[r"\d+", r"a(?=bc)"])  # a lookahead's match: its context is past the text kept
@given(text=st.text(alphabet="abcxqz fo1\n", max_size=40), step=st.integers(1, 9),
       patterns=st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=3, unique=True))
def test_any_pieces_give_the_definitions_text(text, step, patterns):
    tok = make_byte_tokenizer()
    deltas, matched = streamed(tok, text, patterns, step)
    want, pattern = reference(text, patterns)
    assert "".join(deltas) == want
    if pattern is not None:  # of two matching first, either may be named: a match of it ends where the text does,
        # in the text as it stood then (a lookahead's context and "$" are read there, as SGLang reads them)
        assert any(found.end() == len(want) for stood in range(len(want), len(text) + 1)
                   for found in regex.finditer(matched, text[:stood], overlapped=True)), (matched, want)


@pytest.mark.parametrize("given_patterns, message", [
    ("(", "stop_regex '(' is not a valid regular expression: missing ) at position 1"),
    (r"\d*", r"stop_regex '\\d*' matches the empty text, so it would end every output before it starts: give a "
             "pattern that needs at least one character"),
    (["a", "b", "c", "d", "e"], "at most 4 stop_regex patterns, got 5"),
    ("x" * 513, "a stop_regex pattern may be at most 512 characters, got 513"),
    ([""], "a stop_regex pattern must be a non-empty string"),
])
def test_bad_patterns_are_refused_saying_why(given_patterns, message):
    with pytest.raises(BadRequest) as refused:
        compile_stop_patterns(given_patterns)
    assert str(refused.value) == message


def test_matching_past_its_budget_fails_the_request_saying_what_to_do(monkeypatch):
    tok = make_byte_tokenizer()
    monkeypatch.setattr(stop_regex, "MATCH_BUDGET_S", 0.0)
    out = IncrementalText(tok, stop_regex=compile_stop_patterns([r"(a|aa)+b"]))
    with pytest.raises(BadRequest) as refused:
        out.push(tok.encode("aaaa", add_special_tokens=False))
    assert str(refused.value) == ("stop_regex '(a|aa)+b' takes too long to match this output: give a simpler pattern "
                                  "(one that does not backtrack over the whole text)")
    assert compile_stop_patterns(None) == () and compile_stop_patterns([]) == ()
