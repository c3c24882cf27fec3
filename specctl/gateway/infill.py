"""llama.cpp's ``POST /infill``, which editor plugins (llama.vim, llama.vscode) call for code
completion: the text between ``input_prefix`` and ``input_suffix``, starting with ``prompt``
(what is typed of the current line), with other files of the project (``input_extra``) before
it. It is served as the completion request it amounts to — the prompt laid out in the model's
FIM tokens (engine.fim), their end tokens as stop tokens — with every option of /completion
and its answer, whole or streamed (gateway.llama)."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import msgspec

from specctl.engine.fim import encode_infill, infill_stops
from specctl.errors import BadRequest
from specctl.gateway.api import ApiError, CompletionRequest
from specctl.gateway.request_body import parse_body
from specctl.gateway.llama import LlamaOptions, completion_request, llama_reply
from specctl.gateway.request_checks import check_prompt_chars
from specctl.gateway.llama_reply import LlamaReply


class ExtraFile(msgspec.Struct, kw_only=True):
    text: str = ""
    filename: str = "tmp"


class InfillRequest(LlamaOptions, kw_only=True):
    """llama.cpp's /infill body: /completion's options and the infill's parts."""
    endpoint: ClassVar[str] = "/infill"  # named in the log of fields it ignores
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = []
    prompt: str = ""


def infill_ids(asked: InfillRequest, tokenizer: Any) -> tuple[list[int], tuple[int, ...]]:
    """The infill's prompt ids and the end tokens that stop it."""
    try:
        return (encode_infill(tokenizer, asked.input_prefix, asked.input_suffix, asked.prompt,
                              [(extra.filename, extra.text) for extra in asked.input_extra]),
                infill_stops(tokenizer))
    except BadRequest as exc:
        raise ApiError(400, str(exc).replace("leave suffix out", "this endpoint cannot serve it"),
                       param="input_suffix") from None


def parse_infill(body: bytes, tokenizer: Any, context: int, model: str) -> tuple[CompletionRequest, LlamaReply]:
    """An /infill body as the completion request it amounts to, and what answers it."""
    started = time.perf_counter()
    asked = parse_body(body, InfillRequest)
    texts = [asked.input_prefix, asked.input_suffix, asked.prompt, *(e.filename + e.text for e in asked.input_extra)]
    check_prompt_chars(sum(map(len, texts)), tokenizer, context, "input_prefix")
    ids, ends = infill_ids(asked, tokenizer)
    req = completion_request(asked, [ids], context, ends)
    return req, llama_reply(asked, req, [ids], False, model, context, started, tokenizer)
