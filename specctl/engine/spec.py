"""ModelSpec: the architecture facts the decoder needs, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specctl.engine.families import context_limit, family_facts, layer_windows, text_config
from specctl.errors import BadRequest, UnsupportedArchitecture

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3_text", "qwen2_moe", "qwen3_moe",
             "mixtral", "granite", "olmo2", "olmo3", "starcoder2", "smollm3", "glm4", "exaone4", "cohere",
             "cohere2", "seed_oss", "hunyuan_v1_dense", "arcee", "gpt_oss", "gpt_neox", "glm4_moe", "deepseek_v3",
             "deepseek_v2", "llama4_text", "phi")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: an RMSNorm over each head's queries and keys before RoPE
    hf_config: Any  # kept for RoPE parameters
    output_bias: bool = False  # o_proj's bias: where attention_bias gives it one (Llama's; never Qwen2's, Mistral's)
    # Gemma's departures from the Llama layer (defaults: Llama's)
    activation: str = "silu"  # the MLP's gate activation (transformers' ACT2FN name)
    unit_offset_norms: bool = False  # RMSNorm weights stored as offsets from 1, scaled in float32
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden); Granite: its multiplier)
    embed_scale_in_dtype: bool = False  # the scale rounded to the model's dtype first (Gemma's, as transformers does)
    sandwich_norms: bool = False  # Gemma 2: norms on the attention's and the MLP's outputs too
    attn_scale: float | None = None  # query scaling; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    logit_softcap: float | None = None  # Gemma 2: the same on the final logits
    # Granite's scalars: each sub-layer's output times this before the residual add; logits divided by that
    residual_scale: float | None = None
    logit_divisor: float | None = None
    # OLMo 2/3's: norms on the sub-layers' outputs only (none on their inputs), q/k normed across
    # heads, norms scaled in float32 before the cast, RoPE applied in float32
    post_norms: bool = False
    qk_norm_across_heads: bool = False
    qk_norm_weights_per_head: bool = False  # Command R+: q/k norms over each head, with each head's own weight
    qk_norm_after_rope: bool = False  # Hunyuan: the per-head q/k norms applied to the rotated queries and keys
    norm_scale_in_float32: bool = False
    rope_in_float32: bool = False
    # StarCoder2's: LayerNorm (with biases) in place of RMSNorm, and an MLP that is not gated
    # (c_fc -> activation -> c_proj)
    layer_norm: bool = False
    gated_mlp: bool = True
    # GLM-4's and Cohere's RoPE pairs neighbouring dims (0-1, 2-3, ...), not the halves of the rotated part
    rope_interleaved: bool = False
    # Cohere 2's: attention and MLP from one normed input, both added to the residual; LayerNorms
    # without bias (mean taken away, weight in float32); q/k rotated in float32 (cos/sin in the
    # model's dtype); logits times logit_scale
    parallel_residual: bool = False
    parallel_branches_first: bool = False  # Phi-1/1.5/2's parallel layer adds (attention + MLP) + x
    head_bias: bool = False  # Phi-1/1.5/2: the LM head has a bias
    # GPT-NeoX's (Pythia's) parallel layer: attention from one LayerNorm, the MLP from another,
    # added as (mlp + attention) + x, as transformers adds them
    parallel_two_norms: bool = False
    centered_norms: bool = False
    rotation_in_float32: bool = False
    logit_scale: float | None = None
    # per layer: whether it rotates its queries and keys (SmolLM3's NoPE layers do not); () = all do
    rope_layers: tuple[bool, ...] = ()
    # per layer: the sliding window it attends over (its last this-many positions), None = all
    layer_windows: tuple[int | None, ...] = ()
    # Llama 4's: layer_windows are chunks — a query sees the keys of its own chunk of that many
    # positions (p // C * C .. p), not its last C (engine.window)
    chunked_attention: bool = False
    # Llama 4's: queries and keys of the layers that rotate normed (RMS, no weight, in float32) after RoPE
    qk_l2_norm: bool = False
    # Llama 4's temperature tuning: a NoPE layer's queries times log1p(floor((p + 1) / floor_scale))
    # * scale + 1 at position p; (scale, floor_scale), None: off
    query_temperature: tuple[float, float] | None = None
    # mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral): per layer whether its MLP is sparse, and the experts
    sparse_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = False  # the top-k router weights rescaled to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a gated expert every token runs (0: none)
    gated_shared_expert: bool = True  # Qwen2-MoE's shared expert is gated; GLM-4.5's is not
    # how the router's scores choose and weigh experts (engine.moe.Routing: softmax, softmax_over_chosen
    # (gpt-oss), sigmoid_grouped (GLM-4.5, DeepSeek-V3), softmax_grouped (DeepSeek-V2)); its groups
    # (groups, top groups) and the weights' scale
    routing: str = "softmax"
    expert_groups: tuple[int, int] = (1, 1)
    routed_scale: float = 1.0
    # gpt-oss's experts: clamped SwiGLUs with biases, (alpha, limit); None: gated MLPs
    clamped_swiglu: tuple[float, float] | None = None
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each query's softmax
    # DeepSeek-V3's multi-head latent attention (engine.latent): (q_lora_rank or None, kv_lora_rank,
    # qk_nope_head_dim, qk_rope_head_dim, v_head_dim); head_dim is then nope + rope (the cache's width)
    latent_attention: tuple[int | None, int, int, int, int] | None = None
    # with latent_attention: the cache holds each token's compressed latent and rotated key part
    # (one "head" of kv_lora_rank + rope wide, keys and values one plane) and attention absorbs
    # kv_b_proj into queries and outputs, as vLLM's MLA does; False: keys and values expanded per head
    latent_cache: bool = False
    rope_dim: int | None = None  # the rotated width where it is not head_dim's (DeepSeek: qk_rope_head_dim)

    @property
    def window(self) -> int | None:
        """The sliding window of the layers that slide (one value: each is the config's sliding_window)."""
        return next((w for w in self.layer_windows if w is not None), None)

    @property
    def llama_layers(self) -> bool:
        """Layers as Llama's (the static step's fused pieces compute exactly these)."""
        return not (self.unit_offset_norms or self.sandwich_norms or self.activation != "silu"
                    or self.attn_scale is not None or self.attn_softcap is not None or any(self.sparse_layers)
                    or self.residual_scale is not None or self.output_bias or self.post_norms
                    or self.qk_norm_across_heads or self.norm_scale_in_float32 or self.rope_in_float32
                    or self.layer_norm or not self.gated_mlp or not all(self.rope_layers) or self.rope_interleaved
                    or self.parallel_residual or self.centered_norms or self.rotation_in_float32
                    or self.attention_sinks or self.parallel_two_norms or self.latent_attention is not None
                    or self.qk_l2_norm or self.query_temperature is not None)

    @property
    def norm_style(self) -> dict[str, bool]:
        """RMSNorm's keyword arguments for this model's norms (engine.layers.RMSNorm)."""
        return {"unit_offset": self.unit_offset_norms, "scale_in_float32": self.norm_scale_in_float32,
                "centered": self.centered_norms}

    @classmethod
    def from_hf(cls, config: Any, latent_cache: bool = True) -> "ModelSpec":
        """``latent_cache``: a latent-attention model (DeepSeek-V2/V3) caches its latents
        (``ModelSpec.latent_cache``); False: keys and values expanded, transformers' rounding."""
        config = text_config(config)  # a multimodal Gemma 3's language model
        arch = config.model_type
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedArchitecture(f"{arch} with use_bidirectional_attention (an embedding model) does not "
                                          "generate text")
        if arch not in SUPPORTED:
            raise UnsupportedArchitecture(
                f"architecture {arch!r} is not supported by specctl's engine (supported: {', '.join(SUPPORTED)})"
            )
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        common = dict(
            arch=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_eps=getattr(config, {"starcoder2": "norm_epsilon", "cohere": "layer_norm_eps", "cohere2": "layer_norm_eps",
                                     "gpt_neox": "layer_norm_eps", "phi": "layer_norm_eps"}.get(arch, "rms_norm_eps")),
            max_position=context_limit(config),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases, Qwen2-MoE when qkv_bias (its default); Llama and Qwen3 when
            # attention_bias is set.
            attention_bias=(arch == "qwen2" or bool(getattr(config, "attention_bias", False))
                            or (arch == "qwen2_moe" and bool(config.qkv_bias))),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            # transformers gives o_proj attention_bias's bias in Llama's layer and those built on it
            output_bias=(bool(getattr(config, "attention_bias", False))
                         and arch not in ("qwen2", "qwen2_moe", "mistral", "phi3", "mixtral", "glm4", "glm4_moe")),
            qk_norm=(arch in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2", "olmo3", "exaone4", "hunyuan_v1_dense")
                     or (arch == "glm4_moe" and bool(config.use_qk_norm))),
            hf_config=config,
            layer_windows=layer_windows(config),
        )
        facts = {**common, **family_facts(config)}  # a family's own facts over the common reading
        if facts.get("latent_attention") is not None and latent_cache:
            _, kv_rank, nope, rope, _ = facts["latent_attention"]
            # one cached "head": the latent then the rotated key; the scores' scale stays the heads' own
            facts.update(latent_cache=True, num_kv_heads=1, head_dim=kv_rank + rope,
                         attn_scale=facts["attn_scale"] or (nope + rope) ** -0.5)
        return cls(**facts)

    @property
    def kv_planes(self) -> int:
        """Planes a cache slot holds: a key and a value (2), or one both read (a latent cache)."""
        return 1 if self.latent_cache else 2

    def kv_bytes_per_token(self, dtype: torch.dtype, num_layers: int | None = None) -> int:
        layers = self.num_layers if num_layers is None else num_layers
        width = self.kv_planes * self.num_kv_heads * self.head_dim  # values a layer caches a token
        return layers * width * torch.tensor([], dtype=dtype).element_size()

    @property
    def local_rope(self) -> bool:
        """Sliding layers rotate with RoPE parameters of their own (Gemma 3: base 10k, full
        layers 1M and maybe scaled): ``inv_freq("sliding_attention")``."""
        params = getattr(self.hf_config, "rope_parameters", None) or {}
        return "sliding_attention" in params

    def inv_freq(self, layer_type: str = "full_attention") -> tuple[torch.Tensor, float]:
        """RoPE inverse frequencies and attention scaling, as transformers computes them (for
        ``layer_type``'s layers where the config has one RoPE per layer type), on the CPU whatever
        device is current: a decoder is built under torch.device("meta"), where they would have no
        data to read and where any op's first run imports torch._dynamo (a second of each load)."""
        with torch.device("cpu"):
            return self._inv_freq(layer_type)

    def _inv_freq(self, layer_type: str) -> tuple[torch.Tensor, float]:
        params = getattr(self.hf_config, "rope_parameters", None) or {}
        by_layer_type = {"layer_type": layer_type} if layer_type in params else {}
        if by_layer_type:
            params = params[layer_type]
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default" or (rope_type == "dynamic" and params.get("alpha")):
            base = params.get("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
            if rope_type == "dynamic":  # Hunyuan's NTK alpha: a fixed stretch of the base, whatever the length
                base = base * params["alpha"] ** (self.head_dim / (self.head_dim - 2))
            # Phi-4-mini rotates the first 3/4 of each head only (apply_rope passes the rest)
            dim = int((self.rope_dim or self.head_dim) * params.get("partial_rotary_factor", 1.0))
            return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[rope_type](self.hf_config, torch.device("cpu"), **by_layer_type)


def check_token_ids(ids: list[int], vocab_size: int, what: str = "token ids") -> None:
    """Refuse token ids outside the model's vocabulary (BadRequest), before any model sees them;
    ``what`` names them in the message."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise BadRequest(f"{what} must be in [0, {vocab_size}), got {min(ids)}..{max(ids)}")
