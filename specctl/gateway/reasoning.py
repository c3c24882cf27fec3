"""vLLM's reasoning parsers (``--reasoning-parser qwen3 | deepseek_r1 | openai_gptoss``, the last
gpt-oss's harmony channels: gateway.harmony): a chat choice's text
split into the model's thinking, up to ``</think>``, and its answer after it — the message's
``reasoning`` (and ``reasoning_content``, its older name, which clients still read) and its
``content``. Only what is shown changes: the tokens, their logprobs and the stop rules are the
target's output as generated.

The output is in thought from its start when the chat template opened a ``<think>`` in the
prompt (DeepSeek-R1, Qwen3 with thinking on: Qwen3's templates switch it with
``chat_template_kwargs.enable_thinking``, on by default) — a ``<think>`` the model writes
itself first is dropped; with thinking off the whole output is the answer. No ``</think>``
(cut by max_tokens): all of it is thinking, as vLLM reads it. Streamed, a piece of text that
may begin ``</think>`` is held back until it is known, so the pieces join into exactly the
whole answer's two fields (tool calls are then read from the answer part alone)."""

from __future__ import annotations

from specctl.gateway.harmony import StreamedHarmony, split_harmony
from specctl.gateway.tool_calls import held_back

PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")
START, END = "<think>", "</think>"
HARMONY = "harmony"  # thinks()'s answer for gpt-oss: its channels say what is thought, not a tag
# parsers that read special tokens in the text (harmony's markers are): a chat request keeps them
KEEPS_SPECIAL_TOKENS = frozenset({"openai_gptoss"})


def check_parser(name: str | None) -> None:
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {name!r}")


def thinks(parser: str, template_kwargs: dict | None, continued: str | None = None) -> bool | str:
    """Whether a request's output starts in thought; HARMONY for gpt-oss's channels.
    ``continued``: the text of a final message the output goes on from (continue_final_message,
    Anthropic's prefill), in thought only where that text left a thought open."""
    if parser == "openai_gptoss":
        return HARMONY
    if continued is not None:
        return START in continued and END not in continued[continued.rfind(START):]
    return parser == "deepseek_r1" or (template_kwargs or {}).get("enable_thinking", True) is not False


def reasoning_reader(thinking: bool | str) -> "StreamedReasoning | StreamedHarmony":
    """A streamed choice's reader for ``thinking`` (thinks()'s answer)."""
    return StreamedHarmony() if thinking == HARMONY else StreamedReasoning(bool(thinking))


class StreamedReasoning:
    """A choice's text pushed as it comes: (reasoning, content) to hand out for each piece;
    ``finish`` hands out what was held back, as reasoning."""

    def __init__(self, thinking: bool) -> None:
        self.state = "opening" if thinking else "answer"  # opening -> thinking -> answer
        self.held = ""

    def push(self, delta: str) -> tuple[str, str]:
        if self.state == "answer":
            return "", delta
        text, self.held = self.held + delta, ""
        if self.state == "opening":
            opened = text.lstrip()
            if opened.startswith(START):
                text = opened[len(START):]
            elif START.startswith(opened):  # whitespace, or a <think> begun: not known yet
                self.held = text
                return "", ""
            self.state = "thinking"
        reasoning, closed, content = text.partition(END)
        if closed:
            self.state = "answer"
            return reasoning, content
        keep = held_back(text, END)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> str:
        rest, self.held = self.held, ""
        return rest


def split_reasoning(text: str, thinking: bool | str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output, None where there is none: the streamed split
    of it in one piece, so a whole answer and a stream's pieces always agree."""
    if thinking == HARMONY:
        return split_harmony(text)
    if not thinking:
        return None, text
    parser = StreamedReasoning(thinking)
    reasoning, content = parser.push(text)
    return reasoning + parser.finish(), content or None


def thinking_budget(budget: int | None, parser: str | None, tokenizer,
                    required: bool = True) -> tuple[int, tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """vLLM's thinking_token_budget as SamplingParams takes it — (budget, (<think>'s ids,
    </think>'s ids)) — or None: none asked, or (not ``required``: Anthropic's budget_tokens) no
    parser that knows where a thought ends."""
    if budget is None:
        return None
    if budget < 0:
        raise ValueError(f"thinking_token_budget must be >= 0, got {budget}")
    if parser not in ("qwen3", "deepseek_r1"):
        if not required:
            return None
        raise ValueError("thinking_token_budget needs to know where a thought ends: start the gateway with "
                         "--reasoning-parser qwen3 or deepseek_r1")
    return budget, (marker_ids(tokenizer, START), marker_ids(tokenizer, END))


def marker_ids(tokenizer, marker: str) -> tuple[int, ...]:
    """A marker's token ids: its own token where the vocabulary has one (Qwen3's, DeepSeek-R1's), else its text's."""
    added = tokenizer.get_added_vocab()
    return (added[marker],) if marker in added else tuple(tokenizer.encode(marker, add_special_tokens=False))
