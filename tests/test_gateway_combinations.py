"""A request's options drawn together by hypothesis through the gateway's OpenAI API (the
official client): prompts in several scripts, penalties, a bias, logprobs, echo, n, seeded
samples and stop strings drawn from the text the request writes without them. A streamed answer
is the whole answer in pieces (text, finish reasons, logprobs, usage), and a stop string cuts
the text the request writes without it where that string first completes, as a target making
one token at a time would."""

from hypothesis import given
from hypothesis import strategies as st

from tests.test_combinations import SETTINGS

WORDS = ["The", " quick", " fox", " über", " naïve", " 東京", " 🦊", " café", "\n", " def", "(", ")", ":", " 42", "  "]


@st.composite
def _bodies(draw) -> dict:
    """A completions body without its stop strings (drawn once its text is known)."""
    body = {"prompt": "".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=12))),
            "max_tokens": draw(st.integers(1, 20)), "temperature": 0.0}
    extra: dict = {"ignore_eos": True}
    if draw(st.booleans()):
        body |= {"temperature": draw(st.sampled_from([0.7, 1.3])), "seed": draw(st.integers(0, 99))}
    if draw(st.booleans()):
        body["presence_penalty"] = draw(st.sampled_from([-1.0, 0.5, 2.0]))
    if draw(st.booleans()):
        body["frequency_penalty"] = draw(st.sampled_from([-0.5, 1.0]))
    if draw(st.booleans()):
        extra["repetition_penalty"] = draw(st.sampled_from([0.8, 1.5]))
    if draw(st.booleans()):
        body["logit_bias"] = {str(t): draw(st.sampled_from([-100, 5])) for t in draw(st.lists(
            st.integers(0, 255), min_size=1, max_size=3))}
    if draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        body["echo"] = True
    if draw(st.booleans()):
        body["n"] = 2
    return body | {"extra_body": extra}


def _choices(answer) -> list[tuple[str, str, list | None]]:
    return [(c.text, c.finish_reason, c.logprobs.tokens if c.logprobs else None)
            for c in sorted(answer.choices, key=lambda c: c.index)]


def _streamed(client, model: str, body: dict):
    """(choices, usage) of the streamed answer, its pieces joined per choice."""
    texts, reasons, tokens, usage = {}, {}, {}, None
    for chunk in client.completions.create(model=model, stream=True, stream_options={"include_usage": True}, **body):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
            if choice.logprobs is not None:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
    return [(texts[i], reasons.get(i), tokens.get(i)) for i in sorted(texts)], usage


def _cut(text: str, stops: list[str], prompt: str, echo: bool) -> tuple[str, bool]:
    """``text`` (written without stop strings) cut where the first of ``stops`` completes: the
    shortest output prefix holding one, less that stop string and what follows it."""
    head, output = (prompt, text[len(prompt):]) if echo else ("", text)
    ends = [(output.index(s) + len(s), output.index(s)) for s in stops if s in output]
    if not ends:
        return text, False
    end = min(e for e, _ in ends)
    # the first stop string completed by then (they may overlap): where the earliest of them starts
    start = min(output.index(s) for s in stops if s in output[:end])
    return head + output[:start], True


@SETTINGS
@given(data=st.data())
def test_a_drawn_completion_streams_as_it_answers_whole_and_stops_where_its_stop_string_completes(
        cluster, client, tiny_dir, data):
    model = str(tiny_dir["llama"])
    body = data.draw(_bodies())
    whole = client.completions.create(model=model, **body)
    expected = _choices(whole)
    streamed, usage = _streamed(client, model, body)
    assert streamed == expected
    # (the cached prompt tokens differ: the second request finds the first one's prefix cached)
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    if body.get("temperature") and "seed" not in body:
        return
    written = expected[0][0]
    output = written[len(body["prompt"]):] if body.get("echo") else written
    if not output.strip():
        return
    stops = [output[i:i + width] for i, width in data.draw(st.lists(
        st.tuples(st.integers(0, len(output) - 1), st.integers(1, 4)), min_size=1, max_size=2))]
    stops = [s for s in stops if s.strip()]
    if not stops:
        return
    stopped = client.completions.create(model=model, stop=stops, **body)
    for (text, reason, _), (written, written_reason, _) in zip(_choices(stopped), expected):
        cut, completed = _cut(written, stops, body["prompt"], body.get("echo", False))
        assert text == cut, (stops, written)
        assert reason == ("stop" if completed else written_reason)
    assert _streamed(client, model, body | {"stop": stops})[0] == _choices(stopped)


@st.composite
def _chats(draw) -> dict:
    """A greedy chat: its messages, a token limit, perhaps penalties and stop strings."""
    texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map("".join)
    turns = draw(st.lists(texts, min_size=1, max_size=3))
    messages = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(turns)]
    if len(messages) % 2 == 0:
        messages.append({"role": "user", "content": "Go on."})
    chat = {"messages": messages, "max_tokens": draw(st.integers(1, 16)), "presence_penalty": 0.0}
    if draw(st.booleans()):
        chat["presence_penalty"] = draw(st.sampled_from([-1.0, 1.5]))
    if draw(st.booleans()):
        chat["stop"] = draw(st.lists(st.sampled_from(["a", "e", " ", "\n", "�", "o", "th"]), min_size=1, max_size=2,
                                     unique=True))
    return chat


@SETTINGS
@given(chat=_chats())
def test_a_drawn_chat_answers_the_same_text_streamed_or_whole_in_every_api(cluster, client, tiny_dir, chat):
    """Chat Completions, the Responses API and Anthropic's Messages API render the same chat
    template and stop the same way: one text, streamed or whole."""
    import anthropic

    model, options = str(tiny_dir["llama"]), {"temperature": 0, "extra_body": {
        "ignore_eos": True, "presence_penalty": chat["presence_penalty"]}}
    whole = client.chat.completions.create(model=model, messages=chat["messages"], max_tokens=chat["max_tokens"],
                                           stop=chat.get("stop"), **options)
    text, reason = whole.choices[0].message.content, whole.choices[0].finish_reason
    pieces, reasons = [], []
    for chunk in client.chat.completions.create(model=model, messages=chat["messages"], max_tokens=chat["max_tokens"],
                                                stop=chat.get("stop"), stream=True, **options):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert ("".join(pieces), [r for r in reasons if r]) == (text, [reason])

    if chat["presence_penalty"]:
        return  # the Responses and Messages APIs take no penalties (nor ignore_eos: an end of text may come first)
    if "stop" not in chat:  # the Responses API takes no stop strings
        answer = client.responses.create(model=model, input=chat["messages"], max_output_tokens=chat["max_tokens"],
                                         temperature=0)
        deltas, last = [], None
        for event in client.responses.create(model=model, input=chat["messages"],
                                             max_output_tokens=chat["max_tokens"], temperature=0, stream=True):
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                last = event.response
        assert "".join(deltas) == last.output_text == answer.output_text and last.status == answer.status
        assert answer.output_text == text if answer.status == "incomplete" else text.startswith(answer.output_text)

    claude = anthropic.Anthropic(base_url=cluster[1]["gateway"], api_key="unused", max_retries=0)
    request = {"model": model, "messages": chat["messages"], "max_tokens": chat["max_tokens"],
               "stop_sequences": chat.get("stop", []), "extra_body": {"temperature": 0}}
    message = claude.messages.create(**request)
    written = "".join(block.text for block in message.content)
    if message.stop_reason == "end_turn":
        assert text.startswith(written)
    else:
        assert written == text
        assert message.stop_reason == {"length": "max_tokens", "stop": "stop_sequence"}[reason]
    with claude.messages.stream(**request) as stream:
        assert "".join(stream.text_stream) == written
        assert stream.get_final_message().stop_reason == message.stop_reason
