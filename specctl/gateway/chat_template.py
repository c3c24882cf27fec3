"""vLLM's ``--chat-template``: the chat template the gateway renders conversations with, in place
of the tokenizer's — a file, or the template itself — checked (it must compile) before any model
loads, so a typo is one line at start rather than a 500 on the first chat request."""

from __future__ import annotations

from pathlib import Path


def load_chat_template(value: str) -> str:
    """The template text ``value`` names (ValueError naming what is wrong)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template  # the environment transformers renders in

    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text()
    elif "{" in value:  # a template given inline, as vLLM takes one
        text = value
    else:
        raise ValueError(f"--chat-template {value!r}: no such file; give a template file or the template itself")
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template does not compile: {exc.message} (line {exc.lineno})") from None
    return text
