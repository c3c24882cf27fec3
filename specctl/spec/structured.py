"""Structured output: the target's distribution constrained to a grammar (a JSON schema, a
regex, a choice of strings, a Lark/GBNF grammar), as vLLM's ``guidance`` backend serves it
with llguidance — the same library and grammars; a JSON schema's whitespace bounded as
llama.cpp bounds it, where vLLM allows any, and its objects closed as vLLM's default backend
closes them (spec.json_schema).

The grammar is part of the target's distribution, so verification applies it: a proposal
node's row keeps only the tokens the grammar allows after the committed text and the node's
own path, which is what decoding with the target alone under the grammar computes there. A
node the grammar forbids has no probability at its parent's row, so it is never accepted.
The stop tokens (EOS, stop_token_ids) are allowed exactly where the grammar may end; once it
can take nothing more (the only token left would be EOS) the session ends with "stop", as
the target alone would one token later.

The draft follows the grammar too (``Structure.guide``: a copy of the session's state, kept up
to date with each outcome; spec.logit_rules), so it proposes only what the target may accept;
it is a guide, never a check: a draft whose guide loses track drafts free, which costs
acceptance only."""

from __future__ import annotations

import copy
import json
import threading
from typing import Any

import torch

from specctl.errors import BadRequest, InvalidSamplingParams
from specctl.spec.json_schema import served_schema

GRAMMARS = ("json", "regex", "choice", "grammar")  # the grammars a request may ask for (vLLM's guided_* fields)
# what SamplingParams.structured's first item may say: thinking and harmony wrap a grammar
KINDS = (*GRAMMARS, "thinking", "harmony")
# A reasoning model's thinking and the whitespace before the grammar it answers in (llguidance's
# Lark; the rule "answer" refers to the inner grammar by name): free text up to the first
# </think>, as text; or, where the tokenizer has <think> and </think> as tokens of their own (Qwen3,
# DeepSeek-R1: llguidance takes them as special tokens, which no text matches), up to that token.
THINKING_LARK = 'start: think /[ \\t\\r\\n]*/ answer\nthink[suffix="</think>"]: /(.|\\n)*/\nanswer: @answer\n'
THINKING_TOKENS_LARK = ('start: think /[ \\t\\r\\n]*/ answer\nthink: /(.|\\n)*/ (<think> /(.|\\n)*/)? </think>\n'
                        'answer: @answer\n')
# gpt-oss's harmony output (gateway.harmony), the grammar holding its final channel's message: any
# analysis messages first (free text ended by the <|end|> token), then <|channel|>final<|message|>
# and the answer (llguidance takes the markers as the special tokens they are).
HARMONY_LARK = ('start: (<|channel|> "analysis" <|message|> thought <|end|> <|start|> "assistant")* '
                '<|channel|> "final" <|message|> answer\nthought: /(.|\\n)*/\nanswer: @answer\n')
MAX_SPEC_CHARS = 65536  # a schema, regex or grammar's text
JSON_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object

_tokenizers: dict[int, tuple[Any, Any]] = {}  # id(HF tokenizer) -> (it, its LLTokenizer): built once (~2 s)
_tokenizers_lock = threading.Lock()


def grammar_text(kind: str, spec: str, thinking_tokens: bool = False) -> str:
    """The llguidance grammar for ``(kind, spec)``; InvalidSamplingParams names what is wrong.
    ``thinking``: ``spec`` is {"kind": ..., "spec": ...}, a grammar that starts after a reasoning
    model's thinking (vLLM's structured output with a reasoning parser), ended by the </think>
    token where ``thinking_tokens`` (the tokenizer has one), else by that text; ``harmony``: the
    same grammar as gpt-oss's final message, after its analysis messages."""
    import llguidance

    try:
        if kind == "thinking":
            grammar = _after_thinking(spec, THINKING_TOKENS_LARK if thinking_tokens else THINKING_LARK)
        elif kind == "harmony":
            grammar = _after_thinking(spec, HARMONY_LARK, kind)
        elif kind == "json":
            schema = served_schema(json.loads(spec))  # llguidance takes a JSON text: say here it is not one
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        elif kind == "choice":
            choices = json.loads(spec)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise ValueError("a choice is a non-empty list of strings")
            grammar = llguidance.grammar_from("choice", choices)
        elif kind in ("regex", "grammar"):
            grammar = llguidance.grammar_from(kind, spec)
        else:
            raise ValueError(f"unknown kind {kind!r} (one of {', '.join(KINDS)})")
    except ValueError as exc:  # json.JSONDecodeError included
        raise InvalidSamplingParams(f"structured output ({kind}) is invalid: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidSamplingParams(f"structured output ({kind}) is invalid: {_one_line(error)}")
    return grammar


def _after_thinking(spec: str, lark: str, outer: str = "thinking") -> str:
    try:
        inner = json.loads(spec)
        kind, text = inner["kind"], inner["spec"]
    except (ValueError, KeyError, TypeError):
        raise InvalidSamplingParams(f'structured output ({outer}) is {{"kind": ..., "spec": ...}}') from None
    if kind not in GRAMMARS:
        raise InvalidSamplingParams(f"structured output ({outer}) holds one of {', '.join(GRAMMARS)}, got {kind!r}")
    inner_text = grammar_text(kind, text)
    # llguidance's grammar_from gives some kinds (a choice) as Lark text, others as its JSON form
    grammars = (json.loads(inner_text)["grammars"] if inner_text.lstrip().startswith("{")
                else [{"lark_grammar": inner_text}])
    grammars[0]["name"] = "answer"
    return json.dumps({"grammars": [{"name": "thinking", "lark_grammar": lark}, *grammars]})


def _one_line(error: str) -> str:
    """llguidance's message (a header, the source with a caret, "error: ...") on one line."""
    lines = [line.strip() for line in error.strip().splitlines()]
    return " ".join([lines[0]] + [line for line in lines[1:] if line.startswith("error:")])


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of a Hugging Face tokenizer over the model's ``vocab_size`` rows (ids
    past the tokenizer's are never allowed); built once per tokenizer, it takes seconds."""
    import llguidance.hf

    with _tokenizers_lock:
        held = _tokenizers.get(id(tokenizer))
        if held is None or held[0] is not tokenizer:
            try:
                held = _tokenizers[id(tokenizer)] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, vocab_size))
            except ValueError as exc:  # a slow (Python) tokenizer: llguidance reads fast ones only
                raise BadRequest(f"structured output needs the model's fast tokenizer: {exc}") from None
        return held[1]


def _bits(mask: bytes, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask (32 tokens a little-endian int32 word) as a bool row."""
    words = torch.frombuffer(bytearray(mask), dtype=torch.int32)
    return ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()[:vocab_size]


class Structure:
    """One session's grammar state: the committed output consumed, each row's allowed tokens
    computed by consuming a proposal node's path and rolling it back."""

    def __init__(self, kind: str, spec: str, tokenizer: Any, vocab_size: int, stop_ids: set[int],
                 device: torch.device, strict: bool = True) -> None:
        import llguidance

        if not stop_ids:
            raise InvalidSamplingParams("structured output needs a stop token (EOS): it ends the output where the "
                                        "grammar does, so ignore_eos cannot be combined with it")
        tokens = ll_tokenizer(tokenizer, vocab_size)
        thinking_tokens = {"<think>", "</think>"} <= set(tokenizer.get_added_vocab())
        self.matcher = llguidance.LLMatcher(tokens, grammar_text(kind, spec, thinking_tokens))
        if self.matcher.is_error():
            raise InvalidSamplingParams(f"structured output ({kind}) is invalid: {_one_line(self.matcher.get_error())}")
        self.end_token, self.vocab_size, self.device = tokens.eos_token, vocab_size, device
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long)
        # the added tokens (special or not) a mask may allow though the matcher refuses them (below)
        self.added_ids = torch.tensor(sorted(i for i in set(tokenizer.get_added_vocab().values())
                                             if i < vocab_size and i not in stop_ids and i != self.end_token),
                                      dtype=torch.long)
        self.tokenizer = tokenizer
        self.strict = strict  # the target's: a token outside the grammar is a bug; a draft's guide is lenient
        self.lost = False  # a guide given tokens outside the grammar: it constrains nothing more

    def guide(self, device: torch.device) -> "Structure":
        """A copy of this state for a draft on ``device``: it follows the committed text leniently."""
        guide = copy.copy(self)
        guide.matcher, guide.device, guide.strict = self.matcher.deep_copy(), device, False
        return guide

    @property
    def finished(self) -> bool:
        """The grammar takes nothing more: the output is complete."""
        return self.matcher.is_stopped()

    def record(self, tokens: list[int]) -> None:
        """Output tokens committed (the target's: each one the grammar allowed, verification only
        accepts those). A draft's guide also sees the stop token that ends the output, and one
        the grammar refuses leaves it lost (drafting goes on free)."""
        if not tokens or self.lost or (not self.strict and self.matcher.is_stopped()):
            return
        if not self.matcher.consume_tokens(tokens):
            if self.strict:
                raise RuntimeError(f"committed tokens outside the grammar: {self.matcher.get_error()}")
            self.lost = True

    def allowed(self, paths: list[list[int]]) -> tuple[torch.Tensor, list[bool]]:
        """([rows, vocab] bool on the device, ended): row r's tokens the grammar allows after the
        output so far and ``paths[r]``, and whether the grammar has ended there (only the stop
        tokens left). A row whose path leaves the grammar is never reached (its node was refused
        at its parent's row): it is left unconstrained."""
        rows = torch.ones(len(paths), self.vocab_size, dtype=torch.bool)
        ended = [False] * len(paths)
        for r, path in enumerate(paths if not self.lost else ()):
            if self.matcher.validate_tokens(path) < len(path) or not self.matcher.consume_tokens(path):
                continue
            row = _bits(self.matcher.compute_bitmask(), self.vocab_size)
            ended[r] = self.matcher.is_stopped()
            self._drop_refused_added(row, ended[r])
            self.matcher.rollback(len(path))
            may_end = bool(row[self.end_token])
            row[self.end_token] = False
            row[self.stop_ids] = may_end  # every stop token ends the output as EOS does
            rows[r] = row
        return rows.to(self.device, non_blocking=True), ended

    def _drop_refused_added(self, row: torch.Tensor, ended: bool) -> None:
        """An added token the mask allows but the matcher refuses is taken out of ``row`` (at the
        matcher's state): llguidance's mask can offer a grammar literal's text as the added token
        the tokenizer reads it as (a quoted "<tool_call>" with Qwen's), which consuming then refuses
        as a special token. Left with nothing to write, the target cannot go on: a clear error."""
        offered = self.added_ids[row[self.added_ids]].tolist()
        refused = [token for token in offered if not self.matcher.validate_tokens([token])]
        if not refused:
            return
        row[refused] = False
        if not self.strict and not row.any():  # a draft's guide: drafting goes on free
            row[:] = True
        elif not ended and not row.any():
            names = ", ".join(f"{self.tokenizer.convert_ids_to_tokens(t)} <[{t}]>" for t in refused)
            raise InvalidSamplingParams(
                f"structured output cannot go on: its grammar asks here for text that this model writes only as an "
                f"added token, which a grammar takes as a token, not as text ({names}): write it as <[id]> in a "
                f"Lark grammar")
