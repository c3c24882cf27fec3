"""``specctl bench kernels``: how fast one decoder step is, against the memory-bandwidth limit.

A decode or verification step of a small batch reads every weight once (and the KV cache
of the context); at batch sizes this small it is memory-bound, so the bound is
bytes read / bandwidth. The bandwidth is measured here (a device-to-device copy, bytes
read + written), not taken from a data sheet. Models can be real checkpoints or random
weights of a real model's shape (``SHAPES``): timing does not depend on the values."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)


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


def weight_bytes_per_step(decoder: Decoder) -> int:
    """Bytes of weights a one-token step reads: every parameter once, except the embedding
    table, of which a step reads a few rows (unless the LM head reads it all: tied, unpacked),
    and a mixture of experts' experts, of which a token reads its top k."""
    spec = decoder.spec
    head_weight = getattr(decoder.lm_head, "weight", None)
    seen, total = set(), 0.0
    for name, parameter in decoder.named_parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        if name.startswith("embed_tokens.") and parameter is not head_weight:
            continue
        share = spec.experts_per_token / spec.num_experts if ".mlp.experts." in name else 1.0
        total += parameter.numel() * parameter.element_size() * share
    return round(total)


def bandwidth_limit_ms(step_bytes: int, bandwidth_gbps: float) -> float:
    return step_bytes / (bandwidth_gbps * 1e9) * 1e3


def measure_bandwidth_gbps(device: str, megabytes: int = 1024, repeats: int = 10) -> float:
    """Copy bandwidth of ``device`` in GB/s, counting bytes read and written."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    timings = []
    for _ in range(repeats + 2):
        start = _now(device)
        target.copy_(source)
        timings.append(_now(device) - start)
    return 2 * source.numel() / statistics.median(timings[2:]) / 1e9


def _now(device: str) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _timed(device: str, repeats: int, step: Callable[[], torch.Tensor], reset: Callable[[], object]
           ) -> tuple[float, float, float]:
    """min / median / max ms of ``repeats`` runs of ``step`` (after 3 untimed ones: they capture
    graphs), each ending in the host sync every real step has (its last logits' argmax), each
    followed by ``reset`` (untimed)."""
    timings = []
    for _ in range(repeats + 3):
        start = _now(device)
        int(step().argmax())
        timings.append((_now(device) - start) * 1e3)
        reset()
    kept = timings[3:]
    return min(kept), statistics.median(kept), max(kept)


@dataclass(frozen=True, slots=True)
class StepTiming:
    tokens: int
    ms_min: float
    ms_median: float
    ms_max: float


def primed_cache(decoder: Decoder, context: int, room: int, generator: torch.Generator):
    """A new cache holding ``context`` random tokens (their prefill run), with ``room`` slots more."""
    cache = decoder.new_cache(context + room)
    prompt = torch.randint(0, decoder.spec.vocab_size, (context,), generator=generator)
    decoder(prompt, torch.arange(context), cache, logits_at=torch.tensor([context - 1]))
    return cache


def time_steps(decoder: Decoder, context: int, sizes: tuple[int, ...], repeats: int,
               on_done: Callable[[], None] = lambda: None) -> list[StepTiming]:
    """Median (and spread) of ``repeats`` forwards of n new tokens after ``context`` cached ones,
    for each n in ``sizes``; the cache is cut back to the context after every step."""
    device = str(decoder.device)
    generator = torch.Generator().manual_seed(0)
    cache = primed_cache(decoder, context, max(sizes) + 1, generator)
    results = []
    for n in sizes:
        tokens = torch.randint(0, decoder.spec.vocab_size, (n,), generator=generator)
        positions = torch.arange(context, context + n)
        spread = _timed(device, repeats, lambda: decoder(tokens, positions, cache)[-1],
                        lambda: cache.truncate(context))
        results.append(StepTiming(n, *spread))
        on_done()
    cache.release()
    return results


@dataclass(frozen=True, slots=True)
class BatchTiming:
    sessions: int
    tokens: int  # new tokens of each session
    how: str  # "one replay a session" or "one eager forward"
    ms_min: float
    ms_median: float
    ms_max: float


REPLAY_EACH, ONE_EAGER = "one replay a session", "one eager forward"


def time_batches(decoder: Decoder, context: int, sessions: tuple[int, ...], tokens: tuple[int, ...], repeats: int,
                 on_done: Callable[[], None] = lambda: None) -> list[BatchTiming]:
    """A forward of several sessions (a draft server's batched step, a target's batched
    verification): each of ``sessions`` sessions adds ``tokens`` new tokens after ``context``
    of its own. Where the decoder's steps are graph replays, both ways a batch can run are
    timed — a replay per session (``Decoder.forward_many``'s choice up to
    ``REPLAY_PER_SESSION_UP_TO``) and one eager forward of all of them."""
    device = str(decoder.device)
    generator = torch.Generator().manual_seed(0)
    caches = [primed_cache(decoder, context, max(tokens) + 1, generator) for _ in range(max(sessions))]
    static = decoder.static
    per_session = static.per_session if static is not None else False
    results = []
    try:
        for count in sessions:
            for n in tokens:
                new = [torch.randint(0, decoder.spec.vocab_size, (n,), generator=generator) for _ in range(count)]
                positions = [torch.arange(context, context + n)] * count
                if static is not None:
                    static.per_session = per_session  # as the decoder had it: does it replay this many?
                hows = [True, False] if static is not None and static.replays_each(count) else [False]
                for replay_each in hows:
                    if static is not None:
                        static.per_session = replay_each
                    spread = _timed(
                        device, repeats,
                        lambda: decoder.forward_many(new, positions, caches[:count], [None] * count,
                                                     [torch.tensor([n - 1])] * count)[-1][-1],
                        lambda: [cache.truncate(context) for cache in caches[:count]])
                    results.append(BatchTiming(count, n, REPLAY_EACH if replay_each else ONE_EAGER, *spread))
                on_done()
    finally:
        if static is not None:
            static.per_session = per_session
        for cache in caches:
            cache.release()
    return results
