"""Tiny random-weight models built from a config: fast, download-free stand-ins for real
checkpoints in tests and examples. A byte-level tokenizer makes them usable end to end."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 320  # 256 byte tokens + specials + room for logits of unused ids


def make_byte_tokenizer(vocab_size: int = TINY_VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = {token: i for i, token in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    byte_vocab = {tok: i for i, tok in enumerate(sorted(byte_vocab))}
    # Qwen2.5-Coder's chat and fill-in-the-middle tokens (engine.fim)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
    for s in specials:
        byte_vocab[s] = len(byte_vocab)
    for i in range(len(byte_vocab), vocab_size):
        byte_vocab[f"<|unused{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": specials[1:]})
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = TINY_VOCAB, layers: int = 4, hidden: int = 64, **overrides):
    """A tiny transformers config of ``arch``: 4 heads (2 KV heads), head dim hidden / heads
    (several configs default theirs to 128 or 256 whatever the width), the family's own settings
    from ``_tiny_family``, then ``overrides``."""
    import transformers

    class_name, tied, settings, eps_name = _tiny_family(arch, hidden)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=256, bos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=tied)
    kwargs = {**common, **settings, **overrides}
    kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    if eps_name != "rms_norm_eps":  # StarCoder2's and Cohere's LayerNorms name their epsilon otherwise
        kwargs.setdefault(eps_name, kwargs.pop("rms_norm_eps"))
    if arch == "gpt_neox":  # every head its own keys and values (its config has no num_key_value_heads)
        kwargs.pop("num_key_value_heads")
    return getattr(transformers, class_name)(**kwargs)


def _tiny_family(arch: str, hidden: int) -> tuple[str, bool, dict, str]:
    """(config class, head tied by default, the family's tiny settings, its norm epsilon's name)."""
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2}
    families = {
        "llama": ("LlamaConfig", False, {}),
        "qwen2": ("Qwen2Config", True, {}),
        "qwen3": ("Qwen3Config", True, {}),
        # 4 experts of 32, 2 a token, weights renormalised (Qwen3-30B-A3B's setting)
        "qwen3_moe": ("Qwen3MoeConfig", False, {**experts, "norm_topk_prob": True}),
        # not renormalised, a shared expert of 64 (Qwen1.5-MoE's)
        "qwen2_moe": ("Qwen2MoeConfig", False, {**experts, "shared_expert_intermediate_size": hidden,
                                                 "norm_topk_prob": False}),
        "mixtral": ("MixtralConfig", False, {"num_local_experts": 4, "num_experts_per_tok": 2,
                                             "intermediate_size": hidden // 2}),
        # GLM-4.5: the first layer dense, then 4 experts of 32 in 2 groups (the best group's experts
        # only), 2 a token, weights renormalised and scaled by 2.5, an ungated shared expert; q/k/v biases
        "glm4_moe": ("Glm4MoeConfig", False, {"num_local_experts": 4, "num_experts_per_tok": 2,
                                              "moe_intermediate_size": hidden // 2, "first_k_dense_replace": 1,
                                              "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                                              "routed_scaling_factor": 2.5, "attention_bias": True}),
        # DeepSeek-V3: latent attention (queries through a rank-32 bottleneck, keys and values from a rank-16
        # latent, 16 + 8 rotated dims a head, values 16 wide), GLM-4.5's routing, the first layer dense
        "deepseek_v3": ("DeepseekV3Config", False, {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                                    "moe_intermediate_size": hidden // 2, "first_k_dense_replace": 1,
                                                    "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                                                    "routed_scaling_factor": 2.5, "q_lora_rank": 32,
                                                    "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                                                    "qk_rope_head_dim": 8, "v_head_dim": 12,
                                                    "head_dim": 8, "num_key_value_heads": 4}),  # head_dim: the rotated part
        # DeepSeek-V2: the same latent attention (RoPE as complex pairs), softmax routing within the best group
        "deepseek_v2": ("DeepseekV2Config", False, {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                                    "moe_intermediate_size": hidden // 2, "first_k_dense_replace": 1,
                                                    "n_shared_experts": 1, "topk_method": "group_limited_greedy",
                                                    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.0,
                                                    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                                                    "qk_rope_head_dim": 8, "v_head_dim": 12, "head_dim": 8,
                                                    "num_key_value_heads": 4}),
        # Llama 4: every other layer a mixture (4 experts of 32, the top one a token, a shared one), dense
        # layers 128 wide; every 4th layer without RoPE (temperature-tuned from position 8 on), the others in
        # chunks of 16 positions
        "llama4_text": ("Llama4TextConfig", False, {"num_local_experts": 4, "num_experts_per_tok": 1,
                                                    "intermediate_size": hidden // 2,
                                                    "intermediate_size_mlp": 2 * hidden,
                                                    "interleave_moe_layer_step": 2, "attention_chunk_size": 16,
                                                    "floor_scale": 8, "attn_scale": 0.1, "moe_layers": None,
                                                    "no_rope_layers": None, "layer_types": None}),
        # gpt-oss: 4 experts of 32, 2 a token; sliding and full layers alternate (give sliding_window);
        # its YaRN RoPE (factor 32) over a 16-token original context
        "gpt_oss": ("GptOssConfig", False, {"num_local_experts": 4, "num_experts_per_tok": 2,
                                            "intermediate_size": hidden // 2, "sliding_window": None,
                                            "rope_parameters": {"rope_type": "yarn", "factor": 32.0,
                                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                                "original_max_position_embeddings": 16,
                                                                "rope_theta": 150000.0}}),
        # scalars away from 1 (Granite 3's: 12, 0.0078125, 0.22, 8), so each of them counts
        "granite": ("GraniteConfig", False, {"embedding_multiplier": 12.0, "attention_multiplier": 0.1,
                                             "residual_multiplier": 0.22, "logits_scaling": 8.0}),
        "olmo2": ("Olmo2Config", False, {}),
        "olmo3": ("Olmo3Config", False, {}),  # every 4th layer full, the others sliding (give sliding_window)
        "cohere": ("CohereConfig", True, {}),
        "cohere2": ("Cohere2Config", True, {}),  # 3 of 4 layers slide
        "exaone4": ("Exaone4Config", False, {}),  # a window: 3 of 4 layers slide, every 4th global without RoPE
        "seed_oss": ("SeedOssConfig", False, {}),
        "hunyuan_v1_dense": ("HunYuanDenseV1Config", False, {}),
        "arcee": ("ArceeConfig", False, {}),
        "glm4": ("Glm4Config", False, {}),
        "smollm3": ("SmolLM3Config", True, {}),  # every 4th layer without RoPE (its default interval)
        "starcoder2": ("Starcoder2Config", True, {}),
        # GPT-NeoX (Pythia): RoPE on a quarter of each head, attention and MLP in parallel (its defaults)
        "gpt_neox": ("GPTNeoXConfig", False, {}),
        "phi3": ("Phi3Config", False, {}),
        # Phi-2: RoPE on the first 40 % of each head (6 of 16 here), gelu_new, parallel branches, a head bias
        "phi": ("PhiConfig", False, {"partial_rotary_factor": 0.4}),
        "gemma": ("GemmaConfig", True, {}),
        # their query scalar defaults to 256; the 27B's is not its head dim either
        "gemma2": ("Gemma2Config", True, {"query_pre_attn_scalar": 24}),
        "gemma3_text": ("Gemma3TextConfig", True, {"query_pre_attn_scalar": 24}),
    }
    if arch not in families:
        raise ValueError(f"no tiny config for {arch!r}")
    eps_name = {"starcoder2": "norm_epsilon", "cohere": "layer_norm_eps", "cohere2": "layer_norm_eps",
                "gpt_neox": "layer_norm_eps", "phi": "layer_norm_eps"}.get(arch, "rms_norm_eps")
    return (*families[arch], eps_name)


def make_tiny_model(directory: Path | str, arch: str = "llama", seed: int = 0, init_std: float = 0.1,
                    dtype: torch.dtype = torch.float32, norm_std: float = 0.0, bias_std: float = 0.0,
                    **config) -> Path:
    """Write a random-weight checkpoint (config.json, safetensors, tokenizer) to ``directory``,
    its weights stored in ``dtype`` (bf16, as the packaged models are stored, for the loaders
    that keep a checkpoint's dtype).

    ``init_std`` larger than the usual 0.02 gives peaked, varied next-token distributions, so
    greedy decoding does not collapse into repeating one token. ``norm_std`` > 0 draws every
    RMSNorm weight as 1 + N(0, norm_std) (they start at ones; Gemma's, offsets from one, at zeros:
    N(0, norm_std)), so a test sees each norm's weight used; ``bias_std`` > 0 draws every bias
    (transformers starts them at zeros) as N(0, bias_std)."""
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    cfg = tiny_config(arch, **config)
    cfg.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in [*model.named_parameters(), *model.named_buffers()]:
            if norm_std and name.endswith("norm.weight"):
                weight.add_(torch.randn_like(weight) * norm_std)
            if bias_std and name.endswith((".bias", "_bias")):  # gpt-oss's experts', GLM-4.5's score correction
                weight.normal_(0.0, bias_std)
    model.to(dtype).save_pretrained(directory)
    if cfg.vocab_size >= TINY_VOCAB:  # smaller vocabularies are for token-level tests only
        make_byte_tokenizer(cfg.vocab_size).save_pretrained(directory)
    return directory
