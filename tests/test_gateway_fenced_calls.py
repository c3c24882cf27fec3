"""The hermes parser's reader (gateway.fenced_calls): <tool_call> blocks as before, and calls a
model writes as a markdown JSON block (Qwen2.5-Coder's way) when the block opens the output
and names one of the request's tools."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specctl.gateway.fenced_calls import HermesCalls, block_start
from specctl.gateway.tool_calls import StreamedCalls, read_whole
from specctl.gateway.tool_parsers import READS_TOOL_NAMES, TOOL_PARSERS
from tests.test_gateway_tools import _joined, _streamed_in, streamed

NAMES = frozenset({"get_weather", "get_time"})
# Qwen2.5-Coder-1.5B's answer to "What's the weather in Paris?" with tools (temperature 0)
QWEN = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "unit": "c"\n  }\n}\n```'
PARIS = '{\n    "city": "Paris",\n    "unit": "c"\n  }'


def _functions(calls: list[dict] | None) -> list[tuple[str, str]] | None:
    return None if calls is None else [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_the_hermes_parser_is_the_reader_told_the_tool_names():
    assert TOOL_PARSERS["hermes"] is HermesCalls and READS_TOOL_NAMES == {"hermes"}


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_json_block_that_opens_the_output_and_names_a_tool_is_the_call_streamed_as_written(size):
    content, pushes, calls = streamed(HermesCalls(tool_names=NAMES), QWEN, size)
    assert content == "" and _functions(calls) == [("get_weather", PARIS)]
    deltas = [d for push in pushes for d in push]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"] == calls[0]["id"]
    assert _joined(deltas) == [("get_weather", PARIS)] and (len(deltas) > 2 or size == 1000)  # as they come
    assert HermesCalls(tool_names=NAMES).finish_reason == "tool_calls"


@pytest.mark.parametrize("text", [
    "```\n" + QWEN.removeprefix("```json\n"),  # no language
    "\n  " + QWEN + "\n",  # whitespace around
    QWEN.replace("```json\n", "```json \r\n").replace('"arguments"', '"parameters"'),
])
def test_a_call_block_may_leave_out_its_language_sit_in_whitespace_or_say_parameters(text):
    content, calls = read_whole(HermesCalls(tool_names=NAMES), text)
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_each_object_of_a_block_is_a_call_and_parallel_tool_calls_false_keeps_the_first():
    text = '```json\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n{"name": "get_weather", "arguments": {}}\n```'
    assert _functions(read_whole(HermesCalls(tool_names=NAMES), text)[1]) == [
        ("get_time", '{"city": "Oslo"}'), ("get_weather", "{}")]
    assert _functions(read_whole(HermesCalls(1, tool_names=NAMES), text)[1]) == [("get_time", '{"city": "Oslo"}')]


@pytest.mark.parametrize("text", [
    '```json\n{\n  "name": "Alice",\n  "age": 30\n}\n```',  # a JSON answer, no tool named
    "Here it is:\n" + QWEN,  # a block after other text is an answer's code
    "```python\nprint(1)\n```",
])
def test_a_block_that_names_no_tool_or_follows_text_is_content_streamed_as_it_comes(text):
    reader = HermesCalls(tool_names=NAMES)
    content, deltas = _streamed_in(reader, list(text))
    assert content == text and deltas == [] and reader.finish()[2] is None
    assert read_whole(HermesCalls(tool_names=NAMES), text) == (text, None)


def test_only_an_opening_that_may_still_be_a_call_block_is_held_back():
    reader = HermesCalls(tool_names=NAMES)
    assert reader.push("```") == ("", []) and reader.push("json\n{\n  \"na") == ("", [])
    assert reader.push('me": "get_') == ("", []) and reader.push('time", ') == ("", [])  # a call: held to its header
    assert reader.push('"arguments": {') == ("", [{"index": 0, "id": reader.reader.objects.calls[0]["id"], "type": "function",
                                                    "function": {"name": "get_time", "arguments": ""}},
                                                   {"index": 0, "function": {"arguments": "{"}}])
    code = HermesCalls(tool_names=NAMES)
    assert code.push("```p") == ("```p", [])  # a code block in another language goes out at once
    assert HermesCalls(tool_names=NAMES).push("Sure") == ("Sure", [])


@pytest.mark.parametrize("text", [
    QWEN.removesuffix("```"),  # the block never closed (max_tokens)
    QWEN + "\nThe weather is nice.",  # more after the block
    QWEN.replace('"arguments": {', '"arguments": ["x", {').replace("\n  }\n}", "\n  }]\n}"),  # not a call's shape
    QWEN.replace("\n}\n```", "\n}\n}\n```"),  # a stray brace
])
def test_a_block_that_is_not_calls_alone_is_content_whole_though_its_call_went_out_streamed(text):
    assert read_whole(HermesCalls(tool_names=NAMES), text) == (text, None)
    content, pushes, calls = streamed(HermesCalls(tool_names=NAMES), text, 4)
    assert calls is None and content in ("", text)  # a call already streamed stays (vLLM's way)


def test_tool_call_blocks_read_as_the_hermes_reader_reads_them():
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _functions(read_whole(HermesCalls(tool_names=NAMES), text)[1]) == _functions(
        read_whole(StreamedCalls(), text)[1]) == [("get_weather", '{"city": "Paris"}')]
    assert read_whole(HermesCalls(tool_names=NAMES), text)[0] == "Let me check. "


@pytest.mark.parametrize("name, start", [("get_weather", 8), ("get\\u005ftime", 8), ("other", -1), ("\\x41", -1)])
def test_a_block_is_known_a_call_by_its_first_name(name, start):
    assert block_start('```json\n  {"name": "' + name + '"', NAMES) == start
    assert block_start("```json\n  {", NAMES) is None and block_start("", NAMES) is None
    assert block_start("```py", NAMES) == -1 and block_start("```js", NAMES) is None  # json begun


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["```", "```json\n", "\n", " ", '{"name": "get_time", "arguments": ',
                                 '{"name": "Bob", "arguments": ', '{"arguments": {}, "name": "get_weather"}', "{", "}",
                                 '"a"', ":", "1", ",", "`", "<tool_call>", "</tool_call>", "x"]), max_size=20).map("".join),
       st.integers(min_value=1, max_value=7), st.sampled_from([None, 1]))
def test_streamed_in_any_pieces_the_hermes_reader_reads_what_it_reads_whole(text, piece, max_calls):
    """Any text in any pieces: the content and calls of reading it in one piece, the streamed
    pieces joined into each call's arguments (or, when the whole text is no calls, all of it is
    content, or the calls streamed so far stay)."""
    reader = HermesCalls(max_calls, tool_names=NAMES)
    content, deltas = _streamed_in(reader, [text[i:i + piece] for i in range(0, len(text), piece)])
    calls = reader.finish()[2]
    whole_reader = HermesCalls(max_calls, tool_names=NAMES)
    whole_content, _ = _streamed_in(whole_reader, [text])
    whole = whole_reader.finish()[2]
    if whole is not None:
        assert content == whole_content and _functions(calls) == _functions(whole)
        assert _joined(deltas) == _functions(whole)
    else:
        assert calls is None and (content == text or (deltas and text.startswith(content)))
