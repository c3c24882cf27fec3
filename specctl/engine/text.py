"""Text in and out of token ids: prompts (plain or through the chat template) and
incremental decoding of a growing output with OpenAI-style stop strings."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Sequence

import regex
from jinja2 import TemplateError

from specctl.engine.detokenize import OutputDecoder
from specctl.engine.stop_regex import StopMatch, StopPatterns
from specctl.errors import BadRequest


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """A plain completion prompt, with the tokenizer's usual special tokens (BOS)."""
    return tokenizer.encode(prompt)


def encode_chat(tokenizer: Any, messages: Sequence[dict], tools: list[dict] | None = None,
                options: dict[str, Any] | None = None) -> list[int]:
    """Messages (and the tools the model may call) through the model's own chat template, ready
    for the assistant's turn — or, with ``options`` (vLLM's add_generation_prompt,
    continue_final_message and chat_template_kwargs, checked by the caller), as they ask. The
    template adds any special tokens itself, so the encoder must not add them again. A template
    that refuses the messages (its raise_exception, or a final message it cannot continue) is a
    BadRequest saying why."""
    return tokenizer.encode(render_chat(tokenizer, messages, tools, options), add_special_tokens=False)


def render_chat(tokenizer: Any, messages: Sequence[dict], tools: list[dict] | None = None,
                options: dict[str, Any] | None = None) -> str:
    """The text ``encode_chat`` encodes (llama.cpp's /apply-template answers it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model has no chat template: use /v1/completions (or drop --chat)")
    options = {"add_generation_prompt": True, **(options or {})}
    try:
        return tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False, **options)
    except (TemplateError, ValueError) as exc:
        raise BadRequest(f"the chat template cannot render these messages: {exc}") from None


@lru_cache(maxsize=8)
def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` can stand for: its vocabulary's longest
    entry (a byte-level entry is a character a byte, a byte-fallback entry such as <0xE2> longer
    than its byte, an added token its own text), so a text longer than context x this cannot fit."""
    return max(map(len, tokenizer.get_vocab()), default=1)


class IncrementalText:
    """Turns a growing list of token ids into text deltas. Holds back an incomplete UTF-8
    character and any tail that could be the start of a stop string, so that no text past
    a stop string is ever handed out (the stop string itself is, last, with ``include_stop``:
    vLLM's include_stop_str_in_output), nor text that may become a ``stop_regex`` pattern's
    match (engine.stop_regex: the text ends with the match); ``stopped`` turns true when one
    is found — of stop strings and patterns, the one whose end comes first in the text (as a
    target making a token at a time meets them), and ``stop_tokens`` counts the tokens to it."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True, stop_regex: Sequence[regex.Pattern] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        # the proper prefixes a held-back tail may be, by their last character, longest first:
        # a token's check reads only those ending as the text does
        self._prefixes: dict[str, list[tuple[int, str]]] = {}
        for s in self.stop:
            for k in range(1, len(s)):
                self._prefixes.setdefault(s[k - 1], []).append((k, s))
        for ends in self._prefixes.values():
            ends.sort(key=lambda end: -end[0])
        self.include_stop = include_stop
        self.output = OutputDecoder(tokenizer, skip_special_tokens)  # the whole output's text, decoded incrementally
        self.full = ""  # the whole output's text so far
        self.text = ""  # everything handed out so far
        self.stopped = False
        self.matched: str | None = None  # the stop string or pattern that ended the text (vLLM's stop_reason)
        # once stopped: the output's tokens up to the one that completed the stop, those a target
        # making a token at a time would have made (a round's tokens past it are not the output's)
        self.stop_tokens: int | None = None
        self.patterns = StopPatterns(tuple(stop_regex)) if stop_regex else None

    @property
    def tokens(self) -> list[int]:
        return self.output.tokens

    def push(self, tokens: Sequence[int]) -> str:
        if self.stopped:
            return ""
        full = self.full = self.output.push(tokens)
        complete = len(full.rstrip("\ufffd"))  # a multi-byte character at the end is not complete yet
        # (nor is a stop string met in it: its bytes may still make another character)
        ended = self._first_end(complete)
        if ended is not None:
            return ended
        if complete < len(full):
            return ""
        hold = next((k for k, s in self._prefixes.get(full[-1:], ()) if full.endswith(s[:k])), 0)
        upto = len(full) - hold if self.patterns is None else min(len(full) - hold, self.patterns.hold_from)
        return self._advance(full[:upto])

    def finish(self) -> str:
        """The held-back tail once the output is complete (a stop string in an unfinished
        character at the end, which the output leaves so, still counts)."""
        if self.stopped:
            return ""
        ended = self._first_end(len(self.full))
        return self._advance(self.full) if ended is None else ended

    def _first_end(self, end: int) -> str | None:
        """Stops at the stop string or pattern met first in the text's first ``end`` characters
        (a stop string ending where a pattern's match is found wins) and returns the delta;
        None if neither is there."""
        hit = self._first_stop(self.full, end)
        match = self.patterns.search(self.full, end) if self.patterns is not None else None
        if hit is not None and (match is None or hit[0] + hit[1] <= match.found_at):
            return self._stop_with(hit)
        return None if match is None else self._stop_at(match)

    def _first_stop(self, full: str, end: int) -> tuple[int, int, str] | None:
        """(where, length, which) of the stop string that ends first in ``full[:end]`` past what
        was handed out, as a token at a time would find it; of two ending together, the longer."""
        hits = [(i, len(s), s) for s in self.stop if (i := full.find(s, max(0, len(self.text) - len(s) + 1), end)) >= 0]
        return min(hits, key=lambda h: (h[0] + h[1], h[0]), default=None)

    def _stop_with(self, hit: tuple[int, int, str]) -> str:
        self.stopped = True
        at, length, self.matched = hit
        self.stop_tokens = self._tokens_through(at + length)
        return self._advance(self.full[: at + length if self.include_stop else at])

    def _stop_at(self, match: StopMatch) -> str:
        self.stopped, self.matched = True, match.pattern
        self.stop_tokens = self._tokens_through(match.found_at)
        return self._advance(self.full[: match.end])

    def _tokens_through(self, reach: int) -> int:
        """The fewest of the output's tokens whose text holds its first ``reach`` characters
        (whole: a character split over tokens is there with its last byte)."""
        want, count = self.full[:reach], len(self.tokens)
        while count > 0 and self.output.text_of(count - 1).startswith(want):
            count -= 1
        return count

    def _advance(self, upto: str) -> str:
        delta = upto[len(self.text) :] if len(upto) > len(self.text) else ""
        self.text += delta
        return delta


def bad_word_sequences(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences, as vLLM encodes them: each word as written (its
    leading spaces dropped) and, where it tokenizes differently, after a space (a word in the
    middle of a text). The sampling parameters check how many and how long."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        if not word.strip():
            raise BadRequest("bad_words must not hold an empty word")
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):  # vLLM's test for "a new word token"
            sequences.append(spaced)
    return tuple(sequences)


def encode_user_text(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """One user prompt: wrapped in the chat template (one user turn) when ``chat``."""
    return encode_chat(tokenizer, [{"role": "user", "content": prompt}]) if chat else encode_prompt(tokenizer, prompt)


def token_bytes_of(tokenizer: Any) -> Callable[[int], bytes]:
    """A token id -> the raw bytes it stands for (OpenAI's logprobs ``bytes``, from which a
    client rebuilds a character split over tokens, where each token's own text is U+FFFD).
    Byte-level BPE (GPT-2, Qwen, SmolLM2, Llama 3) maps a token's characters back through its
    byte table; a character outside the table (a special token) and any other tokenizer give
    the UTF-8 of the token's decoded text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = None if backend is None else backend.decoder
    # the decoder's own JSON (its pickled state; a Sequence's names its parts), not the whole
    # tokenizer's: serialising a 150k-token vocabulary to read one field took half a second
    if decoder is None or b"ByteLevel" not in decoder.__getstate__():
        return lambda token: tokenizer.decode([token]).encode()
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte table

    table = {char: byte for byte, char in bytes_to_unicode().items()}

    def token_bytes(token: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token)
        if piece is None or any(char not in table for char in piece):
            return tokenizer.decode([token]).encode()
        return bytes(table[char] for char in piece)
    return token_bytes
