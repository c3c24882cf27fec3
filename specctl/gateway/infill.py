"""llama.cpp's ``POST /infill``, which editor plugins (llama.vim, llama.vscode) call for code
completion: the text between ``input_prefix`` and ``input_suffix``, starting with ``prompt``
(what is typed of the current line), with other files of the project (``input_extra``) before
it. It is served as the completion request it amounts to — the prompt laid out in the model's
FIM tokens (engine.fim), their end tokens as stop tokens — and answered in the shape of
llama.cpp's /completion: ``content``, ``stop``, ``stop_type``, ``tokens_predicted``,
``tokens_evaluated``, ``timings``.

Sampling left out takes llama.cpp's server defaults (temperature 0.8, top-k 40, top-p 0.95,
min-p 0.05), as a llama.cpp user expects of this endpoint; ``n_predict`` -1 (its default) runs
to the end of the context. Not streamed: ``stream: true`` is a 400 pointing at
/v1/completions with ``suffix``, which streams."""

from __future__ import annotations

from typing import Any

import msgspec

from specctl.engine.fim import encode_infill, infill_stops
from specctl.errors import BadRequest
from specctl.gateway.api import ApiError, CompletionRequest


class ExtraFile(msgspec.Struct, kw_only=True):
    text: str = ""
    filename: str = "tmp"


class InfillRequest(msgspec.Struct, kw_only=True):
    """llama.cpp's /infill body (the fields this gateway serves; others are ignored, as there)."""
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = []
    prompt: str = ""
    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1  # -1: a random one
    stop: list[str] = []
    stream: bool = False


def completion_request(asked: InfillRequest, tokenizer: Any, context: int) -> CompletionRequest:
    """The completion request an infill amounts to (its prompt as token ids)."""
    if asked.stream:
        raise ApiError(400, "/infill answers whole here: send stream false, or use /v1/completions with suffix, "
                            "which streams", param="stream")
    if asked.n_predict == 0 or asked.n_predict < -1:
        raise ApiError(400, f"n_predict must be -1 (to the end of the context) or at least 1, got {asked.n_predict}",
                       param="n_predict")
    try:
        ids = encode_infill(tokenizer, asked.input_prefix, asked.input_suffix, asked.prompt,
                            [(extra.filename, extra.text) for extra in asked.input_extra])
        ends = infill_stops(tokenizer)
    except BadRequest as exc:
        raise ApiError(400, str(exc).replace("leave suffix out", "this endpoint cannot serve it"),
                       param="input_suffix") from None
    room = max(1, context - len(ids))  # a prompt past the context: the completion's own 400 says so
    return CompletionRequest(prompt=ids, max_tokens=room if asked.n_predict == -1 else asked.n_predict,
                             temperature=asked.temperature, top_k=asked.top_k, top_p=asked.top_p, min_p=asked.min_p,
                             seed=None if asked.seed == -1 else asked.seed, stop=asked.stop or None,
                             stop_token_ids=list(ends))


def llama_answer(completion: dict, wall_s: float, model: str) -> dict:
    """llama.cpp's /completion answer from the completion's OpenAI body."""
    choice, usage = completion["choices"][0], completion["usage"]
    predicted = usage["completion_tokens"]
    return {
        "content": choice["text"], "model": model, "stop": True,
        # limit: n_predict ran out; eos otherwise (a stop string too: the completion does not say which ended it)
        "stop_type": "limit" if choice["finish_reason"] == "length" else "eos",
        "tokens_predicted": predicted, "tokens_evaluated": usage["prompt_tokens"], "truncated": False,
        "timings": {"prompt_n": usage["prompt_tokens"], "predicted_n": predicted,
                    "predicted_ms": round(wall_s * 1e3, 3),
                    "predicted_per_second": round(predicted / wall_s, 3) if wall_s > 0 else None},
    }
