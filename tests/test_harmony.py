"""gpt-oss's harmony messages (gateway.harmony): `--reasoning-parser openai_gptoss` takes the
analysis channel as the thinking and the final channel as the content, `--tool-call-parser
openai` reads messages to functions.NAME as calls — whole or streamed token by token (the pieces
join into the whole answer's fields), and over HTTP with the markers as special tokens."""


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specctl.gateway.harmony import HarmonyCalls, StreamedHarmony, harmony_calls, serving_parsers, split_harmony
from specctl.gateway.reasoning import HARMONY, reasoning_reader, split_reasoning, thinks
from specctl.gateway.config import check_serving
from specctl.gateway.tool_calls import read_whole

THOUGHT = "<|channel|>analysis<|message|>The user asks about weather.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is sunny."
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
SEGMENT = '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Oslo"}'


@pytest.mark.parametrize("text, expected", [
    (THOUGHT + ANSWER, ("The user asks about weather.", "It is sunny.")),
    (ANSWER.removeprefix("<|start|>assistant"), (None, "It is sunny.")),  # no thinking (reasoning effort low)
    ("<|channel|>analysis<|message|>cut sho", ("cut sho", None)),  # max_tokens in the thought: all thinking
    (THOUGHT + "<|start|>assistant<|chan", ("The user asks about weather.", None)),  # a header cut: markup, dropped
    (THOUGHT + CALL, ("The user asks about weather.", SEGMENT)),  # a call: passed on, normalised
    # the recipient before the channel, as gpt-oss also writes it
    (THOUGHT + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}',
     ("The user asks about weather.", SEGMENT)),
    # a preamble to the user (commentary, no recipient) is content; a built-in tool's message thinking
    ("<|channel|>commentary<|message|>Let me check.<|end|>" + ANSWER, (None, "Let me check.It is sunny.")),
    ("<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|end|>" + ANSWER, ('{"q": 1}', "It is sunny.")),
])
def test_channels_split_into_thinking_and_content(text, expected):
    assert split_harmony(text) == expected
    assert split_reasoning(text, thinks("openai_gptoss", None)) == expected


HARMONY_PIECES = ["<|channel|>", "analysis", "<|message|>", "The user", " asks.", "<|end|>", "<|start|>", "assistant",
                  "<|channel|>", "final", "<|message|>", "It is", " sunny."]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, len(HARMONY_PIECES)), max_size=6))
def test_pieces_at_token_boundaries_join_into_the_whole_answer_s_fields(cuts):
    """Streamed in pieces of whole tokens (as a choice's deltas come: a marker is one special
    token), the thinking and content pieces join into what the whole answer holds."""
    bounds = sorted({0, *cuts, len(HARMONY_PIECES)})
    reader = reasoning_reader(HARMONY)
    assert isinstance(reader, StreamedHarmony)
    reasoning, content = [], []
    for start, end in zip(bounds, bounds[1:]):
        thought, text = reader.push("".join(HARMONY_PIECES[start:end]))
        reasoning.append(thought), content.append(text)
    reasoning.append(reader.finish())
    assert ("".join(reasoning), "".join(content)) == ("The user asks.", "It is sunny.")


def test_calls_are_held_and_read_when_the_choice_ends():
    reader = HarmonyCalls()
    assert reader.push("Checking. ") == ("Checking. ", [])  # content before a call streams
    assert reader.push(SEGMENT) == ("", [])
    assert reader.push('<|call|><|channel|>commentary to=functions.get_time<|message|>{}') == ("", [])
    rest, deltas, calls = reader.finish()
    assert rest == "" and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                                                           {"name": "get_time", "arguments": "{}"}]
    assert [d["index"] for d in deltas] == [0, 1] and reader.finish_reason == "tool_calls"
    assert read_whole(HarmonyCalls(max_calls=1), SEGMENT)[1][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("text", [
    '<|channel|>commentary to=functions.f<|message|>{"x": ',  # cut by max_tokens
    '<|channel|>commentary to=functions.f<|message|>[1]',  # not an object
    '<|channel|>commentary to=functions.f<|message|>{} and more',  # text after the call
    "<|channel|>final<|message|>text",  # not a call
])
def test_what_is_not_calls_alone_stays_content(text):
    assert harmony_calls(text) is None
    assert read_whole(HarmonyCalls(), "Hi. " + text) == ("Hi. " + text, None)


def test_a_gpt_oss_model_is_read_as_harmony_unless_told_otherwise():
    """As vLLM serves gpt-oss: the harmony readers stand in for no reasoning parser and the
    default tool-call parser (hermes, which gpt-oss never writes); what is given is kept; other
    models are untouched."""
    assert serving_parsers("gpt_oss", None, "hermes") == ("openai_gptoss", "openai")
    assert serving_parsers("gpt_oss", "openai_gptoss", "pythonic") == ("openai_gptoss", "pythonic")
    assert serving_parsers("gpt_oss", "qwen3", "hermes") == ("qwen3", "hermes")
    assert serving_parsers("qwen3", None, "hermes") == (None, "hermes")


def test_the_openai_tool_parser_needs_the_harmony_reasoning_parser():
    with pytest.raises(ValueError, match="--tool-call-parser openai reads the calls gpt-oss's harmony messages hold"):
        check_serving(tool_call_parser="openai")
    check_serving(reasoning_parser="openai_gptoss", tool_call_parser="openai")


@pytest.fixture(scope="module")
def harmony_cluster(tmp_path_factory):
    from tests.test_gateway_reasoning import scripted_cluster

    yield from scripted_cluster(tmp_path_factory, "harmony", reasoning_parser="openai_gptoss",
                                tool_call_parser="openai")


def _barred(model, lines) -> dict:
    from transformers import AutoTokenizer

    barred = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids([tokens[0] for tokens in lines])
    return {str(i): -100 for i in barred}


def test_a_harmony_answer_and_call_over_http_whole_and_streamed(harmony_cluster):
    """The scripted model's harmony lines (<|channel|> and <|end|> special tokens, kept in a
    chat request's text with this parser): the analysis channel comes back as reasoning, the
    final channel as content; with the tool, the message to functions.get_weather as a call —
    streamed, the pieces join into the same fields. A completion is left as generated."""
    from tests.test_gateway_reasoning import (CALL_TOKENS, HARMONY_TOKENS, JSON_CALL_TOKENS, MISTRAL_CALL_TOKENS,
                                              PYTHONIC_CALL_TOKENS, THOUGHT_TOKENS, _chat, _joined, _streamed)
    from tests.test_gateway_tools import WEATHER

    base, model = harmony_cluster[1]["gateway"], harmony_cluster[2]
    earlier = [THOUGHT_TOKENS, CALL_TOKENS, JSON_CALL_TOKENS, PYTHONIC_CALL_TOKENS, MISTRAL_CALL_TOKENS]
    body = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 12, "temperature": 0,
            "logit_bias": _barred(model, earlier)}
    message = _chat(base, body)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("Weather asked.", "Sunny in Oslo.")
    assert message["reasoning_content"] == "Weather asked."
    chunks = _streamed(base, body)
    assert (_joined(chunks, "reasoning"), _joined(chunks, "content")) == ("Weather asked.", "Sunny in Oslo.")
    calling = {**body, "tools": [WEATHER], "logit_bias": _barred(model, [*earlier, HARMONY_TOKENS])}
    choice = _chat(base, calling)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"] == "Call the tool."
    assert choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    chunks = _streamed(base, calling)
    deltas = [c for d in chunks for c in d["delta"].get("tool_calls") or []]
    assert [c["function"] for c in deltas] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert _joined(chunks, "reasoning") == "Call the tool." and _joined(chunks, "content") == ""
    assert chunks[-1]["finish_reason"] == "tool_calls"


def _harmony_gpt_oss(directory, seed: int, layers: int):
    """A tiny gpt-oss whose tokenizer has harmony's markers as special tokens and a chat template
    that ends the prompt with <|start|>assistant, as gpt-oss's does."""
    from transformers import AddedToken

    from specctl.engine.tiny import make_byte_tokenizer, make_tiny_model
    from tests.test_structured import HARMONY_MARKERS

    path = make_tiny_model(directory, "gpt_oss", seed=seed, layers=layers, vocab_size=328, init_std=0.2,
                           norm_std=0.3, bias_std=0.1, sliding_window=24)
    tokenizer = make_byte_tokenizer()
    tokenizer.add_tokens([AddedToken(marker, special=True) for marker in HARMONY_MARKERS])
    tokenizer.chat_template = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
                               "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt_oss_cluster(tmp_path_factory):
    from specctl.cluster.embedded import ClusterConfig, ClusterThread
    from specctl.config import build_config

    root = tmp_path_factory.mktemp("gpt-oss-harmony")
    target, draft = _harmony_gpt_oss(root / "target", 40, 4), _harmony_gpt_oss(root / "draft", 41, 2)
    config = build_config(None, target=str(target), draft=str(draft), mode="chain", depth=3, dtype="fp32",
                          draft_quant="none", max_sessions=4)
    thread = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0))  # a gpt-oss: harmony without asking
    urls = thread.start()
    yield urls["gateway"]
    thread.stop()


def test_structured_output_holds_gpt_oss_s_final_message_and_leaves_its_analysis_free(gpt_oss_cluster):
    """A tiny gpt-oss behind the gateway with the harmony parsers: a guided_choice answer is its
    final channel's message, held to the choice (the analysis channel barred by logit_bias on
    "a", so the model goes straight to <|channel|>final); with "f" barred instead it opens an
    analysis message and thinks freely (any text, not the choice's)."""
    from specctl.engine.tiny import make_byte_tokenizer
    from tests.test_gateway_reasoning import _chat

    a, f = make_byte_tokenizer().convert_tokens_to_ids(["a", "f"])
    body = {"messages": [{"role": "user", "content": "ok?"}], "max_tokens": 24, "temperature": 0,
            "guided_choice": ["yes", "no"]}
    choice = _chat(gpt_oss_cluster, {**body, "logit_bias": {str(a): -100}})["choices"][0]
    assert choice["message"]["content"] in ("yes", "no") and choice["message"]["reasoning"] is None
    assert choice["finish_reason"] == "stop"
    thought = _chat(gpt_oss_cluster, {**body, "logit_bias": {str(f): -100}})["choices"][0]["message"]
    assert len(thought["reasoning"]) > 3 and thought["content"] in (None, "yes", "no")
