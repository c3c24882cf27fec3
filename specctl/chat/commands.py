"""What a chat keeps (``ChatState``) and the /commands that change it: pure functions of the
state and the line typed, each returning what to tell the user (the REPL does the I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specctl.chat import transcript
from specctl.gateway.translate import REASONING_EFFORTS

HELP = ("commands: /reset or /clear (forget the conversation), /undo (drop the last exchange), /retry (answer the last "
        "message again), /system TEXT (the system prompt; /system alone drops it), /temp T (sampling temperature), "
        "/max N (most tokens a reply), /effort LEVEL (reasoning effort: none|minimal|low|medium|high|xhigh, "
        "default = the model's), /predict FILE (the next reply is expected to resemble FILE — an edit of it: "
        "drafted from, the answer unchanged), /save FILE, /load FILE (the conversation as JSON), /stats, /quit (or /bye); "
        "a message of several lines between \"\"\" and \"\"\"; Ctrl-C stops a reply")


class Quit(Exception):
    pass


@dataclass(slots=True)
class ChatState:
    temperature: float = 0.0
    max_tokens: int = 256
    messages: list[dict] = field(default_factory=list)
    system: str = ""  # the system prompt, sent before the conversation (kept by /reset)
    reasoning_effort: str | None = None  # OpenAI's reasoning_effort; None: not sent (the template's default)
    prediction: str | None = None  # the next reply's Predicted Output (/predict), sent once
    # llama.cpp's return_progress asked for; False once a gateway refused it (OpenAI's refuses unknown fields)
    ask_progress: bool = True

    def request_messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def request_body(self) -> dict:
        """The chat completion request for the conversation as it stands (streamed, with usage)."""
        # return_progress: llama.cpp's (a long prompt's prefill shows as it goes); vLLM and SGLang ignore it
        body = {"messages": self.request_messages(), "temperature": self.temperature, "max_tokens": self.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.ask_progress:
            body["return_progress"] = True
        if self.reasoning_effort is not None:
            body["reasoning_effort"] = self.reasoning_effort
        if self.prediction is not None:
            body["prediction"] = {"type": "content", "content": self.prediction}
        return body


def command(line: str, state: ChatState) -> str:
    """Apply a /command to the state; returns what to tell the user."""
    name, _, arg = line.strip().partition(" ")
    # Ollama's and llama.cpp's names too, which users of those type out of habit
    if name in ("/quit", "/exit", "/q", "/bye"):
        raise Quit
    if name in ("/reset", "/clear"):
        state.messages.clear()
        return "conversation cleared"
    if name == "/temp":
        try:
            value = float(arg)
        except ValueError:
            return f"usage: /temp T (now {state.temperature}); 0 = greedy, exactly the target's own output"
        if not 0 <= value <= 100:
            return "temperature must be between 0 and 100"
        state.temperature = value
        return f"temperature {value}"
    if name == "/system":
        state.system = arg.strip()
        return f"system prompt: {state.system}" if state.system else "no system prompt"
    if name == "/max":
        try:
            value = int(arg)
        except ValueError:
            return f"usage: /max N (now {state.max_tokens}): the most tokens a reply may have"
        if value < 1:
            return "/max must be at least 1"
        state.max_tokens = value
        return f"at most {value} tokens a reply"
    if name == "/effort":
        return _effort(arg.strip(), state)
    if name == "/predict":
        return _predict(arg.strip(), state)
    if name == "/undo":
        asked = [i for i, message in enumerate(state.messages) if message["role"] == "user"]
        if not asked:
            return "nothing to undo"
        del state.messages[asked[-1]:]
        return f"dropped the last exchange ({len(state.messages)} messages left)"
    if name in ("/save", "/load"):
        return _file_command(name, arg.strip(), state)
    if name in ("/help", "/?"):
        return HELP
    return f"unknown command {name}; {HELP}"


def _effort(level: str, state: ChatState) -> str:
    if level == "default":
        state.reasoning_effort = None
        return "reasoning effort: the model's default"
    if level not in REASONING_EFFORTS:
        now = state.reasoning_effort or "default"
        return f"usage: /effort {'|'.join(REASONING_EFFORTS)}|default (now {now})"
    state.reasoning_effort = level
    return f"reasoning effort {level}"


def _predict(path: str, state: ChatState) -> str:
    if not path:
        dropped, state.prediction = state.prediction is not None, None
        return "prediction dropped" if dropped else "usage: /predict FILE (the next reply is expected to resemble it)"
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot read {path}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"
    state.prediction = text
    return f"the next reply is predicted from {path} ({len(text)} characters; /predict alone drops it)"


def _file_command(name: str, path: str, state: ChatState) -> str:
    if not path:
        return f"usage: {name} FILE (the conversation as JSON)"
    try:
        if name == "/save":
            return f"saved {transcript.save(path, state)} messages to {path}"
        saved = transcript.load(path)
    except (OSError, transcript.TranscriptError) as exc:
        return f"cannot {name[1:]} {path}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"
    for setting, value in saved.items():
        setattr(state, setting, value)
    return f"loaded {len(state.messages)} messages from {path}"


def retry_point(state: ChatState) -> bool:
    """Readies /retry: the last reply dropped so the last user message is answered again;
    False when there is no user message to answer."""
    if state.messages and state.messages[-1]["role"] == "assistant":
        state.messages.pop()
    return bool(state.messages) and state.messages[-1]["role"] == "user"
