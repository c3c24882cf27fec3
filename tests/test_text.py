"""Incremental decoding with stop strings (byte-level tiny tokenizer: one token per byte)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specctl.engine.detokenize import WINDOW, OutputDecoder
from specctl.engine.text import IncrementalText, encode_chat
from specctl.engine.tiny import make_byte_tokenizer
from specctl.errors import BadRequest


@pytest.fixture(scope="module")
def tok():
    return make_byte_tokenizer()


def feed(text: IncrementalText, ids, step=1):
    out = []
    for i in range(0, len(ids), step):
        out.append(text.push(ids[i : i + step]))
        if text.stopped:
            break
    return out


def test_deltas_add_up_to_the_decoded_text(tok):
    ids = tok.encode("héllo wörld", add_special_tokens=False)
    text = IncrementalText(tok)
    assert "".join(feed(text, ids)) + text.finish() == "héllo wörld"


def test_an_incomplete_character_is_held_back(tok):
    ids = tok.encode("é", add_special_tokens=False)
    assert len(ids) == 2
    text = IncrementalText(tok)
    assert text.push(ids[:1]) == ""
    assert text.push(ids[1:]) == "é"


def test_stop_string_across_tokens_is_never_emitted(tok):
    ids = tok.encode("abc STOP def", add_special_tokens=False)
    text = IncrementalText(tok, ["STOP"])
    deltas = feed(text, ids)
    assert "".join(deltas) == "abc "
    assert text.stopped and text.finish() == ""
    assert all("S" not in d for d in deltas)  # "S", "ST", "STO" were held back, never sent


def test_the_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("one two three", add_special_tokens=False)
    text = IncrementalText(tok, ["three", "two"])
    assert "".join(feed(text, ids, step=5)) == "one "


def test_a_stop_string_that_ends_first_wins_over_one_that_started_before_it(tok):
    """"baa" holds "a" (ending at 2) inside "baa" (ending at 3): a token at a time stops at "a",
    and so does a round that brings "aa" at once."""
    ids = tok.encode("baa", add_special_tokens=False)
    for pieces in ([ids[:1], ids[1:2]], [ids[:1], ids[1:]], [ids]):
        text = IncrementalText(tok, ["baa", "a"])
        assert "".join(text.push(piece) for piece in pieces) == "b" and text.matched == "a" and text.stop_tokens == 2


def test_include_stop_hands_out_the_stop_string_last(tok):
    ids = tok.encode("abc STOP def", add_special_tokens=False)
    text = IncrementalText(tok, ["STOP"], include_stop=True)
    deltas = feed(text, ids)
    assert "".join(deltas) == "abc STOP" and deltas[-1].endswith("STOP")
    assert text.stopped and text.finish() == ""


def test_include_stop_keeps_the_earliest_stop_string_and_the_shorter_where_two_start_together(tok):
    ids = tok.encode("one two three", add_special_tokens=False)
    assert "".join(feed(IncrementalText(tok, ["three", "two"], include_stop=True), ids, step=5)) == "one two"
    assert "".join(feed(IncrementalText(tok, ["two t", "two"], include_stop=True), ids, step=13)) == "one two"


def test_a_character_still_arriving_is_no_stop_string_but_a_replacement_left_in_the_text_is(tok):
    """(found by tests/test_gateway_combinations.py: a stop string "\ufffd" ended an answer whose
    first token was half of "ի", which the text never held)"""
    arriving = IncrementalText(tok, stop=["\ufffd"])
    first, second = tok.encode("ի")
    assert (arriving.push([first]), arriving.stopped) == ("", False)
    assert (arriving.push([second]), arriving.stopped) == ("ի", False)
    orphan = IncrementalText(tok, stop=["\ufffd"])  # a lone continuation byte stays a replacement character
    assert (orphan.push([second]), orphan.push(tok.encode("ab")), orphan.stopped) == ("", "", True)
    left = IncrementalText(tok, stop=["\ufffd"])  # ... also where the output ends on it
    assert (left.push(tok.encode("a") + [first]), left.finish(), left.stopped, left.stop_tokens) == ("", "a", True, 2)


def test_a_held_back_prefix_is_released_when_it_does_not_become_a_stop(tok):
    ids = tok.encode("ab", add_special_tokens=False)
    text = IncrementalText(tok, ["bc"])
    assert text.push(ids) == "a"
    assert text.finish() == "b"


def test_chat_without_template_is_a_clear_error(tok):
    tok = make_byte_tokenizer()
    tok.chat_template = None
    with pytest.raises(BadRequest, match="has no chat template"):
        encode_chat(tok, [{"role": "user", "content": "hi"}])


def test_chat_template_options_reach_the_template_and_its_refusals_are_bad_requests():
    tok = make_byte_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    text = lambda **options: tok.decode(encode_chat(tok, messages, options=options or None))  # noqa: E731
    assert text().endswith("<|im_start|>assistant\nHel<|im_end|>\n<|im_start|>assistant\n")  # a new turn (default)
    assert text(add_generation_prompt=False).endswith("Hel<|im_end|>\n")
    assert text(add_generation_prompt=False, continue_final_message=True).endswith("<|im_start|>assistant\nHel")
    tok.chat_template = "{% if shout %}HI{% else %}hi{% endif %}{{ raise_exception('no tools here') if tools }}"
    assert text(shout=True) == "HI" and text() == "hi"  # chat_template_kwargs are the template's variables
    with pytest.raises(BadRequest, match="^the chat template cannot render these messages: no tools here$"):
        encode_chat(tok, messages, tools=[{"type": "function", "function": {"name": "f"}}])


def test_a_stop_counts_the_tokens_up_to_the_one_that_completed_it_not_a_rounds_rest(tok):
    ids = tok.encode("abc STOP def", add_special_tokens=False)
    text = IncrementalText(tok, ["STOP"])
    text.push(ids[:3])
    assert text.stop_tokens is None
    text.push(ids[3:])  # one push holding the stop and the tokens after it
    assert text.stopped and text.stop_tokens == len("abc STOP") and len(text.tokens) == len(ids)


def test_a_stop_ending_in_a_split_character_counts_its_last_byte(tok):
    ids = tok.encode("ab€cd", add_special_tokens=False)  # € is three byte tokens
    text = IncrementalText(tok, ["b€"], include_stop=True)
    assert text.push(ids) == "ab€" and text.stop_tokens == 1 + 1 + 3


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_stop_counts_as_many_tokens_whatever_pieces_they_came_in(tok, data):
    """A token at a time (a target alone) and pieces of any size (speculative rounds) stop after
    the same token, whether a stop string or a stop pattern ends the text."""
    import regex
    whole = data.draw(st.text(st.sampled_from("ab€"), max_size=30))
    stops = data.draw(st.lists(st.text(st.sampled_from("ab€"), min_size=1, max_size=3), max_size=2))
    patterns = data.draw(st.sampled_from([(), (regex.compile("b+a"),), (regex.compile("€b"),)]))
    ids = tok.encode(whole, add_special_tokens=False)

    def stopped_after(sizes):
        text, at = IncrementalText(tok, stops, stop_regex=patterns), 0
        for size in sizes:
            if text.stopped or at >= len(ids):
                break
            text.push(ids[at : at + size])
            at += size
        if not text.stopped:
            text.finish()
        return text.stop_tokens, text.text

    one_at_a_time = stopped_after([1] * len(ids))
    sizes = data.draw(st.lists(st.integers(1, 8), min_size=len(ids), max_size=len(ids)))
    assert stopped_after(sizes) == one_at_a_time


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_what_is_held_back_is_the_longest_tail_that_could_begin_a_stop_string(tok, data):
    """Texts over a small alphabet (so tails often begin stop strings), stop strings of it
    pushed a byte at a time: each step hands out exactly the text up to the longest tail
    that is a proper prefix of some stop string, until one is found (none of it handed out)."""
    alphabet = st.sampled_from("abc")
    stops = data.draw(st.lists(st.text(alphabet, min_size=1, max_size=6), min_size=1, max_size=4))
    whole = data.draw(st.text(alphabet, max_size=40))
    text, handed = IncrementalText(tok, stops), ""
    for n, token in enumerate(tok.encode(whole, add_special_tokens=False), 1):
        handed += text.push([token])
        seen = whole[:n]
        found = [seen.find(stop) for stop in stops if stop in seen]
        if found:
            assert text.stopped and handed == seen[: min(found)]
            return
        hold = max((k for stop in stops for k in range(1, len(stop)) if seen.endswith(stop[:k])), default=0)
        assert handed == seen[: n - hold], (stops, seen)
    assert not text.stopped and handed + text.finish() == whole


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_output_decoder_is_the_whole_decode_at_every_step(tok, data):
    """Byte tokens in any order (split characters, invalid sequences, the special token), pushed
    in pieces of any size: each step's text is exactly decode(everything so far)."""
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=80))
    skip = data.draw(st.booleans())  # vLLM's skip_special_tokens: the special tokens' text left out, or kept
    decoder, pushed = OutputDecoder(tok, skip), 0
    assert decoder.local
    while pushed < len(ids):
        size = data.draw(st.integers(1, 7))
        full = decoder.push(ids[pushed:pushed + size])
        pushed += size
        assert full == tok.decode(ids[:pushed], skip_special_tokens=skip)


class CountingTokenizer:
    """The tiny tokenizer, counting the tokens each decode is given."""

    def __init__(self, inner, clean_up: bool = False):
        self.inner, self.backend_tokenizer, self.clean_up_tokenization_spaces = inner, inner.backend_tokenizer, clean_up
        self.lengths = []

    def decode(self, ids, skip_special_tokens=False):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_local_tokenizer_decodes_a_window_and_another_the_whole_output(tok):
    ids = tok.encode("héllo wörld, " * 20, add_special_tokens=False)
    for clean_up, most in ((False, WINDOW + 2), (True, len(ids))):  # the window, the new token and one held back
        counting = CountingTokenizer(tok, clean_up)
        decoder = OutputDecoder(counting)
        assert decoder.local is not clean_up  # cleaning spaces around punctuation looks across tokens
        for i in range(len(ids)):
            full = decoder.push(ids[i:i + 1])
        assert full == tok.decode(ids) and max(counting.lengths) == most


def _word_tokenizer(decoder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"▁héllo": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_token_bytes_read_byte_level_pieces_through_the_byte_table_and_others_as_utf8(tok):
    """Byte-level BPE: a token's characters mapped back to its bytes (half a UTF-8 character
    is the byte it is, not U+FFFD's three); a decoder sequence holding ByteLevel counts as one;
    a Metaspace tokenizer (SentencePiece's way) gives the UTF-8 of each token's text."""
    from tokenizers import decoders

    from specctl.engine.text import token_bytes_of

    half = tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(tok.encode("é"))[0])
    assert token_bytes_of(tok)(half) == "é".encode()[:1]
    sequence = make_byte_tokenizer()
    sequence.backend_tokenizer.decoder = decoders.Sequence([decoders.Replace("x", "x"), decoders.ByteLevel()])
    assert token_bytes_of(sequence)(half) == "é".encode()[:1]
    words = _word_tokenizer(decoders.Metaspace())
    assert [token_bytes_of(words)(i) for i in (0, 1)] == ["héllo".encode(), "world".encode()]
    assert token_bytes_of(_word_tokenizer(None))(1) == "▁world".encode()
