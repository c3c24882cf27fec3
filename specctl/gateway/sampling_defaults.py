"""The sampling a request gets for what it leaves out, as vLLM's ``--generation-config`` sets it:
``auto`` (vLLM's default) takes the model creator's recommendation from the checkpoint's
``generation_config.json`` — its temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens (as max_tokens), where they differ from transformers' defaults —; ``vllm`` keeps
OpenAI's (temperature 1, top_p 1, no top_k); a folder takes that folder's file. A request's own
values always win."""

from __future__ import annotations

from pathlib import Path

SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def sampling_defaults(model_path: Path | str, source: str = "auto") -> dict[str, float | int]:
    """The defaults ``source`` gives for the model at ``model_path``; ValueError for a folder
    without a generation config."""
    from transformers import GenerationConfig

    if source == "vllm":
        return {}
    check_source(source)
    folder = Path(model_path) if source == "auto" else Path(source).expanduser()
    if not (folder / "generation_config.json").is_file():  # auto, a checkpoint without one: nothing recommended
        return {}
    diff = GenerationConfig.from_pretrained(folder).to_diff_dict()
    defaults = {key: diff[key] for key in SAMPLING_KEYS if diff.get(key) is not None}
    if "max_new_tokens" in defaults:  # transformers' name for max_tokens
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


def check_source(source: str) -> None:
    """``--generation-config``'s value, checked before any model loads (ValueError)."""
    if source not in ("auto", "vllm") and not (Path(source).expanduser() / "generation_config.json").is_file():
        raise ValueError(f"--generation-config must be auto, vllm or a folder holding generation_config.json; "
                         f"{source!r} holds none")


def describe(defaults: dict[str, float | int]) -> str:
    """The line a server prints when a model's generation config changes its defaults."""
    values = ", ".join(f"{key}={value:g}" for key, value in sorted(defaults.items()))
    return (f"default sampling from the model's generation config: {values} (a request's own values win; "
            "--generation-config vllm keeps OpenAI's defaults)")
