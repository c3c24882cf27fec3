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
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
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
    from transformers import (ArceeConfig, Cohere2Config, CohereConfig, Exaone4Config, Gemma2Config, Gemma3TextConfig, GemmaConfig, Glm4Config,
                              GraniteConfig, HunYuanDenseV1Config, LlamaConfig, MixtralConfig, Olmo2Config, Olmo3Config, Phi3Config,
                              Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SeedOssConfig,
                              SmolLM3Config, Starcoder2Config)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        eos_token_id=256,
        bos_token_id=None,
        pad_token_id=None,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
    if arch == "qwen3":  # Qwen3's config defaults head_dim to 128 whatever the width
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        return Qwen3Config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
    if arch == "qwen3_moe":  # 4 experts of 32, 2 a token, weights renormalised (Qwen3-30B-A3B's setting)
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        common = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2,
                  "norm_topk_prob": True, **common}
        return Qwen3MoeConfig(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
    if arch == "qwen2_moe":  # 4 experts of 32, 2 a token, not renormalised, a shared expert of 64 (Qwen1.5-MoE's)
        common = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2,
                  "shared_expert_intermediate_size": hidden, "norm_topk_prob": False, **common}
        return Qwen2MoeConfig(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
    if arch == "mixtral":  # 4 experts, 2 a token
        common = {"num_local_experts": 4, "num_experts_per_tok": 2, **common}
        common["intermediate_size"] = hidden // 2
        return MixtralConfig(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
    if arch == "granite":  # scalars away from 1 (Granite 3's: 12, 0.0078125, 0.22, 8), so each of them counts
        common = {"embedding_multiplier": 12.0, "attention_multiplier": 0.1, "residual_multiplier": 0.22,
                  "logits_scaling": 8.0, **common}
        return GraniteConfig(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
    if arch in ("olmo2", "olmo3"):  # OLMo 3: every 4th layer full, the others sliding (give sliding_window)
        config = Olmo2Config if arch == "olmo2" else Olmo3Config
        return config(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
    if arch in ("cohere", "cohere2"):  # LayerNorms' epsilon: layer_norm_eps; Cohere 2: 3 of 4 layers slide
        common.setdefault("layer_norm_eps", common.pop("rms_norm_eps"))
        config = CohereConfig if arch == "cohere" else Cohere2Config
        return config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
    if arch == "exaone4":  # a window: 3 of 4 layers slide, every 4th attends to all without RoPE
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        return Exaone4Config(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
    if arch in ("seed_oss", "hunyuan_v1_dense", "arcee"):  # head_dim defaults to 128 (Seed-OSS, Hunyuan)
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        config = {"seed_oss": SeedOssConfig, "hunyuan_v1_dense": HunYuanDenseV1Config, "arcee": ArceeConfig}[arch]
        return config(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
    if arch == "glm4":  # head_dim defaults to 128, pad_token_id past a tiny vocabulary
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        return Glm4Config(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
    if arch == "smollm3":  # every 4th layer without RoPE (its default interval)
        return SmolLM3Config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
    if arch == "starcoder2":  # its LayerNorms' epsilon is norm_epsilon
        common.setdefault("norm_epsilon", common.pop("rms_norm_eps"))
        return Starcoder2Config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
    if arch == "phi3":  # Phi-3's config defaults its special tokens to ids past a tiny vocabulary
        return Phi3Config(tie_word_embeddings=common.pop("tie_word_embeddings", False), **common)
    if arch in ("gemma", "gemma2", "gemma3_text"):  # head_dim defaults to 256, special tokens sit past the vocabulary
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        if arch != "gemma":  # its query scalar defaults to 256; the 27B's is not its head dim either
            common.setdefault("query_pre_attn_scalar", 24)
        config = {"gemma": GemmaConfig, "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig}[arch]
        return config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
    raise ValueError(f"no tiny config for {arch!r}")


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
        for name, weight in model.named_parameters():
            if norm_std and name.endswith("norm.weight"):
                weight.add_(torch.randn_like(weight) * norm_std)
            if bias_std and name.endswith(".bias"):
                weight.normal_(0.0, bias_std)
    model.to(dtype).save_pretrained(directory)
    if cfg.vocab_size >= TINY_VOCAB:  # smaller vocabularies are for token-level tests only
        make_byte_tokenizer(cfg.vocab_size).save_pretrained(directory)
    return directory
