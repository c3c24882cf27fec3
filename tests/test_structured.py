"""Structured output (spec.structured): the target's distribution constrained to a grammar is
what every mode produces — token for token greedy, the same distribution sampled — the rows
verification reads are llguidance's masks after each node's path, the output ends where the
grammar does, and a bad grammar is a one-line error naming what is wrong."""

import json
import re
import string

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specctl.engine.tiny import make_byte_tokenizer
from specctl.errors import BadRequest, InvalidSamplingParams
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate
from specctl.spec.sampling import probs_from_logits
from specctl.engine.tiny import TINY_VOCAB as VOCAB_TINY
from specctl.spec.json_schema import JSON_WHITESPACE, bounded_whitespace
from specctl.spec.structured import JSON_OBJECT, Structure, grammar_text, ll_tokenizer
from tests.test_sampling_exact import VOCAB, assert_counts_match, small  # noqa: F401 - the fixture

EOS = 256  # the tiny models' end token
SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"},
                                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                     "required": ["ok", "n"], "additionalProperties": False,
                     "x-guidance": {"whitespace_flexible": False}})  # short: the random model would pad with spaces
PADDED = json.dumps({key: value for key, value in json.loads(SCHEMA).items() if key != "x-guidance"})
CONSTRAINTS = {"json": ("json", SCHEMA), "json-padded": ("json", PADDED), "regex": ("regex", r"[a-c]{2,5}-\d{3}"),
               "choice": ("choice", json.dumps(["yes", "no", "maybe not"]))}


@pytest.fixture(scope="module")
def byte_tokenizer():
    return make_byte_tokenizer()


def letters_tokenizer() -> PreTrainedTokenizerFast:
    """The six-token vocabulary of the ``small`` models: a..e and the end token."""
    vocab = {c: i for i, c in enumerate("abcde")} | {"<|endoftext|>": 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def test_rows_are_the_grammars_masks_after_each_path_and_stop_tokens_where_it_may_end():
    tokenizer = letters_tokenizer()
    structure = Structure("regex", "[a-c][b-d]e?", tokenizer, VOCAB, {5}, torch.device("cpu"))
    structure.record([0])  # "a" committed
    rows, ended = structure.allowed([[], [1], [1, 4], [4]])  # after "a", "ab", "abe", "ae" (off the grammar)
    assert rows.tolist() == [[False, True, True, True, False, False],  # [b-d]
                             [False, False, False, False, True, True],  # "e" or the end
                             [False, False, False, False, False, True],  # only the end
                             [True] * VOCAB]  # never reached: "e" has no probability at "a"'s row
    assert ended == [False, False, True, False]
    assert not structure.finished
    structure.record([1, 4])
    assert structure.finished
    with pytest.raises(RuntimeError, match="committed tokens outside the grammar"):
        Structure("regex", "[a-c]", tokenizer, VOCAB, {5}, torch.device("cpu")).record([4])


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
@pytest.mark.parametrize("mode", ["chain", "tree", "ngram"])
def test_greedy_under_a_grammar_every_mode_equals_the_target_alone(tiny, byte_tokenizer, kind, mode):
    target = tiny["llama"]
    drafter = {"chain": ModelChainDrafter(tiny["llama-draft"], 4),
               "tree": ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3), "ngram": NgramDrafter(3)}[mode]
    params = SamplingParams(max_tokens=80, structured=CONSTRAINTS[kind])
    prompt = byte_tokenizer.encode("answer: ")
    alone, _, reason = generate(target, prompt, params, eos_token_ids=(EOS,), tokenizer=byte_tokenizer)
    output, stats, reason_spec = generate(target, prompt, params, drafter, eos_token_ids=(EOS,),
                                          tokenizer=byte_tokenizer)
    assert output == alone and reason_spec == reason == "stop"
    assert stats.drafts > 0
    text = byte_tokenizer.decode(output)
    if kind.startswith("json"):
        assert set(json.loads(text)) == {"ok", "n"}
    elif kind == "regex":
        assert re.fullmatch(r"[a-c]{2,5}-\d{3}", text)
    else:
        assert text in ("yes", "no", "maybe not")
    free, _, _ = generate(target, prompt, SamplingParams(max_tokens=40), eos_token_ids=(EOS,))
    assert free != alone  # the grammar bites


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_the_draft_follows_the_grammar_so_more_is_accepted(tiny, byte_tokenizer, mode, monkeypatch):
    drafter = (ModelChainDrafter(tiny["llama-draft"], 4) if mode == "chain"
               else ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3))
    params = SamplingParams(max_tokens=40, structured=CONSTRAINTS["regex"])
    prompt = byte_tokenizer.encode("answer: ")
    guided, stats, _ = generate(tiny["llama"], prompt, params, drafter, eos_token_ids=(EOS,), tokenizer=byte_tokenizer)
    lost = Structure.guide

    def lost_guide(self, device):  # a guide that lost track: the draft drafts free
        copy = lost(self, device)
        copy.lost = True
        return copy

    monkeypatch.setattr(Structure, "guide", lost_guide)
    free, free_stats, _ = generate(tiny["llama"], prompt, params, drafter, eos_token_ids=(EOS,),
                                   tokenizer=byte_tokenizer)
    assert guided == free
    assert stats.accepted > free_stats.accepted == 0  # free, this random draft never writes [a-c] where it must


def test_the_output_ends_where_the_grammar_does_even_under_min_tokens(tiny, byte_tokenizer):
    params = SamplingParams(max_tokens=30, min_tokens=20, structured=("choice", json.dumps(["done"])))
    output, _, reason = generate(tiny["llama"], byte_tokenizer.encode("x"), params, ModelChainDrafter(
        tiny["llama-draft"], 3), eos_token_ids=(EOS,), tokenizer=byte_tokenizer)
    assert byte_tokenizer.decode(output) == "done" and reason == "stop"


def _exact_joint(target, allowed: list[list[int]], temperature: float) -> torch.Tensor:
    """P(t1, t2, t3) of the target alone with each position's logits outside ``allowed`` at -inf."""
    params = SamplingParams(temperature=temperature)
    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)

    def next_probs(seq, position):
        logits = target(torch.tensor(seq), torch.arange(len(seq)), target.new_cache(len(seq)))[-1]
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed[position]] = logits[allowed[position]]
        return probs_from_logits(masked, params).double()

    prompt = [1, 4, 2]
    p1 = next_probs(prompt, 0)
    for t1 in allowed[0]:
        p2 = next_probs(prompt + [t1], 1)
        for t2 in allowed[1]:
            joint[t1, t2] = p1[t1] * p2[t2] * next_probs(prompt + [t1, t2], 2)
    return joint


@pytest.mark.parametrize("mode", ["chain", pytest.param("tree", marks=pytest.mark.slow)])  # tree: ~25 s, --runslow
def test_sampling_under_a_grammar_keeps_the_targets_constrained_distribution(small, mode):  # noqa: F811
    target, draft = small
    tokenizer = letters_tokenizer()
    expected = _exact_joint(target, [[0, 1, 2], [1, 2, 3], [0, 1, 2, 3, 4]], 1.0)  # [a-c][b-d][a-e]
    drafter = ModelChainDrafter(draft, 2) if mode == "chain" else ModelTreeDrafter(draft, 2, 2, 3)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    accepted = 0
    for seed in range(1000):
        params = SamplingParams(temperature=1.0, max_tokens=4, seed=seed, structured=("regex", "[a-c][b-d][a-e]"))
        out, stats, reason = generate(target, [1, 4, 2], params, drafter, eos_token_ids=(5,), tokenizer=tokenizer)
        assert len(out) == 3 and reason == "stop"
        counts[out[0], out[1], out[2]] += 1
        accepted += stats.accepted > 0
    assert accepted > 100  # the acceptance rule ran, not only the bonus
    assert_counts_match(counts, expected)


@pytest.mark.parametrize("structured, message", [
    (("json", "{not json"), "structured output (json) is invalid: Expecting property name enclosed in double quotes"),
    (("regex", "(ab"), 'structured output (regex) is invalid: at 1(8): invalid regex "(ab" (in regex): regex parse '
                       'error: error: unclosed group'),
    (("choice", '"yes"'), "structured output (choice) is invalid: a choice is a non-empty list of strings"),
    (("grammar", "start: missing_rule"), "structured output (grammar) is invalid: "),
])
def test_a_bad_grammar_is_refused_with_what_is_wrong(structured, message):
    with pytest.raises(InvalidSamplingParams) as caught:
        grammar_text(*structured)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def _takes(grammar: str, text: str, tokenizer) -> bool:
    """Whether ``grammar`` takes the whole of ``text`` and may end there."""
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, VOCAB_TINY), grammar)
    ids = tokenizer.encode(text)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def test_json_whitespace_is_bounded_unless_the_schema_says_its_own(byte_tokenizer):
    """Pretty-printed JSON is taken (line breaks and indents up to 40), a run past the bound is not:
    with any whitespace allowed a model that wants what the grammar refuses writes blanks till
    max_tokens. A schema's own whitespace in x-guidance is kept; a Lark grammar's %json is bounded too."""
    any_object = grammar_text("json", JSON_OBJECT)
    taken = ['{"a":1}', '{ "a" : 1 , "b" : [ 1 , 2 ] }', '{\n  "a": 1,\n  "b": {\n    "c": [\n      2\n    ]\n  }\n}',
             '{"a": 1,\r\n\r\n' + " " * 40 + '"b": "x   \\n   y"}', '{"a":\t1}']
    refused = ['{"a":   1}', '{"a": 1,\n' + " " * 41 + '"b": 2}', '{"a": 1,\n\n\n"b": 2}', ' {"a": 1}', '{"a": 1}\n']
    assert [_takes(any_object, text, byte_tokenizer) for text in taken + refused] == [True] * 5 + [False] * 5
    assert bounded_whitespace({"type": "object"}) == {"type": "object",
                                                      "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    compact = json.dumps({"type": "object", "x-guidance": {"whitespace_flexible": False}})
    assert bounded_whitespace(json.loads(compact)) == json.loads(compact)
    assert not _takes(grammar_text("json", compact), '{\n"a": 1}', byte_tokenizer)
    assert not _takes(grammar_text("json", json.dumps({"x-guidance": {"lenient": True}})), '{\n\n\n}',
                      byte_tokenizer)  # a schema's other options keep the bound
    lark = grammar_text("grammar", f"start: \"<\" %json {json.dumps(bounded_whitespace({'type': 'array'}))} \">\"")
    assert _takes(lark, "<[\n  1\n]>", byte_tokenizer) and not _takes(lark, "<[   1]>", byte_tokenizer)


@pytest.mark.parametrize("structured, message", [
    (("yaml", "a: b"), "structured output is a kind (json, regex, choice, grammar, thinking, harmony) and its text, got "
                       "('yaml', 'a: b')"),
    (("regex", ""), "structured output is a kind (json, regex, choice, grammar, thinking, harmony) and its text, got "
                    "('regex', '')"),
    (("regex", "a" * 65537), "structured output's regex may have at most 65536 characters, got 65537"),
])
def test_structured_params_out_of_shape_are_refused(structured, message):
    with pytest.raises(InvalidSamplingParams) as caught:
        SamplingParams(structured=structured)
    assert str(caught.value) == message


def test_a_regex_of_whitespace_alone_is_a_regex(tiny, byte_tokenizer):
    """(found by tests/test_combinations.py: " " was refused as no text at all)"""
    params = SamplingParams(max_tokens=8, structured=("regex", " +"))
    output, _, reason = generate(tiny["llama"], byte_tokenizer.encode("x"), params, eos_token_ids=(EOS,),
                                 tokenizer=byte_tokenizer)
    assert set(byte_tokenizer.decode(output)) == {" "}


@pytest.mark.parametrize("digit", ["\u0663", "\U0001ccf6"], ids=["arabic-indic-3", "outlined-6"])
def test_a_regex_s_digits_are_unicode_s_and_a_json_schema_pattern_s_ascii(byte_tokenizer, digit):
    """\\d as Python 3 and the Rust regex crate read it in a regex (vLLM's guidance backend), as
    ECMA-262 does in a JSON schema's pattern (found by tests/test_combinations.py: U+1CCF6, a digit
    of Unicode 16 that Python 3.11's re does not know)."""
    import llguidance

    ll = ll_tokenizer(byte_tokenizer, VOCAB_TINY)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string", "pattern": "^\\d+$"}},
                         "required": ["a"]})

    def takes(kind: str, spec: str, text: str) -> bool:
        ids = byte_tokenizer.encode(text)
        return llguidance.LLMatcher(ll, grammar_text(kind, spec)).validate_tokens(ids) == len(ids)

    assert takes("regex", r"\d+", "1" + digit) and takes("regex", r"\d+", "17")
    assert not takes("json", schema, '{"a": "1' + digit) and takes("json", schema, '{"a": "17')


@pytest.mark.parametrize("thinking_tokens", [False, True])
def test_a_grammar_after_the_thinking_leaves_the_thinking_free_and_holds_the_answer(thinking_tokens):
    """kind "thinking" (a reasoning parser's chat request): any text up to the first </think>
    (a token of its own where the tokenizer has one, as Qwen3's does; else the text), whitespace,
    then the request's grammar."""
    tokenizer = make_byte_tokenizer()
    if thinking_tokens:
        tokenizer.add_tokens(["<think>", "</think>"])
    end = "</think>"
    structure = Structure("thinking", json.dumps({"kind": "regex", "spec": "ab+"}), tokenizer, len(tokenizer),
                          {256}, torch.device("cpu"))

    def allowed_after(text: str) -> torch.Tensor:
        return structure.allowed([tokenizer.encode(text, add_special_tokens=False)])[0][0]

    def token(text: str) -> int:
        return tokenizer.encode(text, add_special_tokens=False)[0]

    free = allowed_after("<think> {x: ab! ")  # thinking: free, every character (braces, the answer's letters...)
    assert all(free[token(c)] for c in string.printable)
    assert not allowed_after("<think>")[256]  # no end while thinking
    after = allowed_after(f"<think>plan{end}\n")
    assert after[token(" ")] and after[token("a")] and not after[token("b")] and not after[token("x")]
    assert allowed_after(f"plan{end}ab")[256] and not allowed_after(f"plan{end}a")[256]
    if thinking_tokens:  # the end tag spelt in bytes is thinking text, not the end
        spelt = [token(c) for c in "plan</think>"]
        assert structure.allowed([spelt])[0][0][token("x")]
    rows, ended = structure.allowed([tokenizer.encode(f"plan{end}abb", add_special_tokens=False) + [256]])
    assert ended == [True]


HARMONY_MARKERS = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>"]


def test_a_grammar_in_harmony_holds_the_final_message_after_free_analysis_messages():
    """kind "harmony" (gpt-oss with --reasoning-parser openai_gptoss): analysis messages with
    free text, each ended by the <|end|> token, then <|channel|>final<|message|> and the request's
    grammar, then the end token (<|return|>); the markers are the tokenizer's special tokens."""
    from transformers import AddedToken

    tokenizer = make_byte_tokenizer()
    tokenizer.add_tokens([AddedToken(marker, special=True) for marker in HARMONY_MARKERS])
    channel, message, end, start, stop = tokenizer.convert_tokens_to_ids(HARMONY_MARKERS)
    structure = Structure("harmony", json.dumps({"kind": "regex", "spec": "ab+"}), tokenizer, len(tokenizer),
                          {stop}, torch.device("cpu"))

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def allowed_after(text: str) -> torch.Tensor:
        return structure.allowed([ids(text)])[0][0]

    first = allowed_after("")
    assert first[channel] and first.sum() == 1  # the output opens a message
    thought = allowed_after("<|channel|>analysis<|message|>{x: ab! ")
    assert thought[end] and all(thought[ids(c)[0]] for c in string.printable) and not thought[stop]
    answer = allowed_after("<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>final<|message|>")
    assert answer[ids("a")[0]] and answer.sum() == 1
    assert allowed_after("<|channel|>final<|message|>abb")[stop]
    assert not allowed_after("<|channel|>final<|message|>a")[stop]
    assert not allowed_after("<|channel|>")[ids("x")[0]]  # a channel of no message the grammar knows
    rows, ended = structure.allowed([ids("<|channel|>final<|message|>ab") + [256]])  # llguidance's end: the EOS
    assert ended == [True]
    # a choice (llguidance gives its grammar as Lark text, not JSON: until 2026-11-29 a choice after
    # the thinking, or in harmony, was refused with "Expecting value")
    choice = json.dumps({"kind": "choice", "spec": json.dumps(["yes", "no"])})
    for kind in ("harmony", "thinking"):
        assert Structure(kind, choice, tokenizer, len(tokenizer), {stop}, torch.device("cpu"))
    answer = Structure("harmony", choice, tokenizer, len(tokenizer), {stop}, torch.device("cpu")).allowed(
        [ids("<|channel|>final<|message|>")])[0][0]
    assert answer[ids("y")[0]] and answer[ids("n")[0]] and answer.sum() == 2


@pytest.mark.parametrize("spec, message", [
    ("regex", 'structured output (thinking) is {"kind": ..., "spec": ...}'),
    (json.dumps({"kind": "thinking", "spec": "x"}), "structured output (thinking) holds one of json, regex, choice, "
                                                    "grammar, got 'thinking'"),
    (json.dumps({"kind": "regex", "spec": "(ab"}), "structured output (regex) is invalid: "),
])
def test_a_bad_grammar_after_the_thinking_is_refused(spec, message):
    with pytest.raises(InvalidSamplingParams) as caught:
        grammar_text("thinking", spec)
    assert str(caught.value).startswith(message)


def test_a_grammar_needs_an_end_token_and_the_tokenizer(tiny, byte_tokenizer):
    params = SamplingParams(max_tokens=8, ignore_eos=True, structured=("regex", "a+"))
    with pytest.raises(InvalidSamplingParams, match="ignore_eos cannot be combined with it"):
        generate(tiny["llama"], [1, 2], params, eos_token_ids=(EOS,), tokenizer=byte_tokenizer)
    with pytest.raises(BadRequest, match="structured output needs the target's tokenizer"):
        generate(tiny["llama"], [1, 2], SamplingParams(structured=("regex", "a+")), eos_token_ids=(EOS,))
    # stop_token_ids end the output where the grammar may, as EOS does
    output, _, reason = generate(tiny["llama"], [1, 2], SamplingParams(
        max_tokens=8, ignore_eos=True, stop_token_ids=(300,), structured=("choice", '["ab"]')),
        eos_token_ids=(EOS,), tokenizer=byte_tokenizer)
    assert byte_tokenizer.decode(output) == "ab" and reason == "stop"
    with pytest.raises(BadRequest, match="^structured output needs the model's fast tokenizer: Only fast tokenizers"):
        ll_tokenizer(object(), 320)  # llguidance reads fast tokenizers only: a clean error, not a crash of the session


def test_a_grammar_literal_the_tokenizer_reads_as_an_added_token_is_never_offered_then_refused():
    """llguidance's mask offers a quoted literal as the added token the tokenizer reads it as,
    which consuming then refuses (a special token is no text): the row leaves such a token out,
    and where nothing else could be written the target's session ends with an error that says
    how to write the token; a draft's guide drafts free there."""
    tokenizer = make_byte_tokenizer()
    tokenizer.add_tokens(["<tool_call>"])
    call = tokenizer.convert_tokens_to_ids("<tool_call>")
    x, less = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "x<")
    either = Structure("grammar", 'start: "x" ("<tool_call>" | "y")', tokenizer, len(tokenizer), {EOS},
                       torch.device("cpu"))
    assert less in either.allowed([[x]])[0][0].nonzero().flatten().tolist()  # not forced: the text, byte by byte
    after = Structure("grammar", 'start: "x<tool_call>"', tokenizer, len(tokenizer), {EOS}, torch.device("cpu"))
    with pytest.raises(InvalidSamplingParams, match=f"not as text \\(<tool_call> <\\[{call}\\]>\\)"):
        after.allowed([[x]])  # forced bytes: the mask offers the token alone
    as_token = Structure("grammar", f'start: <[{call}]> "y"', tokenizer, len(tokenizer), {EOS}, torch.device("cpu"))
    assert as_token.allowed([[]])[0][0].nonzero().flatten().tolist() == [call]  # as a token it is written
    only = Structure("grammar", 'start: "<tool_call>"', tokenizer, len(tokenizer), {EOS}, torch.device("cpu"))
    assert bool(only.guide(torch.device("cpu")).allowed([[]])[0].all())  # a guide: free
    with pytest.raises(InvalidSamplingParams) as refused:
        only.allowed([[]])
    assert str(refused.value) == (
        f"structured output cannot go on: its grammar asks here for text that this model writes only as an added "
        f"token, which a grammar takes as a token, not as text (<tool_call> <[{call}]>): write it as <[id]> in a "
        f"Lark grammar")


@pytest.mark.parametrize("allowed", [(), tuple(range(64, 67))])
def test_an_ended_grammar_ends_every_mode_alike_with_the_end_token(tiny, byte_tokenizer, allowed):
    """Whether a round computed the row after the grammar's end (speculation) or not (the target
    alone ends at once): the same output and the same stop token (vLLM's token_ids hold it) — also
    where allowed_token_ids leave that row empty (found by tests/test_combinations.py: speculation
    took token 0 there and the grammar refused it)."""
    from specctl.spec.rounds import run_to_end

    params = SamplingParams(max_tokens=16, structured=("regex", "[a-c]{1,3}"), allowed_token_ids=allowed)
    prompt = byte_tokenizer.encode("answer: ")
    ends = set()
    for drafter in (None, ModelChainDrafter(tiny["llama-draft"], 4), ModelChainDrafter(tiny["llama"], 5),
                    ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3)):
        session = run_to_end(tiny["llama"], prompt, params, drafter, eos_token_ids=(EOS,), tokenizer=byte_tokenizer)
        ends.add((tuple(session.output), session.finish_reason, session.stop_token))
    [(output, reason, stop)] = ends
    assert re.fullmatch("[a-c]{1,3}", byte_tokenizer.decode(output)) and (reason, stop) == ("stop", EOS)
