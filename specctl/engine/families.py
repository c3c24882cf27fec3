"""How each family's config maps onto ModelSpec's fields beyond the common reading
(ModelSpec.from_hf): its layer's departures from Llama's, its windows, its context limit."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

from specctl.errors import CheckpointUnreadable, UnsupportedArchitecture


def read_text_config(path: Any) -> Any:
    """The text config of the checkpoint at ``path`` (text_config), with what transformers could
    not read said in one line: a model type this transformers does not know, a config.json that
    is not JSON, or one another transformers release wrote in a shape this one rejects."""
    import transformers
    from transformers import AutoConfig

    try:
        return text_config(AutoConfig.from_pretrained(path))
    except Exception as exc:  # anything transformers (or huggingface_hub's validation) raises on a config
        unknown = re.search(r"model type `([^`]*)` but Transformers does not recognize", str(exc))
        if not isinstance(exc, ValueError) or unknown is None:
            raise checkpoint_unreadable(path, exc) from None
        raise UnsupportedArchitecture(
            f"{path}: transformers {transformers.__version__} does not know model type {unknown[1]!r}; a newer "
            "transformers may (pip install -U transformers), or pick a checkpoint of a supported family") from None


def checkpoint_unreadable(path: Any, exc: Exception, what: str = "read its config.json",
                          advice: str = "fix the file, or use the transformers release that wrote it",
                          reader: str | None = None) -> CheckpointUnreadable:
    """What ``reader`` (transformers) raised on a checkpoint, as one line (at most ~300 characters of its own)."""
    import transformers

    reader = reader or f"transformers {transformers.__version__}"
    said = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    said = said if len(said) <= 300 else said[:297] + "..."
    return CheckpointUnreadable(
        f"{path}: {reader} cannot {what} ({type(exc).__name__}: "
        f"{said}); {advice}")


def text_config(config: Any) -> Any:
    """The config of the decoder specctl runs: a multimodal Gemma 3 checkpoint's (4B, 12B, 27B:
    Gemma3ForConditionalGeneration) or Llama 4's (Llama4ForConditionalGeneration)
    ``text_config`` — its language model is the family's ForCausalLM (Gemma3ForCausalLM,
    Llama4ForCausalLM), and text-only requests never reach its vision tower — else the config itself. The wrapper's
    own tie_word_embeddings decides whether its head is the embedding table (transformers ties by
    the outer config), so the copy returned carries it."""
    if config.model_type not in ("gemma3", "llama4"):
        return config
    text = copy.copy(config.text_config)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
    return text


def family_facts(config: Any) -> dict[str, Any]:
    """ModelSpec fields the family of ``config`` sets (they override the common reading)."""
    arch = config.model_type
    return {**(_gemma(config) if arch.startswith("gemma") else {}),
            **(_experts(config) if arch in ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v3",
                                            "deepseek_v2") else {}),
            **(_deepseek_v3(config) if arch in ("deepseek_v3", "deepseek_v2") else {}),
            **(_llama4(config) if arch == "llama4_text" else {}),
            **(_phi(config) if arch == "phi" else {}),
            **(_gpt_oss(config) if arch == "gpt_oss" else {}),
            **(_gpt_neox(config) if arch == "gpt_neox" else {}),
            **(_granite(config) if arch == "granite" else {}),
            **(dict(post_norms=True, qk_norm_across_heads=True, norm_scale_in_float32=True, rope_in_float32=True)
               if arch in ("olmo2", "olmo3") else {}),
            **(_starcoder2(config) if arch == "starcoder2" else {}),
            # GLM-4: Gemma 2's four norms a layer (its own names: checkpoint.checkpoint_name), plain
            # RMSNorms, RoPE on half of each head with neighbouring dims paired
            **(dict(sandwich_norms=True, rope_interleaved=True) if arch == "glm4" else {}),
            **(_exaone4(config) if arch == "exaone4" else {}),
            **(_cohere(config) if arch in ("cohere", "cohere2") else {}),
            # Seed-OSS: o_proj's bias by a flag of its own; Hunyuan: q/k normed after RoPE
            **(dict(output_bias=bool(config.attention_out_bias)) if arch == "seed_oss" else {}),
            **(dict(qk_norm_after_rope=True) if arch == "hunyuan_v1_dense" else {}),
            # Arcee (AFM): an MLP without gate, up -> ReLU^2 -> down (checkpoint.checkpoint_name: up_proj, down_proj)
            **(dict(gated_mlp=False, activation=config.hidden_act) if arch == "arcee" else {}),
            # SmolLM3: no_rope_layers[i] is 1 where layer i rotates (every 4th does not)
            **(dict(rope_layers=tuple(map(bool, config.no_rope_layers))) if arch == "smollm3" else {})}


def _gemma(config: Any) -> dict[str, Any]:
    """Gemma's (1, 2, 3) layer facts, as transformers' modeling_gemma/gemma2/gemma3 apply them."""
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return dict(
        # transformers reads Gemma 1's hidden_act, Gemma 2/3's hidden_activation (old Gemma 1 configs hold both)
        activation=config.hidden_act if config.model_type == "gemma" else config.hidden_activation,
        unit_offset_norms=True,
        embed_scale=config.hidden_size**0.5,
        embed_scale_in_dtype=True,
        sandwich_norms=config.model_type != "gemma",
        attn_scale=None if scalar is None else scalar**-0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        logit_softcap=getattr(config, "final_logit_softcapping", None),
    )


def _cohere(config: Any) -> dict[str, Any]:
    """Cohere (Command R, R+, Aya; transformers' modeling_cohere) and Cohere 2 (Command R7B):
    one LayerNorm a layer (no bias) feeding attention and MLP in parallel, RoPE with neighbouring
    dims paired, q/k rotated in float32, logits scaled. Command R+'s q/k LayerNorms carry a
    weight per head; Cohere 2 rotates on its sliding layers only (the full ones, every 4th,
    attend without RoPE)."""
    facts = dict(parallel_residual=True, centered_norms=True, rope_interleaved=True, rotation_in_float32=True,
                 logit_scale=config.logit_scale)
    if config.model_type == "cohere":
        return {**facts, "qk_norm": bool(config.use_qk_norm), "qk_norm_weights_per_head": True}
    windowed = bool(getattr(config, "sliding_window", None))
    return {**facts, "rope_layers": tuple(windowed and kind == "sliding_attention" for kind in config.layer_types)}


def _exaone4(config: Any) -> dict[str, Any]:
    """EXAONE 4.0 (transformers' modeling_exaone4): OLMo's norms after the sub-layers (Llama's
    RMSNorm, not OLMo's float32 scaling), Qwen3's per-head q/k norms; with a sliding window its
    full-attention layers (every 4th) attend without RoPE."""
    windowed = bool(getattr(config, "sliding_window", None))
    return dict(post_norms=True,
                rope_layers=tuple(not windowed or kind == "sliding_attention" for kind in config.layer_types))


def _gpt_oss(config: Any) -> dict[str, Any]:
    """gpt-oss (transformers' modeling_gpt_oss): Llama's layer with biases on every attention
    projection, a sink logit per head, RMSNorms scaled in float32 before the cast, every layer a
    mixture of clamped-SwiGLU experts whose router softmaxes its top-k logits (sliding and full
    layers alternate: layer_windows; YaRN RoPE: ModelSpec.inv_freq)."""
    return dict(attention_sinks=True, norm_scale_in_float32=True, routing="softmax_over_chosen",
                # older transformers' configs lack them: its GptOssExperts hard-coded these values
                clamped_swiglu=(getattr(config, "swiglu_alpha", 1.702), getattr(config, "swiglu_limit", 7.0)))


def _deepseek_v3(config: Any) -> dict[str, Any]:
    """DeepSeek-V3's (and V2's) multi-head latent attention (engine.latent): each head's query and key a part
    without RoPE (qk_nope_head_dim) and a rotated one (qk_rope_head_dim), its values v_head_dim
    wide; YaRN's mscale_all_dim scales the scores (mscale squared), as transformers does."""
    scale = None
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim") and rope["factor"] > 1:
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
        scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5 * mscale * mscale
    # DeepSeek-V2 rotates neighbouring pairs as complex numbers in float32 (cos/sin in float32,
    # the pairs left interleaved); V3 de-interleaves them into halves (engine.latent)
    v2 = config.model_type == "deepseek_v2"
    return dict(latent_attention=(config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim,
                                  config.qk_rope_head_dim, config.v_head_dim),
                head_dim=config.qk_nope_head_dim + config.qk_rope_head_dim, rope_dim=config.qk_rope_head_dim,
                num_kv_heads=config.num_attention_heads, attn_scale=scale, rope_interleaved=v2, rope_in_float32=v2)


def _llama4(config: Any) -> dict[str, Any]:
    """Llama 4 (Scout, Maverick; transformers' modeling_llama4): RoPE on neighbouring pairs as
    complex numbers in float32, then (use_qk_norm) queries and keys RMS-normed without weight;
    every 4th layer (no_rope_layers 0) attends without RoPE over the whole context, its queries
    temperature-tuned by position; the others within chunks of attention_chunk_size positions.
    Its mixtures (moe_layers) route each token to its top expert, whose input — not output — is
    weighed by the sigmoid of its logit, beside an ungated shared expert; dense layers are
    intermediate_size_mlp wide."""
    rotates = tuple(map(bool, config.no_rope_layers))
    chunk = getattr(config, "attention_chunk_size", None)
    chunked = tuple(chunk if kind == "chunked_attention" and chunk else None for kind in config.layer_types)
    moe = set(config.moe_layers)
    return dict(rope_layers=rotates, rope_interleaved=True, rope_in_float32=True, rotation_in_float32=True,
                qk_l2_norm=bool(config.use_qk_norm), layer_windows=chunked, chunked_attention=any(chunked),
                query_temperature=((config.attn_scale, config.floor_scale) if config.attn_temperature_tuning
                                   else None),
                intermediate_size=config.intermediate_size_mlp,
                sparse_layers=tuple(i in moe for i in range(config.num_hidden_layers)),
                num_experts=config.num_local_experts, experts_per_token=config.num_experts_per_tok,
                expert_intermediate_size=config.intermediate_size, routing="sigmoid_on_input",
                shared_expert_intermediate_size=config.intermediate_size, gated_shared_expert=False)


def _phi(config: Any) -> dict[str, Any]:
    """Phi-1, Phi-1.5, Phi-2 (transformers' modeling_phi): one LayerNorm (with bias) feeding
    attention and a plain MLP (fc1 -> gelu_new -> fc2, biases) side by side, added as
    (attention + MLP) + x; biases on q/k/v and on the output projection (dense); RoPE on the first
    partial_rotary_factor of each head; the LM head has a bias. Its q/k LayerNorms (qk_layernorm,
    no released checkpoint's) are refused."""
    if getattr(config, "qk_layernorm", False):
        raise UnsupportedArchitecture("phi with qk_layernorm (per-head q/k LayerNorms) is not run by specctl's engine")
    return dict(layer_norm=True, gated_mlp=False, activation=config.hidden_act, mlp_bias=True, attention_bias=True,
                output_bias=True, parallel_residual=True, parallel_branches_first=True, head_bias=True)


def _gpt_neox(config: Any) -> dict[str, Any]:
    """GPT-NeoX (Pythia, GPT-NeoX-20B; transformers' modeling_gpt_neox): LayerNorms with biases, a
    plain GELU MLP with biases, biases on q/k/v (one fused tensor, per head) and the output
    projection by attention_bias, RoPE over the first rotary_pct of each head (partial rotary),
    and with use_parallel_residual attention and MLP side by side from two norms."""
    return dict(layer_norm=True, gated_mlp=False, activation=config.hidden_act, mlp_bias=True,
                attention_bias=config.attention_bias, output_bias=config.attention_bias,
                parallel_two_norms=config.use_parallel_residual)


def _starcoder2(config: Any) -> dict[str, Any]:
    """StarCoder2's layer (transformers' modeling_starcoder2): LayerNorm with biases, a plain
    MLP (c_fc, GELU-tanh, c_proj), biases on every projection when ``use_bias``."""
    return dict(layer_norm=True, gated_mlp=False, activation=config.hidden_act, attention_bias=config.use_bias,
                mlp_bias=config.use_bias, output_bias=config.use_bias)


def _granite(config: Any) -> dict[str, Any]:
    """Granite's four scalars (transformers' modeling_granite): the embeddings' multiplier, the
    attention's query scale, the residual branches' multiplier, the logits' divisor."""
    return dict(embed_scale=config.embedding_multiplier, attn_scale=config.attention_multiplier,
                residual_scale=config.residual_multiplier, logit_divisor=config.logits_scaling)


def _experts(config: Any) -> dict[str, Any]:
    """A mixture of experts' facts, as transformers' qwen2_moe / qwen3_moe / mixtral read them:
    Qwen2/3-MoE's sparse layers are those not in ``mlp_only_layers`` every
    ``decoder_sparse_step``-th, each expert ``moe_intermediate_size`` wide, Qwen2-MoE's shared
    expert ``shared_expert_intermediate_size``; Mixtral's and gpt-oss's every layer, their experts
    ``intermediate_size`` wide, Mixtral's weights always renormalised (gpt-oss's softmax is over
    the chosen logits already); GLM-4.5's after ``first_k_dense_replace`` dense layers, with an
    ungated shared expert and DeepSeek-V3's routing (engine.moe.Routing "sigmoid_grouped")."""
    layers = config.num_hidden_layers
    if config.model_type in ("mixtral", "gpt_oss"):
        return dict(sparse_layers=(True,) * layers, num_experts=config.num_local_experts,
                    experts_per_token=config.num_experts_per_tok, expert_intermediate_size=config.intermediate_size,
                    normalize_expert_weights=config.model_type == "mixtral")
    if config.model_type == "deepseek_v2":  # softmax scores, top k (within the best groups: group_limited_greedy)
        grouped = config.topk_method == "group_limited_greedy"
        return dict(sparse_layers=tuple(i >= config.first_k_dense_replace for i in range(layers)),
                    num_experts=config.n_routed_experts, experts_per_token=config.num_experts_per_tok,
                    expert_intermediate_size=config.moe_intermediate_size,
                    shared_expert_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                    gated_shared_expert=False, routing="softmax_grouped",
                    expert_groups=(config.n_group, config.topk_group) if grouped else (1, 1),
                    routed_scale=config.routed_scaling_factor)
    if config.model_type in ("glm4_moe", "deepseek_v3"):  # first layers dense; sigmoid routing within groups
        return dict(sparse_layers=tuple(i >= config.first_k_dense_replace for i in range(layers)),
                    num_experts=config.num_local_experts, experts_per_token=config.num_experts_per_tok,
                    expert_intermediate_size=config.moe_intermediate_size,
                    normalize_expert_weights=bool(config.norm_topk_prob),
                    shared_expert_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                    gated_shared_expert=False, routing="sigmoid_grouped",
                    expert_groups=(config.n_group, config.topk_group), routed_scale=config.routed_scaling_factor)
    step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
    sparse = tuple(config.num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))
    return dict(sparse_layers=sparse, num_experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                expert_intermediate_size=config.moe_intermediate_size,
                normalize_expert_weights=bool(config.norm_topk_prob),
                shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0)


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's attention window (None: full), as transformers slides them: Mistral's,
    Phi-3's and StarCoder2's ``sliding_window`` every layer (they have no ``layer_types``; Phi-3-mini-4k: 2047),
    Qwen2/Qwen3's and Gemma 2's the layers ``layer_types`` names sliding (Qwen: past
    ``max_window_layers`` when ``use_sliding_window``; Gemma 2: every other one)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:  # SmolLM3 keeps a window it does not use
        window = None
    layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if not window:
        return (None,) * layers
    if layer_types is not None:
        if len(set(layer_types) - {"full_attention", "sliding_attention"}):
            raise UnsupportedArchitecture(f"layer types {sorted(set(layer_types))}: specctl's engine runs "
                                          "full_attention and sliding_attention layers")
        if len(layer_types) != layers:
            raise UnsupportedArchitecture(f"layer_types names {len(layer_types)} layers, the model has {layers}")
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return ((window,) if config.model_type in ("mistral", "phi3", "starcoder2") else (None,)) * layers


def context_limit(config: Any) -> int:
    """The longest context the engine decodes as the checkpoint does. Its RoPE frequencies are
    fixed: longrope switches to its long factors past the original context (transformers, for
    the whole sequence), so its context stops there. (Sliding windows are the attention's:
    engine.layers applies them, they cap nothing.)"""
    positions = getattr(config, "max_position_embeddings", 32768)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                            None)
        positions = min(positions, original or positions)
    return positions
