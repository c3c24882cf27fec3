"""Load a Hugging Face checkpoint directory into specctl's Decoder, reading only the
tensors of the requested layer range (pipeline stages load only their own weights)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors import SafetensorError, safe_open

from specctl.engine.checkpoint import (FLOAT32_ROUTER, checkpoint_key, checkpoint_name, dequantize_fp8,
                                       dequantize_mxfp4, expert_stacks, fp8_block_size, fused_checkpoint_keys,
                                       fused_rows, part_of, quantized_part)
from specctl.engine.families import checkpoint_unreadable, read_text_config, text_config
from specctl.engine.model import Decoder
from specctl.engine.spec import ModelSpec
from specctl.engine.tokenizers import load_tokenizer, vocab_fingerprint
from specctl.errors import CheckpointUnreadable, ModelNotFound, UnsupportedArchitecture, VocabMismatch
from specctl_kernels import select_backend

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    spec: ModelSpec
    decoder: Decoder
    tokenizer: Any = field(repr=False)
    eos_token_ids: tuple[int, ...] = ()
    _fingerprint: str | None = field(default=None, repr=False, compare=False)

    @property
    def vocab_fingerprint(self) -> str:
        """Computed once: hashing a 150k-token vocabulary takes a noticeable fraction of a
        second, and every handshake sends it."""
        if self._fingerprint is None:
            self._fingerprint = vocab_fingerprint(self.tokenizer)
        return self._fingerprint


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    if target.vocab_fingerprint != draft.vocab_fingerprint:
        raise VocabMismatch(
            f"draft {draft.name!r} and target {target.name!r} have different vocabularies "
            f"({len(draft.tokenizer)} vs {len(target.tokenizer)} tokens, fingerprints "
            f"{draft.vocab_fingerprint} vs {target.vocab_fingerprint}); pick a draft from the target's model family "
            f"with --draft (--draft {target.name}@N drafts with the target's own first N layers) or use --mode ngram, "
            "which needs no draft model"
        )


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None else tensor.to(dtype)


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin"))[:1]
        raise ModelNotFound(f"no .safetensors weights in {path}" + (
            f" (only {pickled[0]}: specctl reads no pickled weights; save the model again with transformers' "
            "save_pretrained, which writes safetensors)" if pickled else ""))
    return files


def load_decoder(
    path: Path,
    dtype: torch.dtype | None = torch.float32,
    layer_range: tuple[int, int] | None = None,
    embed: bool = True,
    head: bool = True,
    device: str = "cpu",
    backend: str = "torch",
    config: Any = None,
    latent_cache: bool = True,
) -> Decoder:
    """``backend``: an attention backend or ``auto`` (chosen here, from device, dtype and
    head dim). ``dtype`` None keeps the checkpoint's own dtypes, for a caller that converts
    the model next (int8 quantization: no fp32 copy of the whole model is ever held).
    ``latent_cache``: a latent-attention model's (DeepSeek-V2/V3) cache (ModelSpec.latent_cache)."""
    config = read_text_config(path) if config is None else text_config(config)
    spec = ModelSpec.from_hf(config, latent_cache)
    backend = select_backend(backend, device, dtype or torch.float32, spec.head_dim, spec.attn_softcap, spec.window,
                             spec.attention_sinks)
    with torch.device("meta"):
        decoder = Decoder(spec, layer_range, embed, head, backend)
    first, last = decoder.layer_range
    wanted = {}
    for name in decoder.state_dict():
        if name.startswith("layers."):
            index, rest = name[len("layers.") :].split(".", 1)
            wanted[f"model.layers.{int(index) + first}.{checkpoint_name(spec, rest)}"] = name
        elif name in ("lm_head.weight", "lm_head.bias"):  # (Phi's head has a bias)
            wanted[name] = name
        else:
            wanted[f"model.{name}"] = name
    if spec.tie_embeddings and "lm_head.weight" in wanted:
        wanted.pop("lm_head.weight")
        wanted.setdefault("model.embed_tokens.weight", None)  # read once, used twice
    fused = {**fused_checkpoint_keys(wanted, spec), **expert_stacks(spec, first, last)}
    shapes = {name: tensor.shape for name, tensor in decoder.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    unused: list[str] = []
    fp8_block = fp8_block_size(config)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # a quantized tensor's parts, until all of them are read

    def place(key: str, tensor: torch.Tensor) -> None:
        """A checkpoint tensor (its stored dtype) into the decoder's state, or noted as unused."""
        if key in fused:
            state.update(fused[key].parts(fused_rows(spec, _cast(tensor, dtype)), shapes))
        elif key in wanted:
            if spec.routing in ("sigmoid_grouped", "softmax_grouped") and key.endswith(FLOAT32_ROUTER):  # as transformers
                tensor = tensor.float()
            else:
                tensor = _cast(tensor, dtype)
            if wanted[key] is not None:
                state[wanted[key]] = tensor
            if key == "model.embed_tokens.weight" and spec.tie_embeddings and head:
                state["lm_head.weight"] = tensor
        elif part_of(key, first, last, embed, head, spec.tie_embeddings):
            unused.append(key)

    for file in _weight_files(path):
        try:
            tensors = safe_open(str(file), framework="pt", device="cpu")
        except SafetensorError as exc:  # a file cut short (an interrupted copy), or not safetensors at all
            raise checkpoint_unreadable(file, exc, "read its tensors", "the file is damaged or incomplete: copy, "
                                        "download or convert it again", f"safetensors {safetensors.__version__}"
                                        ) from None
        with tensors as f:
            for stored in f.keys():
                key = checkpoint_key(spec, stored)
                if key is None:  # a buffer old checkpoints saved (a causal mask, RoPE's frequencies)
                    continue
                tensor = f.get_tensor(stored)
                whole, part = quantized_part(key, tensor, fused, fp8_block is not False)
                if whole is None:
                    place(key, tensor)
                    continue
                pending.setdefault(whole, {})[part] = tensor
                if len(pending[whole]) == 2:
                    parts = pending.pop(whole)
                    place(whole, dequantize_mxfp4(parts["blocks"], parts["scales"], dtype) if "blocks" in parts
                          else dequantize_fp8(parts["weight"], parts["weight_scale_inv"], fp8_block, dtype))
    if pending:
        raise ModelNotFound(f"checkpoint {path}: quantized tensors without their other part: {sorted(pending)[:5]}")
    if unused:  # silently dropped, they would change the model's output (an o_proj bias, say)
        raise UnsupportedArchitecture(
            f"checkpoint {path} holds tensors specctl's {spec.arch} decoder does not use: {sorted(unused)[:5]} — a "
            "variant of the architecture the engine does not run")
    missing = set(decoder.state_dict()) - set(state)
    if missing:
        raise ModelNotFound(f"checkpoint {path} lacks tensors: {sorted(missing)[:5]}")
    misfits = [f"{name} {tuple(tensor.shape)} (the config: {tuple(shapes[name])})" for name, tensor in state.items()
               if name in shapes and tensor.shape != shapes[name]]
    if misfits:
        raise CheckpointUnreadable(f"checkpoint {path}: its weights do not fit its config.json: "
                                   f"{', '.join(misfits[:3])} — a config.json of another model beside these weights?")
    decoder.load_state_dict(state, strict=True, assign=True)  # RoPE's buffers: computed on the CPU at build
    return decoder.to(device).eval()


def load_model(
    name: str,
    path: Path,
    dtype: str = "fp32",
    num_layers: int | None = None,
    device: str = "cpu",
    backend: str = "torch",
    stage: tuple[tuple[int, int], bool, bool] | None = None,
    latent_cache: bool = True,
    weights: bool = True,
) -> LoadedModel:
    """Full model (or its first ``num_layers`` layers + norm + head: an early-exit self-draft;
    or a pipeline stage: ``stage`` = (layer range, embedding?, norm + head?)). ``dtype``
    "stored": the checkpoint's own (``load_decoder``'s None). ``weights`` False: the model's
    shape on the meta device, its tokenizer and end tokens, and no weights read (what a draft
    server of a lookup drafter needs of a model: its vocabulary)."""
    from transformers import GenerationConfig

    config = read_text_config(path)
    layer_range, embed, head = stage or (None, True, True)
    if num_layers is not None:
        if not 0 < num_layers <= config.num_hidden_layers:
            raise ModelNotFound(f"{name}: cannot take the first {num_layers} of {config.num_hidden_layers} layers")
        layer_range = (0, num_layers)
    if weights:
        decoder = load_decoder(path, None if dtype == "stored" else DTYPES[dtype], layer_range, embed, head,
                               device=device, backend=backend, config=config, latent_cache=latent_cache)
    else:
        with torch.device("meta"):
            decoder = Decoder(ModelSpec.from_hf(config, latent_cache), layer_range, embed, head)
    tokenizer = load_tokenizer(path)  # shared with a model of the same tokenizer files
    eos: set[int] = set()
    try:
        gen_eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        gen_eos = None
    for source in (gen_eos, config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif source:
            eos.update(source)
    return LoadedModel(name, path, decoder.spec, decoder, tokenizer, tuple(sorted(eos)))
