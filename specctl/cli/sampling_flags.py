"""The sampling flags of ``specctl generate`` checked and turned into SamplingParams fields, as
the gateway turns the same fields of a request: a constraint, bad words, stop patterns, the
sampler order — each wrong value a ConfigError naming its flag, before the models load."""

from __future__ import annotations

import json

from specctl.engine import text


def text_of(value: str) -> str:
    """A flag's text, or with @FILE the file's."""
    from pathlib import Path

    from specctl.errors import ConfigError

    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {value[1:]}: {exc.strerror}") from None


def structured_flags(json_schema: str | None, json_object: bool, regex: str | None, choice: list[str] | None,
                     grammar: str | None) -> tuple[str, str] | None:
    """The one constraint the flags ask for, checked (spec.structured); None: the output is free."""
    from specctl.errors import ConfigError
    from specctl.spec.structured import JSON_OBJECT, grammar_text

    asked = [structured for structured in (
        ("json", text_of(json_schema)) if json_schema else None, ("json", JSON_OBJECT) if json_object else None,
        ("regex", regex) if regex else None, ("choice", json.dumps(choice)) if choice else None,
        ("grammar", text_of(grammar)) if grammar else None) if structured is not None]
    if len(asked) > 1:
        raise ConfigError("give one of --json-schema, --json-object, --regex, --choice, --grammar")
    if asked:
        grammar_text(*asked[0])  # InvalidSamplingParams says what is wrong
    return asked[0] if asked else None


def with_bad_words(params, words: list[str] | None, tokenizer):
    """The sampling parameters with ``--bad-words`` encoded by the target's tokenizer (as the
    gateway encodes a request's bad_words)."""
    import dataclasses

    from specctl.errors import BadRequest, ConfigError

    if not words:
        return params
    try:
        return dataclasses.replace(params, bad_words=text.bad_word_sequences(tokenizer, words))
    except BadRequest as exc:
        raise ConfigError(f"--bad-words: {exc}") from None


def with_prediction_text(params, prediction: str | None, tokenizer):
    """``--prediction``'s text (read already) as the token ids the target drafts from."""
    import dataclasses

    if prediction is None:
        return params
    return dataclasses.replace(params, prediction=tuple(tokenizer.encode(prediction, add_special_tokens=False)))


def with_thinking_budget(params, budget: int | None, tokenizer):
    """``--thinking-budget``: a thought ended after ``budget`` tokens (spec.thinking_budget), its
    markers the tokenizer's <think> and </think> (their tokens, or their text's)."""
    import dataclasses

    from specctl.gateway.reasoning import END, START, marker_ids

    if budget is None:
        return params
    return dataclasses.replace(params, thinking_budget=budget,
                               thinking_markers=(marker_ids(tokenizer, START), marker_ids(tokenizer, END)))


def stop_patterns(patterns: list[str] | None):
    """``--stop-regex`` compiled (engine.stop_regex: SGLang's stop_regex and its limits)."""
    from specctl.engine.stop_regex import compile_stop_patterns
    from specctl.errors import BadRequest, ConfigError

    try:
        return compile_stop_patterns(patterns)
    except BadRequest as exc:
        raise ConfigError(f"--stop-regex: {exc}") from None


def with_samplers(params, samplers: str | None):
    """``params`` with ``--samplers``' order, the samplers it leaves out off (llama.cpp's
    ``--samplers``: names separated by ';' or ','; or its ``--sampling-seq`` letters, "kpmt")."""
    from specctl.errors import ConfigError
    from specctl.gateway.api import ApiError
    from specctl.gateway.llama_samplers import NAMES, sampler_chain

    if samplers is None:
        return params
    names = [name.strip() for name in samplers.replace(",", ";").split(";")]
    given = names if len(names) > 1 or samplers.strip().lower() in NAMES else samplers.strip()
    try:
        return sampler_chain(given).applied(params)
    except ApiError as exc:
        raise ConfigError(f"--samplers: {exc}") from None
