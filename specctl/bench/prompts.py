"""Benchmark prompt sets: the shipped mixes (code, prose, JSON, chat, infills) or a JSON-lines
file of ``{"prompt": "...", "chat": true|false, "kind": "..."}`` objects; ``"suffix": "..."``
makes a prompt an infill (fill in the middle, engine.fim: the prompt is the text before)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specctl.errors import ConfigError


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    prompt: str
    chat: bool
    kind: str = "custom"
    suffix: str | None = None  # an infill: the text after the answer
    prediction: str | None = None  # what the answer is expected to resemble (OpenAI's Predicted Outputs)


def _parse(lines: list[str], source: str) -> list[BenchPrompt]:
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not isinstance(obj.get("chat", False), bool):
            raise ConfigError(f'{source}:{number}: expected {{"prompt": "...", "chat": true|false}}')
        suffix = obj.get("suffix")
        if suffix is not None and (not isinstance(suffix, str) or obj.get("chat", False)):
            raise ConfigError(f'{source}:{number}: "suffix" is the text after an infill (a string), not with "chat"')
        prediction = obj.get("prediction")
        if prediction is not None and not isinstance(prediction, str):
            raise ConfigError(f'{source}:{number}: "prediction" is the text the answer is expected to resemble (a string)')
        prompts.append(BenchPrompt(obj["prompt"], obj.get("chat", False), obj.get("kind", "custom"), suffix,
                                   prediction))
    if not prompts:
        raise ConfigError(f"{source}: no prompts")
    return prompts


# Shipped sets: "builtin" (8 prompts the defaults were chosen on) and "heldout" (20 prompts,
# 5 each of code, prose, chat and JSON, written before any measurement on them and never
# tuned on: the figures that say how specctl does on text it has not seen), and "mixed" (16
# prompts, 4 each of code, prose, repetition-heavy edits and summaries of given text: where
# a model draft, an early exit and n-gram lookup each do best; written for bench drafters
# before any measurement on them).
# "infill" (12 code infills: a function's body, a loop's middle, a call's arguments, written
# before any measurement on them) measures fill in the middle, the editor's code completion.
# "edits" (8 requests to change a given function, each with the function as its prediction —
# OpenAI's Predicted Outputs; written before any measurement on them) measures the
# MODE+prediction modes; "long-edits" (6 such requests on 40-50 lines of code, written after the
# predicted depth was made adaptive and before any measurement on them) measures long copies.
SHIPPED = {"builtin": "data/builtin_prompts.jsonl", "heldout": "data/heldout_prompts.jsonl",
           "mixed": "data/mixed_prompts.jsonl", "infill": "data/infill_prompts.jsonl",
           "edits": "data/edit_prompts.jsonl", "long-edits": "data/long_edit_prompts.jsonl"}


def load_prompts(source: str) -> list[BenchPrompt]:
    if source in SHIPPED:
        text = resources.files("specctl").joinpath(SHIPPED[source]).read_text()
        return _parse(text.splitlines(), source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"prompt file {source!r} not found (use builtin, heldout, mixed, infill, edits, long-edits or a "
                          "JSON-lines file)")
    return _parse(path.read_text().splitlines(), source)
