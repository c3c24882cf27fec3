"""How a family's checkpoint lays its tensors out, read into the decoder's names: multimodal
wrappers' language models, GPT-NeoX's and others' own names, tensors that hold several of the
decoder's (fused projections, expert stacks, MXFP4 stacks), and which stored tensors belong to
the part being loaded (engine.loader reads them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specctl.engine.spec import ModelSpec


# a multimodal checkpoint's language model, as the Hub stores it and as transformers 5 holds it in memory
LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                           "model.language_model.": "model."}


def language_model_key(key: str) -> str:
    """A checkpoint tensor's name as a text-only model names it: a multimodal Gemma 3's language
    model is under ``language_model.model.`` (or ``model.language_model.``); its vision tower and
    projector keep their names, which no text decoder wants."""
    for prefix, text_prefix in LANGUAGE_MODEL_PREFIXES.items():
        if key.startswith(prefix):
            return text_prefix + key[len(prefix):]
    return key


# GPT-NeoX's names as the Llama-shaped decoder's (its q/k/v: one fused tensor, split as Phi-3's)
NEOX_NAMES = {"attention.query_key_value.": "self_attn.qkv_proj.", "attention.dense.": "self_attn.o_proj.",
              "mlp.dense_h_to_4h.": "mlp.c_fc.", "mlp.dense_4h_to_h.": "mlp.c_proj."}
NEOX_BUFFERS = ("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq")


def checkpoint_key(spec: ModelSpec, stored: str) -> str | None:
    """A stored tensor's name as the decoder's checkpoint names go (None: a buffer to skip)."""
    if spec.arch == "phi":  # Phi-1/1.5/2's final norm
        return stored.replace("model.final_layernorm.", "model.norm.")
    return neox_key(stored) if spec.arch == "gpt_neox" else language_model_key(stored)


def fused_rows(spec: ModelSpec, tensor: torch.Tensor) -> torch.Tensor:
    """A fused tensor's rows in the order Split reads them: GPT-NeoX's q/k/v come head by head
    ([q; k; v] of each head in turn), the decoder's as [q; k; v] of all heads."""
    if spec.arch == "gpt_neox":
        return tensor.unflatten(0, (spec.num_heads, 3, -1)).transpose(0, 1).flatten(0, 2)
    return tensor


def neox_key(key: str) -> str | None:
    """A GPT-NeoX (Pythia) checkpoint tensor's name as the decoder's checkpoint names go
    (``gpt_neox.embed_in`` the embedding, ``final_layer_norm`` the norm, ``embed_out`` the
    head); None for the buffers old checkpoints saved with the weights."""
    if key.endswith(NEOX_BUFFERS):
        return None
    if key.startswith("embed_out."):
        return "lm_head." + key.removeprefix("embed_out.")
    key = key.replace("gpt_neox.embed_in.", "model.embed_tokens.").replace("gpt_neox.final_layer_norm.", "model.norm.")
    key = key.replace("gpt_neox.layers.", "model.layers.")
    for name, ours in NEOX_NAMES.items():
        key = key.replace(name, ours)
    return key


def part_of(key: str, first: int, last: int, embed: bool, head: bool, tied: bool) -> bool:
    """Whether a checkpoint tensor belongs to the part of the model being loaded (its layers,
    embeddings, final norm and head) — one the decoder must use. RoPE's inv_freq buffers, which
    old checkpoints saved, are recomputed; a tied head saved anyway is the embedding table."""
    if key.startswith("model.layers."):
        index = key.split(".", 3)[2]
        return index.isdigit() and first <= int(index) < last and not key.endswith("rotary_emb.inv_freq")
    return ((embed and key.startswith("model.embed_tokens.")) or (head and key.startswith("model.norm."))
            or (head and not tied and key.startswith("lm_head.")))


MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
FLOAT32_ROUTER = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")  # GLM-4.5's (engine.moe.CorrectedRouter)


# GLM-4's names of Gemma 2's four norms: after attention, before and after the MLP
GLM4_NORMS = {"post_attention_layernorm": "post_self_attn_layernorm",
              "pre_feedforward_layernorm": "post_attention_layernorm",
              "post_feedforward_layernorm": "post_mlp_layernorm"}


def checkpoint_name(spec: ModelSpec, name: str) -> str:
    """A layer's tensor name as the checkpoint spells it: Mixtral's sparse MLP is
    ``block_sparse_moe`` with experts' ``w1`` (gate), ``w3`` (up), ``w2`` (down); GLM-4's norms
    are named for where they sit (GLM4_NORMS); Hunyuan's q/k norms are query/key_layernorm;
    Arcee's plain MLP is up_proj, down_proj; gpt-oss's router is router; GLM-4.5's shared expert
    shared_experts."""
    if spec.arch == "glm4":
        module, _, rest = name.partition(".")
        return f"{GLM4_NORMS.get(module, module)}.{rest}"
    if spec.arch == "arcee":  # its plain MLP's projections
        return name.replace("mlp.c_fc.", "mlp.up_proj.").replace("mlp.c_proj.", "mlp.down_proj.")
    if spec.arch == "gpt_oss":  # its router (its experts: gpt_oss_stacks)
        return name.replace("mlp.gate.", "mlp.router.")
    if spec.arch in ("glm4_moe", "deepseek_v3", "deepseek_v2"):  # its shared expert (ungated)
        return name.replace("mlp.shared_expert.", "mlp.shared_experts.")
    if spec.arch == "phi":  # its output projection and plain MLP's names
        return (name.replace("self_attn.o_proj.", "self_attn.dense.").replace("mlp.c_fc.", "mlp.fc1.")
                .replace("mlp.c_proj.", "mlp.fc2."))
    if spec.arch == "llama4_text":  # its MLP is feed_forward, its router router (its experts: expert_stacks)
        return name.replace("mlp.gate.", "mlp.router.").replace("mlp.", "feed_forward.", 1)
    if spec.arch == "hunyuan_v1_dense":  # its q/k norms
        return name.replace("self_attn.q_norm.", "self_attn.query_layernorm.").replace(
            "self_attn.k_norm.", "self_attn.key_layernorm.")
    if spec.arch != "mixtral" or not name.startswith("mlp."):
        return name
    parts = name.split(".")
    if parts[1] == "experts":
        parts[3] = MIXTRAL_EXPERT[parts[3]]
    return ".".join(["block_sparse_moe", *parts[1:]])


@dataclass(frozen=True, slots=True)
class Split:
    """A checkpoint tensor holding several of the decoder's tensors: their names, and how many
    rows of it each takes (a 3-D stack: its experts' rows, in order; ``transposed``: stored as
    x @ W multiplies, [E, in, out], so each expert's rows are its columns)."""

    names: list[str]
    sizes: list[int]
    transposed: bool = False

    def parts(self, tensor: torch.Tensor, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
        if self.transposed:
            tensor = tensor.transpose(1, 2)
        rows = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 1 else tensor.unsqueeze(-1)  # a bias: its entries
        return {name: part.reshape(shapes[name]).clone() for name, part in zip(self.names, rows.split(self.sizes))}


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block_size(config) -> list[int] | None | bool:
    """A fine-grained FP8 checkpoint's (DeepSeek-V3/R1's, Qwen3's -FP8, ...) block of weights per
    scale ([128, 128]; None: one scale a tensor); False where the checkpoint is not FP8."""
    quantization = getattr(config, "quantization_config", None) or {}
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    if quantization.get("quant_method") != "fp8":
        return False
    return quantization.get("weight_block_size")


def quantized_part(key: str, tensor: torch.Tensor, fused: dict, fp8: bool) -> tuple[str | None, str]:
    """(the tensor it is a part of, which part) for a part of a quantized tensor — an MXFP4 stack's
    ``_blocks`` / ``_scales``, an FP8 weight or its ``weight_scale_inv`` — else (None, "")."""
    stack, _, part = key.rpartition("_")
    if part in ("blocks", "scales") and stack in fused and fused[stack].transposed:
        return stack, part
    if fp8 and key.endswith(".weight_scale_inv"):
        return key.removesuffix("_scale_inv"), "weight_scale_inv"
    if fp8 and key.endswith(".weight") and tensor.dtype in FP8:
        return key, "weight"
    return None, ""


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int] | None,
                   dtype: torch.dtype | None) -> torch.Tensor:
    """An FP8 weight [out, in] times its scale per block (``block`` rows x columns, the last
    blocks maybe partial; None: one scale), in ``dtype`` (None: bf16), as transformers
    dequantizes one at load: the product in float32, then cast."""
    scale = scale_inv.float()
    if block is not None:
        rows, cols = weight.shape[-2:]
        scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype or torch.bfloat16)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """An MXFP4 expert stack (gpt-oss's Hub checkpoints: two 4-bit values a byte, a power-of-two
    scale per 32) in ``dtype`` (None: bf16), as transformers dequantizes it: [E, in, out]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype or torch.bfloat16)


def fused_checkpoint_keys(wanted: dict[str, str | None], spec: ModelSpec) -> dict[str, Split]:
    """Checkpoint tensors that hold several of the decoder's projections (Phi-3 stores
    ``qkv_proj`` and ``gate_up_proj``, gate first): key -> (decoder names, row counts), for
    the layers the decoder wants. Split at load, so every family runs one layer code
    (fuse_projections joins them again where a path wants them fused)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    splits = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
              "gate_up_proj": (("gate_proj", "up_proj"), [spec.intermediate_size] * 2)}
    fused = {}
    for key, name in wanted.items():
        for whole, (projections, sizes) in splits.items():
            for part in ("weight", "bias"):  # GPT-NeoX's fused q/k/v has its biases fused too
                first = f".{projections[0]}.{part}"
                if name is not None and key.endswith(first):
                    key_base, name_base = key.removesuffix(first), name.removesuffix(first)
                    fused[f"{key_base}.{whole}.{part}"] = Split([f"{name_base}.{p}.{part}" for p in projections], sizes)
    return fused


def expert_stacks(spec: ModelSpec, first: int, last: int) -> dict[str, Split]:
    """A mixture of experts saved as transformers 5 holds it in memory (what `models` writes
    when it converts a GGUF: the model's state dict): each sparse layer's experts as 3-D stacks
    ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate, then up) and ``mlp.experts.down_proj``
    [E, H, I], and Mixtral's router as ``mlp.gate`` — split into the per-expert modules, as
    the Hub's per-expert checkpoints load directly."""
    stacks = {}
    inner, experts = spec.expert_intermediate_size, spec.num_experts
    for index in range(first, last):
        if not (spec.sparse_layers and spec.sparse_layers[index]):
            continue
        key, name = f"model.layers.{index}.mlp", f"layers.{index - first}.mlp"
        if spec.arch == "gpt_oss":
            stacks.update(gpt_oss_stacks(spec, key, name))
            continue
        if spec.arch == "llama4_text":  # stored as x @ W multiplies: gate_up [E, H, 2I] (gate, then up), down [E, I, H]
            key = f"model.layers.{index}.feed_forward"
            stacks[f"{key}.experts.gate_up_proj"] = Split(
                [f"{name}.experts.{e}.{p}.weight" for e in range(experts) for p in ("gate_proj", "up_proj")],
                [inner] * 2 * experts, transposed=True)
            stacks[f"{key}.experts.down_proj"] = Split([f"{name}.experts.{e}.down_proj.weight" for e in range(experts)],
                                                       [spec.hidden_size] * experts, transposed=True)
            continue
        stacks[f"{key}.experts.gate_up_proj"] = Split(
            [f"{name}.experts.{e}.{p}.weight" for e in range(experts) for p in ("gate_proj", "up_proj")],
            [inner] * 2 * experts)
        stacks[f"{key}.experts.down_proj"] = Split([f"{name}.experts.{e}.down_proj.weight" for e in range(experts)],
                                                   [spec.hidden_size] * experts)
        if spec.arch == "mixtral":
            stacks[f"{key}.gate.weight"] = Split([f"{name}.gate.weight"], [experts])
    return stacks


def gpt_oss_stacks(spec: ModelSpec, key: str, name: str) -> dict[str, Split]:
    """gpt-oss's experts as its checkpoints hold them: gate_up_proj [E, H, 2I] (gate and up
    interleaved) and down_proj [E, I, H], transposed from nn.Linear's, as bf16 or as MXFP4
    ``_blocks`` and ``_scales`` (the Hub's); their biases [E, 2I] and [E, H]."""
    count = spec.num_experts
    stacks = {}
    for stack, rows in (("gate_up_proj", 2 * spec.expert_intermediate_size), ("down_proj", spec.hidden_size)):
        stacks[f"{key}.experts.{stack}"] = Split([f"{name}.experts.{e}.{stack}.weight" for e in range(count)],
                                                 [rows] * count, transposed=True)
        stacks[f"{key}.experts.{stack}_bias"] = Split([f"{name}.experts.{e}.{stack}_bias" for e in range(count)],
                                                      [1] * count)
    return stacks
