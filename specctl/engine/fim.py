"""Fill-in-the-middle: a code model trained to infill writes the text between a prefix and a
suffix when its prompt is prefix-suffix-middle in its own FIM tokens (OpenAI completions'
``suffix``, DeepSeek's and Mistral's FIM APIs; llama.cpp's /infill builds the same prompt).

The model says which FIM tokens it knows: its vocabulary holds one of the families below, as
llama.cpp reads them from a GGUF's tokenizer.ggml.fim_* keys. The prompt is the tokenizer's
usual start (BOS where it adds one), the prefix token, the prefix's ids, the suffix token, the
suffix's ids and the middle token — or, for Codestral's family (Mistral's tokenizers), suffix
first: the suffix token, the suffix's ids, the prefix token and the prefix's ids, which the
middle continues with no token of its own (mistral-common's ``encode_fim``). The model's answer
is the middle, which ends with its end of text or a FIM control token (file or repository
separators, the padding token) — llama.cpp's end-of-generation set, stop tokens of the request.
Nothing else changes: the output is the target's own continuation of that prompt, in every mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from specctl.errors import BadRequest

# (prefix, suffix, middle, the tokens that end an infill besides the model's EOS)
FAMILIES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    # Qwen2.5-Coder, Qwen3-Coder, CodeGemma
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
     ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|file_separator|>")),
    # StarCoder, StarCoder2, Granite Code
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<|endoftext|>", "<fim_pad>", "<file_sep>", "<repo_name>")),
    # SantaCoder
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>", ("<|endoftext|>", "<fim-pad>")),
    # DeepSeek-Coder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", ("<｜end▁of▁sentence｜>", "<|EOT|>")),
    # CodeLlama
    ("▁<PRE>", "▁<SUF>", "▁<MID>", ("▁<EOT>",)),
)
# Suffix-prefix-middle families, (prefix, suffix, end tokens): Codestral, Mistral's v2/v3 and
# Tekken tokenizers (their [MIDDLE], where the vocabulary has one, is not part of the prompt)
SPM_FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (("[PREFIX]", "[SUFFIX]", ("</s>",)),)


# the repository-level tokens (Qwen2.5-Coder's and StarCoder2's): other files of the project
# go before the infill as "<repo>name" then "<file_sep>path\ntext" each (llama.cpp's input_extra)
REPO_TOKENS = (("<|repo_name|>", "<|file_sep|>"), ("<repo_name>", "<file_sep>"))


@dataclass(frozen=True, slots=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int | None  # None: a suffix-prefix-middle family, whose middle follows the prefix
    stops: tuple[int, ...]  # the ids of the family's end tokens the vocabulary holds
    repo: int | None = None  # the repository-name and file-separator tokens, where it has them
    file_sep: int | None = None


def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The model's FIM tokens, or None when its vocabulary holds no family of them."""
    vocab = tokenizer.get_vocab()
    for prefix, suffix, middle, stops in FAMILIES:
        if prefix in vocab and suffix in vocab and middle in vocab:
            repo, file_sep = next(((vocab[r], vocab[f]) for r, f in REPO_TOKENS if r in vocab and f in vocab),
                                  (None, None))
            return FimTokens(vocab[prefix], vocab[suffix], vocab[middle],
                             tuple(vocab[stop] for stop in stops if stop in vocab), repo, file_sep)
    for prefix, suffix, stops in SPM_FAMILIES:
        if prefix in vocab and suffix in vocab:
            return FimTokens(vocab[prefix], vocab[suffix], None, tuple(vocab[stop] for stop in stops if stop in vocab))
    return None


def require_fim(tokenizer: Any) -> FimTokens:
    """The model's FIM tokens; a model without them is a BadRequest that says what would do."""
    tokens = fim_tokens(tokenizer)
    if tokens is None:
        raise BadRequest("suffix needs a model trained to fill in the middle, whose vocabulary has FIM tokens "
                         "(Qwen2.5-Coder, StarCoder2, DeepSeek-Coder, CodeLlama, CodeGemma, Codestral); "
                         "this one has none: leave suffix out")
    return tokens


def infill_stops(tokenizer: Any, beside: Sequence[int] = ()) -> tuple[int, ...]:
    """The tokens that end an infill (stop tokens of the request, beside the model's EOS),
    after ``beside`` (the request's own stop tokens, or the EOS), each once."""
    return tuple(dict.fromkeys((*beside, *require_fim(tokenizer).stops)))


def encode_infill(tokenizer: Any, prefix: str | list[int], suffix: str, middle: str = "",
                  files: Sequence[tuple[str, str]] = ()) -> list[int]:
    """The infilling prompt for the text between ``prefix`` (text, or token ids as given) and
    ``suffix``, in the model's FIM tokens (raises BadRequest without them). ``middle``: the
    answer's start, already written (llama.cpp's prompt); ``files``: (path, text) of other files
    of the project, before it all — in the repository-level layout where the model has its
    tokens, else each after a plain separator line, as llama.cpp lays them out."""
    tokens = require_fim(tokenizer)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    start = tokenizer.encode("")  # BOS where the tokenizer adds one (CodeLlama, DeepSeek-Coder)
    context: list[int] = []
    if files and tokens.file_sep is not None:
        context = [tokens.repo, *encode("myproject\n")]
        for path, text in files:
            context += [tokens.file_sep, *encode(f"{path}\n"), *encode(text)]
        context += [tokens.file_sep, *encode("filename\n")]  # the file being edited (llama.cpp names it so)
    else:
        for _, text in files:
            context += encode("\n\n--- snippet ---\n\n") + encode(text)
    before = encode(prefix) if isinstance(prefix, str) else list(prefix)
    if tokens.middle is None:
        return [*start, *context, tokens.suffix, *encode(suffix), tokens.prefix, *before, *encode(middle)]
    return [*start, *context, tokens.prefix, *before, tokens.suffix, *encode(suffix), tokens.middle, *encode(middle)]
