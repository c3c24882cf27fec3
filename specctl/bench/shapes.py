"""Real models' shapes for random-weight runs (``specctl bench kernels --random-weights``, the
GPU examples): the architecture facts of their config.json, and a decoder of such a shape
built with random weights (timing does not depend on the values)."""

from __future__ import annotations

from pathlib import Path

import torch

from specctl.engine.model import Decoder
from specctl.engine.spec import ModelSpec

# Architecture facts of real checkpoints (their config.json), for random-weight runs.
LLAMA4_SCOUT = dict(model_type="llama4_text", hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                    num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                    vocab_size=202048, tie_word_embeddings=False, num_local_experts=16, num_experts_per_tok=1,
                    interleave_moe_layer_step=1, attention_chunk_size=8192, use_qk_norm=True, rms_norm_eps=1e-5,
                    max_position_embeddings=10485760)
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    # Qwen3: head_dim 128 whatever the width, per-head q/k norms, no q/k/v biases
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    # Phi-3-mini: full attention heads (no GQA), head dim 96; Phi-4-mini: GQA, a 200k vocabulary,
    # RoPE on 3/4 of each head (their sliding window and longrope change no step's cost)
    "phi3-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, tie_word_embeddings=False,
                      pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "phi4-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=24, num_key_value_heads=8, vocab_size=200064, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
                      pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # Gemma 2: head dim 256, a 256k vocabulary (tied), sandwich norms, soft-capped scores (torch attention)
    "gemma2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                      tie_word_embeddings=True, query_pre_attn_scalar=256),
    "gemma2-9b": dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                      tie_word_embeddings=True, query_pre_attn_scalar=256),
    # Gemma 3 (text): one KV head of 256, a 262k vocabulary; 5 of 6 layers slide over 512 tokens
    "gemma3-270m": dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                        tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=512),
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                      tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=512),
    # Qwen3-MoE: 128 experts of 768, 8 a token (3.3B of its 30.5B read a token)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True),
    # StarCoder2: LayerNorms, a plain GELU MLP, biases everywhere, a 4k window over every layer
    "starcoder2-3b": dict(model_type="starcoder2", hidden_size=3072, intermediate_size=12288, num_hidden_layers=30,
                          num_attention_heads=24, num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True,
                          sliding_window=4096, norm_epsilon=1e-5),
    "starcoder2-7b": dict(model_type="starcoder2", hidden_size=4608, intermediate_size=18432, num_hidden_layers=32,
                          num_attention_heads=36, num_key_value_heads=4, vocab_size=49152, tie_word_embeddings=True,
                          sliding_window=4096, norm_epsilon=1e-5),
    # Qwen1.5-MoE: 60 experts of 1408, 4 a token, and a shared expert of 5632 every token reads (2.7B of 14.3B)
    "qwen1.5-moe-a2.7b": dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                              num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
                              tie_word_embeddings=False, num_experts=60, num_experts_per_tok=4,
                              moe_intermediate_size=1408, shared_expert_intermediate_size=5632, norm_topk_prob=False),
    # Pythia (GPT-NeoX): LayerNorms, biases everywhere, every head its own KV, attention and MLP in parallel
    "pythia-160m": dict(model_type="gpt_neox", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=12, vocab_size=50304, tie_word_embeddings=False,
                        max_position_embeddings=2048, layer_norm_eps=1e-5),
    "pythia-1.4b": dict(model_type="gpt_neox", hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                        num_attention_heads=16, vocab_size=50304, tie_word_embeddings=False,
                        max_position_embeddings=2048, layer_norm_eps=1e-5),
    "pythia-6.9b": dict(model_type="gpt_neox", hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
                        num_attention_heads=32, vocab_size=50432, tie_word_embeddings=False,
                        max_position_embeddings=2048, layer_norm_eps=1e-5),
    # GLM-4.5-Air: a dense first layer, then 128 experts of 1408, 8 a token, and a shared one; RoPE on half of each head
    "glm-4.5-air": dict(model_type="glm4_moe", hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                        num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552,
                        tie_word_embeddings=False, num_local_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=1408, first_k_dense_replace=1, n_shared_experts=1, n_group=1,
                        topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, attention_bias=True,
                        max_position_embeddings=131072, rms_norm_eps=1e-5),
    # DeepSeek-V3 / R1: latent attention (rank-1536 queries, a rank-512 latent for keys and values, 128 + 64
    # dims a head), 3 dense layers, then 256 experts of 2048 in 8 groups (4 open), 8 a token, and a shared one
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
                        tie_word_embeddings=False, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                        moe_intermediate_size=2048, first_k_dense_replace=3, n_shared_experts=1, n_group=8,
                        topk_group=4, routed_scaling_factor=2.5, max_position_embeddings=163840),
    # DeepSeek-V2-Lite (and Coder-V2-Lite): latent attention with one q_proj, 64 experts of 1408, 6 a token, 2 shared
    "deepseek-v2-lite": dict(model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16, vocab_size=102400,
                             tie_word_embeddings=False, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
                             moe_intermediate_size=1408, first_k_dense_replace=1, n_shared_experts=2,
                             topk_method="greedy", routed_scaling_factor=1.0, max_position_embeddings=163840),
    # gpt-oss: 32 experts of 2880, 4 a token, every layer; a sink per head; 128-token windows on every other layer
    # (the Hub's experts are MXFP4, dequantized at load: the step reads them in the model's dtype)
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        tie_word_embeddings=False, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                        max_position_embeddings=131072, rms_norm_eps=1e-5),
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                         tie_word_embeddings=False, num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
                         max_position_embeddings=131072, rms_norm_eps=1e-5),
    # Phi-2 and Phi-1.5 (one tokenizer: a target and its draft): parallel attention and MLP, partial RoPE
    "phi-2": dict(model_type="phi", hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, vocab_size=51200, tie_word_embeddings=False,
                  partial_rotary_factor=0.4, hidden_act="gelu_new", max_position_embeddings=2048),
    "phi-1.5": dict(model_type="phi", hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                    num_attention_heads=32, num_key_value_heads=32, vocab_size=51200, tie_word_embeddings=False,
                    partial_rotary_factor=0.5, hidden_act="gelu_new", max_position_embeddings=2048),
    # Llama 4 Scout (17B active, 16 experts): every layer a mixture (the top expert + a shared one); 3 of 4
    # layers in chunks of 8192 positions with q/k L2 norms, every 4th NoPE
    "llama-4-scout": LLAMA4_SCOUT,
    # Llama 4 Maverick (17B active, 128 experts): mixtures on every other layer, dense MLPs 16384 wide between
    "llama-4-maverick": {**LLAMA4_SCOUT, "num_local_experts": 128, "interleave_moe_layer_step": 2,
                         "use_qk_norm": False, "max_position_embeddings": 1048576},
}
SHAPE_ALIASES = {"0.5b": "qwen2.5-0.5b", "1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b", "0.6b": "qwen3-0.6b",
                 "1.7b": "qwen3-1.7b", "8b": "qwen3-8b"}


def shape_config(name: str):
    """A transformers config of a known model shape (by name or size, e.g. ``1.5b``), or of
    the checkpoint directory ``name`` (its config.json)."""
    from transformers import AutoConfig

    if (Path(name) / "config.json").is_file():
        return AutoConfig.from_pretrained(name)
    key = SHAPE_ALIASES.get(name.lower(), name.lower())
    if key not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}: one of {', '.join([*SHAPES, *SHAPE_ALIASES])} "
                         "or a checkpoint directory")
    return AutoConfig.for_model(**{"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, **SHAPES[key]})


def random_decoder(config, dtype: torch.dtype, device: str, backend: str = "torch") -> Decoder:
    """A decoder of ``config``'s shape with random weights, built on ``device`` directly."""
    spec = ModelSpec.from_hf(config)
    with torch.device(device):
        decoder = Decoder(spec, backend=backend).to(dtype)
    for parameter in decoder.parameters():
        parameter.requires_grad_(False).normal_(0.0, 0.02)
    if spec.tie_embeddings:
        decoder.lm_head.weight = decoder.embed_tokens.weight
    decoder.reset_rope()
    return decoder.to(device).eval()
