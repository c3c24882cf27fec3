"""Each family's departures from the Llama layer, read from its config and checkpoint as
transformers reads them: each one checked to count (taken away, the logits move), and where the
family's numerics allow, bf16 logits equal to transformers' to the bit."""

import dataclasses
import math
import types

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM

from specctl.engine.families import _gpt_oss
from specctl.engine.fusion import fuse_projections
from specctl.engine.layers import PlainMLP
from specctl.engine.loader import load_decoder
from specctl.engine.moe import Routing, SparseMoE
from specctl.engine.spec import ModelSpec
from specctl.engine.tiny import make_tiny_model, tiny_config
from specctl.errors import UnsupportedArchitecture
from tests.test_engine_parity import _check_parity, _max_rel_diff


def _bf16_equals_transformers(decoder, path, ids: torch.Tensor, attention: str = "sdpa", **options) -> torch.Tensor:
    """Asserts the bf16 decoder's logits of ``ids`` (one prefill) equal transformers' bf16 model's
    (its ``attention`` implementation: SDPA, or eager where the decoder attends as eager does —
    Gemma's own query scale; ``options``: from_pretrained's others) to the bit; returns
    transformers' (float32)."""
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=attention,
                                                   **options).eval()(ids[None]).logits[0].float()
    assert torch.equal(decoder(ids, torch.arange(ids.numel()), decoder.new_cache(ids.numel())), ref)
    return ref


def test_gemma3_rotates_sliding_layers_with_their_own_rope_and_norms_queries_and_keys(tiny_dir):
    """Gemma 3 (text): 60 tokens, past its 24-token windows; sliding layers rotate with base
    10k, full ones with 1M scaled 8x (linear); its q/k norms scale by 1 + w. Each of them
    taken away moves the logits off transformers'."""
    decoder = load_decoder(tiny_dir["gemma3"])
    assert [layer.rotates_locally for layer in decoder.layers] == [True, True, False, True]
    assert decoder.spec.layer_windows == (24, 24, None, 24) and decoder.spec.qk_norm
    assert decoder.layers[0].self_attn.q_norm.unit_offset and not torch.equal(decoder.inv_freq, decoder.local_inv_freq)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (60,))
    _check_parity(tiny_dir["gemma3"], ids, split=30)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tiny_dir["gemma3"], dtype=torch.float32).eval()(ids[None]).logits[0]
    for layer in decoder.layers:
        layer.rotates_locally = False
    assert _max_rel_diff(decoder(ids, torch.arange(60), decoder.new_cache(60)), ref) > 0.01
    with pytest.raises(UnsupportedArchitecture, match="an embedding model"):
        ModelSpec.from_hf(tiny_config("gemma3_text", use_bidirectional_attention=True))


def test_qwen3_norms_each_head_s_queries_and_keys_with_its_checkpoint_weights(tiny_dir):
    """The tiny Qwen3's q/k norm weights are drawn away from ones, so the parity above needs them
    read and applied per head before RoPE; a Qwen3 config asks for them, the others do not."""
    decoder = load_decoder(tiny_dir["qwen3"])
    attn = decoder.layers[0].self_attn
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (decoder.spec.head_dim,)
    assert not torch.equal(attn.q_norm.weight, torch.ones_like(attn.q_norm.weight))
    assert decoder.spec.qk_norm and not decoder.spec.attention_bias and attn.q_proj.bias is None
    assert not load_decoder(tiny_dir["qwen2"]).spec.qk_norm
    assert load_decoder(tiny_dir["qwen2"]).layers[0].self_attn.q_norm is None


def test_phi3_fused_checkpoint_tensors_split_into_the_layer_s_projections(tiny_dir, tmp_path):
    """Phi-3 stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (gate first):
    the loader splits them into the projections every family's layer runs, rows in order.
    Full rotary (Phi-3) as well as the fixture's partial one (Phi-4-mini) equal transformers."""


    decoder = load_decoder(tiny_dir["phi3"])
    with safe_open(str(tiny_dir["phi3"] / "model.safetensors"), framework="pt") as f:
        assert not any(".q_proj." in key or ".gate_proj." in key for key in f.keys())
        qkv, gate_up = f.get_tensor("model.layers.1.self_attn.qkv_proj.weight"), f.get_tensor("model.layers.1.mlp.gate_up_proj.weight")
    attn, mlp = decoder.layers[1].self_attn, decoder.layers[1].mlp
    assert torch.equal(torch.cat((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)), qkv)
    assert torch.equal(torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)), gate_up)
    assert attn.q_proj.weight.shape == (64, 64) and attn.k_proj.weight.shape == (32, 64)
    assert decoder.inv_freq.numel() == 6  # 0.75 of a 16-wide head, in pairs
    torch.manual_seed(0)
    _check_parity(make_tiny_model(tmp_path / "full", "phi3", seed=2), torch.randint(0, 300, (24,)), split=17)
    # a pipeline stage reads only its own layers' fused tensors
    stage = load_decoder(tiny_dir["phi3"], layer_range=(2, 4), embed=False, head=False)
    assert torch.equal(stage.layers[0].mlp.up_proj.weight, load_decoder(tiny_dir["phi3"]).layers[2].mlp.up_proj.weight)


def test_experts_are_routed_per_token_and_read_from_each_checkpoint_s_names(tiny_dir, tmp_path):
    """Qwen3-MoE's and Mixtral's sparse layers: every expert of the checkpoint loaded (Mixtral's
    w1/w3/w2 under block_sparse_moe), tokens routed to several experts, each token's top 2;
    Qwen3-MoE's dense layers (mlp_only_layers) and un-normalised weights match too."""


    mixtral = load_decoder(tiny_dir["mixtral"])
    moe = mixtral.layers[1].mlp
    assert isinstance(moe, SparseMoE) and len(moe.experts) == 4 and moe.normalize and moe.top_k == 2
    with safe_open(str(tiny_dir["mixtral"] / "model.safetensors"), framework="pt") as f:
        assert torch.equal(moe.experts[3].up_proj.weight, f.get_tensor("model.layers.1.block_sparse_moe.experts.3.w3.weight"))
        assert torch.equal(moe.gate.weight, f.get_tensor("model.layers.1.block_sparse_moe.gate.weight"))
    torch.manual_seed(0)
    h = torch.randn(1, 32, 64)
    chosen = torch.topk(moe.gate(h[0]), 2, dim=-1).indices
    assert chosen.unique().numel() == 4  # the tiny router spreads tokens over every expert
    path = make_tiny_model(tmp_path / "q", "qwen3_moe", seed=3, mlp_only_layers=[1], norm_topk_prob=False)
    decoder = load_decoder(path)
    assert decoder.spec.sparse_layers == (True, False, True, True) and not decoder.layers[0].mlp.normalize
    assert not isinstance(decoder.layers[1].mlp, SparseMoE) and decoder.layers[1].mlp.gate_proj.weight.shape == (128, 64)
    _check_parity(path, torch.randint(0, 300, (24,)), split=17)


def test_qwen2_moe_s_shared_expert_and_its_gate_count(tiny_dir):
    """Qwen2-MoE: every sparse layer adds a shared expert, times sigmoid of its own gate, to the
    routed experts' sum; q/k/v have biases. Without the shared expert, or with its gate taken
    as 1, the logits are not transformers'."""
    decoder = load_decoder(tiny_dir["qwen2_moe"])
    moe = decoder.layers[2].mlp
    assert decoder.spec.shared_expert_intermediate_size == 64 and decoder.spec.attention_bias and not moe.normalize
    with safe_open(str(tiny_dir["qwen2_moe"] / "model.safetensors"), framework="pt") as f:
        assert torch.equal(moe.shared_expert.down_proj.weight, f.get_tensor("model.layers.2.mlp.shared_expert.down_proj.weight"))
        assert torch.equal(moe.shared_expert_gate.weight, f.get_tensor("model.layers.2.mlp.shared_expert_gate.weight"))
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (24,))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tiny_dir["qwen2_moe"], dtype=torch.float32).eval()(ids[None]).logits[0]
    assert _max_rel_diff(decoder(ids, torch.arange(24), decoder.new_cache(24)), ref) <= 1e-4
    gates = [layer.mlp.shared_expert_gate for layer in decoder.layers]
    for layer in decoder.layers:  # the gate's sigmoid -> 1 (a large logit): the shared expert ungated
        layer.mlp.shared_expert_gate = torch.nn.Linear(64, 1, bias=True).requires_grad_(False)
        layer.mlp.shared_expert_gate.weight.zero_(), layer.mlp.shared_expert_gate.bias.fill_(50.0)
    assert _max_rel_diff(decoder(ids, torch.arange(24), decoder.new_cache(24)), ref) > 0.01
    for layer, gate in zip(decoder.layers, gates):
        layer.mlp.shared_expert, layer.mlp.shared_expert_gate = None, None
    assert _max_rel_diff(decoder(ids, torch.arange(24), decoder.new_cache(24)), ref) > 0.01


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_experts_saved_as_transformers_holds_them_load_as_the_hub_s_per_expert_ones(tiny_dir, tmp_path, arch):
    """`models` converts a GGUF by saving the model's state dict, where transformers 5 holds a
    layer's experts as 3-D stacks (and Mixtral's router under mlp): the same decoder, whole or
    as a pipeline stage's layers."""
    import shutil

    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(tiny_dir[arch], dtype=torch.float32)
    state = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and state["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    shutil.copytree(tiny_dir[arch], tmp_path / "m")
    save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    hub, stacked = load_decoder(tiny_dir[arch]), load_decoder(tmp_path / "m")
    assert hub.state_dict().keys() == stacked.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(hub.state_dict().values(), stacked.state_dict().values()))
    stage = load_decoder(tmp_path / "m", layer_range=(2, 4), embed=False, head=False)
    assert torch.equal(stage.layers[1].mlp.experts[2].up_proj.weight, hub.layers[3].mlp.experts[2].up_proj.weight)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "granite"])
def test_attention_bias_gives_the_output_projection_its_bias_where_transformers_does(tmp_path, arch):
    """Llama's layer (and Qwen3's, Gemma's, Granite's) with attention_bias: q/k/v and o_proj
    have biases — found: o_proj's was left out, and the loader dropped the tensor without a
    word (the logits 24-108 % off). The biases are drawn away from transformers' zeros."""
    path = make_tiny_model(tmp_path / arch, arch, seed=5, bias_std=0.5, attention_bias=True)
    decoder = load_decoder(path)
    assert decoder.spec.output_bias and decoder.layers[0].self_attn.o_proj.bias is not None
    assert not decoder.spec.llama_layers  # the fused static pieces take no o_proj bias
    torch.manual_seed(0)
    _check_parity(path, torch.randint(0, 300, (24,)), split=17)
    assert not ModelSpec.from_hf(tiny_config("qwen2")).output_bias  # Qwen2's q/k/v biases only


@pytest.mark.parametrize("arch", ["olmo2", "olmo3"])
def test_olmo_s_layer_equals_transformers_bitwise_in_bf16_and_each_departure_counts(tiny_dir, arch):
    """OLMo 2/3: norms after the sub-layers only, q/k normed across all heads, norm weights applied
    in float32 before the cast, RoPE in float32 — in bf16 the logits are transformers' to the
    bit (OLMo 3 past its 24-token windows); rotating in bf16 instead moves them (measured 1.4 %),
    and in fp32 the norm across heads taken per head does too."""
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (40,))
    decoder = load_decoder(tiny_dir[arch], torch.bfloat16)
    assert decoder.spec.post_norms and not hasattr(decoder.layers[0], "input_layernorm")
    assert decoder.layers[0].self_attn.q_norm.weight.shape == (64,)  # 4 heads of 16
    ref = _bf16_equals_transformers(decoder, tiny_dir[arch], ids)
    object.__setattr__(decoder.spec, "rope_in_float32", False)
    assert _max_rel_diff(decoder(ids, torch.arange(40), decoder.new_cache(40)), ref) > 0.005
    fp32 = load_decoder(tiny_dir[arch])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tiny_dir[arch], dtype=torch.float32).eval()(ids[None]).logits[0]
    for layer in fp32.layers:  # the same weights, normed per head
        attn = layer.self_attn
        attn.qk_norm_across_heads = False
        attn.q_norm.weight.data, attn.k_norm.weight.data = attn.q_norm.weight[:16], attn.k_norm.weight[:16]
    assert _max_rel_diff(fp32(ids, torch.arange(40), fp32.new_cache(40)), ref) > 0.01


def test_starcoder2_s_layer_norms_plain_mlp_and_biases_equal_transformers_bitwise_in_bf16(tiny_dir):
    """StarCoder2: LayerNorm with biases (its norm_epsilon), c_fc -> GELU-tanh -> c_proj, biases
    on every projection, every layer sliding (24 tokens here): bf16 logits 60 tokens in equal
    transformers' to the bit."""


    decoder = load_decoder(tiny_dir["starcoder2"], torch.bfloat16)
    layer = decoder.layers[0]
    assert isinstance(layer.input_layernorm, nn.LayerNorm) and isinstance(layer.mlp, PlainMLP)
    assert layer.self_attn.o_proj.bias is not None and decoder.spec.layer_windows == (24,) * 4
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (60,))
    _bf16_equals_transformers(decoder, tiny_dir["starcoder2"], ids)
    assert ModelSpec.from_hf(tiny_config("starcoder2", norm_epsilon=1e-3)).rms_eps == 1e-3


def test_smollm3_s_nope_layers_do_not_rotate_and_its_unused_window_stays_off(tiny_dir, tmp_path):
    """SmolLM3: every 4th layer attends without RoPE (no_rope_layers); rotating it too moves the
    logits (measured 21 %). Its config keeps a sliding_window that use_sliding_window turns on
    (then its NoPE layers slide, as transformers builds layer_types) or leaves off."""
    decoder = load_decoder(tiny_dir["smollm3"])
    assert [layer.rotates for layer in decoder.layers] == [True, True, True, False]
    assert not decoder.spec.llama_layers  # the fused pieces rotate every layer
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (40,))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tiny_dir["smollm3"], dtype=torch.float32).eval()(ids[None]).logits[0]
    for layer in decoder.layers:
        layer.rotates = True
    assert _max_rel_diff(decoder(ids, torch.arange(40), decoder.new_cache(40)), ref) > 0.05
    assert ModelSpec.from_hf(tiny_config("smollm3", sliding_window=24)).layer_windows == (None,) * 4
    path = make_tiny_model(tmp_path / "w", "smollm3", seed=3, init_std=0.2, use_sliding_window=True, sliding_window=24)
    assert load_decoder(path).spec.layer_windows == (None, None, None, 24)
    _check_parity(path, torch.randint(0, 300, (60,)), split=30)


def test_glm4_s_norm_names_fused_mlp_and_paired_rope_read_as_transformers_does(tiny_dir):
    """GLM-4: its post_self_attn / post_attention / post_mlp norms are Gemma 2's after-attention,
    before-MLP and after-MLP norms; gate/up stored fused; q/k/v biased, o_proj not; RoPE over
    half of each head with neighbouring dims paired — bf16 logits equal transformers' to the bit,
    and rotating the halves instead moves them."""
    decoder = load_decoder(tiny_dir["glm4"], torch.bfloat16)
    layer = decoder.layers[1]
    with safe_open(str(tiny_dir["glm4"] / "model.safetensors"), framework="pt") as f:
        assert torch.equal(layer.pre_feedforward_layernorm.weight,
                           f.get_tensor("model.layers.1.post_attention_layernorm.weight").bfloat16())
        assert torch.equal(layer.post_attention_layernorm.weight,
                           f.get_tensor("model.layers.1.post_self_attn_layernorm.weight").bfloat16())
        assert torch.equal(layer.mlp.up_proj.weight, f.get_tensor("model.layers.1.mlp.gate_up_proj.weight")[128:].bfloat16())
    assert layer.self_attn.q_proj.bias is not None and layer.self_attn.o_proj.bias is None
    assert decoder.inv_freq.numel() == 4  # 8 of each head's 16 dims rotate
    stage = load_decoder(tiny_dir["glm4"], torch.bfloat16, layer_range=(1, 3), embed=False, head=False)
    assert torch.equal(stage.layers[0].post_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (40,))
    ref = _bf16_equals_transformers(decoder, tiny_dir["glm4"], ids)
    object.__setattr__(decoder.spec, "rope_interleaved", False)
    for layer in decoder.layers:
        layer.self_attn.rope_interleaved = False
    assert _max_rel_diff(decoder(ids, torch.arange(40), decoder.new_cache(40)), ref) > 0.01


def test_exaone4_s_hybrid_attention_equals_transformers_bitwise_in_bf16(tiny_dir, tmp_path):
    """EXAONE 4.0: norms after the sub-layers (Llama's RMSNorm), per-head q/k norms; with a window,
    3 of 4 layers slide with RoPE and every 4th attends to all without it — bf16 logits 60 tokens
    in (past the 24-token window) equal transformers' to the bit. Without a window (the 1.2B's
    config: every layer full) every layer rotates."""
    decoder = load_decoder(tiny_dir["exaone4"], torch.bfloat16)
    assert decoder.spec.layer_windows == (24, 24, 24, None) and decoder.spec.rope_layers == (True, True, True, False)
    assert decoder.spec.post_norms and decoder.layers[0].self_attn.q_norm.weight.shape == (16,)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (60,))
    _bf16_equals_transformers(decoder, tiny_dir["exaone4"], ids)
    path = make_tiny_model(tmp_path / "full", "exaone4", seed=3, init_std=0.2, sliding_window=None,
                           layer_types=["full_attention"] * 4)  # transformers divides by zero without them
    assert load_decoder(path).spec.rope_layers == (True,) * 4
    _check_parity(path, ids, split=30)


def test_cohere2_s_parallel_layer_equals_transformers_bitwise_in_bf16_and_each_departure_counts(tiny_dir):
    """Cohere 2 (Command R7B): one LayerNorm a layer without bias (mean taken away, weight in
    float32) feeding attention and MLP side by side; RoPE with neighbouring dims paired, q/k
    rotated in float32, on the sliding layers only; logits times 1/16. bf16 logits 60 tokens in
    equal transformers' to the bit; without the centring, or with the last layer rotating too,
    the fp32 logits move."""
    decoder = load_decoder(tiny_dir["cohere2"], torch.bfloat16)
    layer = decoder.layers[0]
    assert layer.parallel and not hasattr(layer, "post_attention_layernorm") and layer.input_layernorm.centered
    assert decoder.spec.rope_layers == (True, True, True, False) and decoder.spec.logit_scale == 0.0625
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (60,))
    _bf16_equals_transformers(decoder, tiny_dir["cohere2"], ids)
    fp32 = load_decoder(tiny_dir["cohere2"])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tiny_dir["cohere2"], dtype=torch.float32).eval()(ids[None]).logits[0]
    assert _max_rel_diff(fp32(ids, torch.arange(60), fp32.new_cache(60)), ref) <= 1e-4
    fp32.layers[3].rotates = True
    assert _max_rel_diff(fp32(ids, torch.arange(60), fp32.new_cache(60)), ref) > 0.01
    fp32.layers[3].rotates = False
    for layer in fp32.layers:
        layer.input_layernorm.centered = False
    assert _max_rel_diff(fp32(ids, torch.arange(60), fp32.new_cache(60)), ref) > 0.01


def test_command_r_plus_s_qk_norms_carry_a_weight_per_head_and_speculation_is_exact(tiny, tmp_path):
    """Cohere (Command R, R+, Aya): Cohere 2's parallel layer, every layer rotating, and with
    use_qk_norm a LayerNorm over each head's queries and keys whose weight is per head ([heads,
    head_dim]). bf16 logits equal transformers' to the bit; one weight shared by the heads moves
    the fp32 logits; chain and tree speculation write the target's own tokens."""
    path = make_tiny_model(tmp_path / "r", "cohere", seed=36, init_std=0.2, norm_std=0.3, use_qk_norm=True)
    decoder = load_decoder(path, torch.bfloat16)
    assert decoder.layers[0].self_attn.q_norm.weight.shape == (4, 16) and decoder.spec.rope_layers == ()
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (40,))
    _bf16_equals_transformers(decoder, path, ids)
    fp32, ref = _fp32_parity(path, ids)
    _speculation_is_exact(fp32, tiny["cohere2-draft"])
    for layer in fp32.layers:
        norm = layer.self_attn.q_norm
        norm.weight.data = norm.weight[:1].expand_as(norm.weight).clone()
    assert _max_rel_diff(fp32(ids, torch.arange(40), fp32.new_cache(40)), ref) > 0.01


def _fp32_parity(path, ids: torch.Tensor):
    """The fp32 decoder of ``path`` and transformers' fp32 logits of ``ids``, asserted within 1e-4."""
    decoder = load_decoder(path)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids[None]).logits[0]
    assert _max_rel_diff(decoder(ids, torch.arange(ids.numel()), decoder.new_cache(ids.numel())), ref) <= 1e-4
    return decoder, ref


def _speculation_is_exact(target, draft) -> None:
    """Chain and tree speculation with ``draft`` write ``target``'s own greedy tokens."""
    from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import generate

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in ([7, 8, 9, 10] * 5, list(range(30, 60))):
        reference = generate(target, prompt, params)[0]
        assert len(set(reference)) > 4  # not one token repeated: a comparison that can fail
        for drafter in (ModelChainDrafter(draft, 4), ModelTreeDrafter(draft, 3, 2, 3)):
            assert generate(target, prompt, params, drafter)[0] == reference


def test_seed_oss_s_output_bias_follows_its_own_flag(tiny, tmp_path):
    """Seed-OSS: Llama's layer with q/k/v biases (attention_bias) and o_proj's bias by
    attention_out_bias; bf16 logits equal transformers' to the bit."""
    path = make_tiny_model(tmp_path / "s", "seed_oss", seed=37, init_std=0.2, bias_std=0.1, attention_out_bias=True)
    decoder = load_decoder(path, torch.bfloat16)
    assert decoder.spec.output_bias and decoder.spec.attention_bias
    assert not ModelSpec.from_hf(tiny_config("seed_oss")).output_bias  # its default: no o_proj bias
    torch.manual_seed(0)
    _bf16_equals_transformers(decoder, path, torch.randint(0, 300, (40,)))
    _speculation_is_exact(load_decoder(path), tiny["llama-draft"])


def test_hunyuan_norms_queries_and_keys_after_rope_with_its_ntk_alpha_base(tiny, tmp_path):
    """Hunyuan (dense): per-head q/k norms (query/key_layernorm) applied after RoPE, whose base
    is stretched by a fixed NTK alpha (its checkpoints call it "dynamic"). bf16 logits equal
    transformers' to the bit; the norms before RoPE, or the plain base, move the fp32 logits."""
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}
    path = make_tiny_model(tmp_path / "h", "hunyuan_v1_dense", seed=38, init_std=0.2, norm_std=0.3, rope_parameters=rope)
    decoder = load_decoder(path, torch.bfloat16)
    assert decoder.spec.qk_norm_after_rope
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(decoder.layers[1].self_attn.k_norm.weight,
                           f.get_tensor("model.layers.1.self_attn.key_layernorm.weight").bfloat16())
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (40,))
    _bf16_equals_transformers(decoder, path, ids)
    fp32, ref = _fp32_parity(path, ids)
    _speculation_is_exact(fp32, tiny["llama-draft"])
    for layer in fp32.layers:
        layer.self_attn.qk_norm_after_rope = False
    assert _max_rel_diff(fp32(ids, torch.arange(40), fp32.new_cache(40)), ref) > 0.01
    for layer in fp32.layers:
        layer.self_attn.qk_norm_after_rope = True
    fp32.inv_freq = ModelSpec.from_hf(tiny_config("hunyuan_v1_dense")).inv_freq()[0]  # base 10k, no alpha
    assert _max_rel_diff(fp32(ids, torch.arange(40), fp32.new_cache(40)), ref) > 0.01


def test_arcee_s_ungated_relu2_mlp_reads_up_and_down_proj(tiny, tmp_path):
    """Arcee (AFM): Llama's attention with an MLP without gate, up_proj -> ReLU^2 -> down_proj
    (the plain MLP StarCoder2 has, under Arcee's names); bf16 logits equal transformers' to the
    bit; int8 quantizes both projections."""
    from specctl.engine.quant import quantize_decoder

    path = make_tiny_model(tmp_path / "a", "arcee", seed=39, init_std=0.2, norm_std=0.3)
    decoder = load_decoder(path, torch.bfloat16)
    assert isinstance(decoder.layers[0].mlp, PlainMLP) and decoder.spec.activation == "relu2"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(decoder.layers[0].mlp.c_fc.weight, f.get_tensor("model.layers.0.mlp.up_proj.weight").bfloat16())
    torch.manual_seed(0)
    _bf16_equals_transformers(decoder, path, torch.randint(0, 300, (40,)))
    _speculation_is_exact(load_decoder(path), tiny["llama-draft"])
    quantized = quantize_decoder(load_decoder(path), "int8")
    assert not any(type(module) is nn.Linear for module in quantized.modules())


def _multimodal_gemma3(directory, seed: int = 40):
    """A tiny Gemma3ForConditionalGeneration (a SigLIP tower of one layer, a projector) around the
    fixture's Gemma 3 text settings, saved as the Hub's 4B-27B checkpoints are (language_model.model.*)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        SiglipVisionConfig,
    )

    from specctl.engine.tiny import make_byte_tokenizer
    from tests.conftest import GEMMA3

    text = tiny_config("gemma3_text", **GEMMA3)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=300, boi_token_index=301, eoi_token_index=302, initializer_range=0.2)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # (1 + w) norms drawn away from 0, as the text fixture's
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                weight.add_(torch.randn_like(weight) * 0.3)
    model.save_pretrained(directory)
    make_byte_tokenizer().save_pretrained(directory)
    return directory


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tiny, tmp_path):
    """Gemma 3 4B-27B ship only as Gemma3ForConditionalGeneration: the language model (its
    text_config, its tensors under language_model.model.) is decoded as transformers decodes text
    with that class — bf16 logits to the bit — the vision tower and projector are not loaded,
    speculation with the 1B-sized draft is exact, and a pipeline stage reads only its layers."""
    from specctl.engine.loader import load_model

    path = _multimodal_gemma3(tmp_path / "mm")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert "language_model.model.layers.0.mlp.up_proj.weight" in f.keys()
        assert any(key.startswith("vision_tower.") for key in f.keys())
    decoder = load_decoder(path, torch.bfloat16)
    assert decoder.spec.arch == "gemma3_text" and decoder.spec.layer_windows == (24, 24, None, 24)
    assert not any("vision" in name or "projector" in name for name in decoder.state_dict())
    torch.manual_seed(0)
    _bf16_equals_transformers(decoder, path, torch.randint(0, 300, (40,)), attention="eager")
    _speculation_is_exact(load_decoder(path), tiny["gemma3-draft"])
    stage = load_decoder(path, layer_range=(2, 4), embed=False, head=True)
    assert torch.equal(stage.layers[0].mlp.up_proj.weight, load_decoder(path).layers[2].mlp.up_proj.weight)
    assert load_model("mm", path, "fp32", num_layers=2).decoder.num_layers == 2  # NAME@2: its own first layers


def test_granite_s_scalars_are_read_and_each_one_counts(tiny_dir):
    """Granite: embeddings times 12, queries scaled 0.1, each branch times 0.22 before its
    residual add, logits divided by 8 (the fixture's; Granite 3's own are of that order):
    without any one of them the logits are not transformers'."""
    decoder = load_decoder(tiny_dir["granite"])
    spec = decoder.spec
    assert (spec.embed_scale, spec.attn_scale, spec.residual_scale, spec.logit_divisor) == (12.0, 0.1, 0.22, 8.0)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (24,))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tiny_dir["granite"], dtype=torch.float32).eval()(ids[None]).logits[0]
    assert _max_rel_diff(decoder(ids, torch.arange(24), decoder.new_cache(24)), ref) <= 1e-4
    for field in ("embed_scale", "residual_scale", "logit_divisor"):
        changed = load_decoder(tiny_dir["granite"])
        object.__setattr__(changed.spec, field, 1.0)
        for layer in changed.layers:
            layer.residual_scale = changed.spec.residual_scale
        assert _max_rel_diff(changed(ids, torch.arange(24), changed.new_cache(24)), ref) > 0.01, field


def test_gemma_1_decodes_as_transformers(tmp_path):
    """Gemma 1 (CodeGemma too): GELU (its hidden_act), (1 + w) norms, scaled embeddings, tied
    head; Gemma 2's sandwich norms, query scale and caps are its own (the fixture's parity)."""
    path = make_tiny_model(tmp_path / "gemma", "gemma", seed=2, norm_std=0.3)
    spec = load_decoder(path).spec
    assert (spec.activation, spec.unit_offset_norms, spec.sandwich_norms) == ("gelu_pytorch_tanh", True, False)
    assert spec.attn_scale is spec.attn_softcap is spec.logit_softcap is None and spec.embed_scale == 8.0
    torch.manual_seed(0)
    _check_parity(path, torch.randint(0, 300, (24,)), split=17)


def test_gemma2_reads_each_of_its_departures_from_the_llama_layer(tiny_dir):
    """What the fixture's parity rests on: every Gemma 2 fact read from its config, four norms a
    layer stored as offsets from one, and its layers kept off the Llama-shaped fused pieces."""
    decoder = load_decoder(tiny_dir["gemma2"])
    spec, layer = decoder.spec, decoder.layers[0]
    assert (spec.activation, spec.unit_offset_norms, spec.sandwich_norms) == ("gelu_pytorch_tanh", True, True)
    assert (spec.attn_scale, spec.attn_softcap, spec.logit_softcap, spec.embed_scale) == (24**-0.5, 1.0, 4.0, 8.0)
    assert layer.pre_feedforward_layernorm.unit_offset and decoder.norm.unit_offset
    assert abs(float(layer.post_feedforward_layernorm.weight.detach().mean())) < 0.3  # offsets: around 0, not 1
    assert not spec.llama_layers and not fuse_projections(decoder).layers[0].fused
    assert load_decoder(tiny_dir["llama"]).spec.llama_layers


def test_gpt_oss_equals_transformers_bitwise_in_bf16_and_each_departure_counts(tiny, tiny_dir):
    """gpt-oss: biases on q/k/v/o, a sink logit per head in each softmax, RMSNorms scaled in
    float32, every layer a mixture of clamped-SwiGLU experts (gate and up interleaved, biases
    added apart) routed by a softmax over the top-2 logits of a biased router, sliding (24) and
    full layers alternating, YaRN RoPE. bf16 logits 60 tokens in (past the window) equal
    transformers' to the bit; without the sinks, with gate/up read as halves, or with the
    softmax over all experts, the fp32 logits move; a pipeline stage reads its own layers."""
    path = tiny_dir["gpt_oss"]
    decoder = load_decoder(path, torch.bfloat16)
    spec, moe = decoder.spec, decoder.layers[1].mlp
    assert spec.layer_windows == (24, None, 24, None) and spec.attention_sinks and spec.output_bias
    assert spec.clamped_swiglu == (1.702, 7.0) and moe.routing.kind == "softmax_over_chosen" and moe.gate.bias is not None
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        stack = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj")  # [E, H, 2I]: x @ W
        assert torch.equal(moe.experts[2].gate_up_proj.weight, stack[2].T.bfloat16())
        biases = f.get_tensor("model.layers.1.mlp.experts.down_proj_bias")
        assert torch.equal(moe.experts[3].down_proj_bias, biases[3].bfloat16())
        assert torch.equal(moe.gate.bias, f.get_tensor("model.layers.1.mlp.router.bias").bfloat16())
        assert torch.equal(decoder.layers[0].self_attn.sinks, f.get_tensor("model.layers.0.self_attn.sinks").bfloat16())
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (60,))
    _bf16_equals_transformers(decoder, path, ids, attention="eager")  # transformers runs gpt-oss's sinks eagerly
    stage = load_decoder(path, layer_range=(1, 3), embed=False, head=False)
    assert torch.equal(stage.layers[0].mlp.experts[1].gate_up_proj_bias,
                       tiny["gpt_oss"].layers[1].mlp.experts[1].gate_up_proj_bias)
    fp32, ref = _fp32_parity(path, ids)

    def moved() -> bool:
        return _max_rel_diff(fp32(ids, torch.arange(60), fp32.new_cache(60)), ref) > 0.01

    sinks = [layer.self_attn.sinks for layer in fp32.layers]
    for layer in fp32.layers:  # a sink of -inf takes nothing: plain softmax
        layer.self_attn.sinks = nn.Parameter(torch.full_like(layer.self_attn.sinks, float("-inf")))
    assert moved()
    for layer, sink in zip(fp32.layers, sinks):
        layer.self_attn.sinks = sink
    assert not moved()
    for layer in fp32.layers:
        layer.mlp.routing = Routing("softmax")
    assert moved()
    for layer in fp32.layers:
        layer.mlp.routing = Routing("softmax_over_chosen")
        for expert in layer.mlp.experts:  # gate and up as halves: the interleaved columns regrouped
            weight = expert.gate_up_proj.weight
            weight.data = torch.cat((weight[0::2], weight[1::2]))
    assert moved()


def _mxfp4_checkpoint(source, directory):
    """``source``'s gpt-oss checkpoint with its experts as the Hub stores them: MXFP4 (random
    4-bit values and power-of-two scales per 32 inputs, ``_blocks`` / ``_scales``) and a
    quantization_config saying so."""
    import json
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(source, directory)
    draw = torch.Generator().manual_seed(0)
    tensors = {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            tensor = f.get_tensor(key)
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                experts, inputs, outputs = tensor.shape
                tensors[f"{key}_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=draw,
                                                         dtype=torch.uint8)
                tensors[f"{key}_scales"] = torch.randint(121, 126, (experts, outputs, inputs // 32), generator=draw,
                                                         dtype=torch.uint8)
            else:
                tensors[key] = tensor
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def test_a_gpt_oss_config_without_its_swiglu_values_reads_those_older_transformers_hard_coded():
    """transformers 5.17 (a lent H100's) has no swiglu_alpha on GptOssConfig: 103 GPU tests
    errored loading the tiny gpt-oss (2026-12-06); its GptOssExperts used 1.702 and 7.0."""
    config = tiny_config("gpt_oss")
    config.swiglu_alpha, config.swiglu_limit = 1.5, 9.0
    assert ModelSpec.from_hf(config).clamped_swiglu == (1.5, 9.0)
    assert _gpt_oss(types.SimpleNamespace(swiglu_limit=9.0))["clamped_swiglu"] == (1.702, 9.0)
    assert _gpt_oss(types.SimpleNamespace())["clamped_swiglu"] == (1.702, 7.0)


def test_gpt_oss_mxfp4_experts_load_dequantized_as_transformers_loads_them(tiny_dir, tmp_path):
    """The Hub's gpt-oss checkpoints store the experts in MXFP4: each byte two 4-bit values (low
    nibble first), each 32 inputs a scale 2^(s - 127). They load dequantized to the model's dtype —
    an expert's weights as that formula gives them, bf16 logits equal to transformers' (which
    dequantizes them too on a CPU) to the bit; read as a stage, its own layers' stacks only."""
    path = _mxfp4_checkpoint(tiny_dir["gpt_oss"], tmp_path / "mxfp4")
    decoder = load_decoder(path, torch.bfloat16)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        blocks, scales = f.get_tensor("model.layers.2.mlp.experts.down_proj_blocks")[1], f.get_tensor(
            "model.layers.2.mlp.experts.down_proj_scales")[1]  # expert 1: [H, I / 32, 16], [H, I / 32]
    values = torch.tensor(FP4_VALUES)[torch.stack((blocks & 15, blocks >> 4), dim=-1).long()].flatten(-2)
    expected = (values * 2.0 ** (scales.float() - 127).unsqueeze(-1)).flatten(-2)  # [H, I]
    assert torch.equal(decoder.layers[2].mlp.experts[1].down_proj.weight, expected.bfloat16())
    torch.manual_seed(0)
    _bf16_equals_transformers(decoder, path, torch.randint(0, 300, (40,)), attention="eager")
    stage = load_decoder(path, torch.bfloat16, layer_range=(2, 4), embed=False, head=False)
    assert torch.equal(stage.layers[0].mlp.experts[1].down_proj.weight, expected.bfloat16())


def test_gpt_neox_equals_transformers_bitwise_in_bf16_and_reads_its_fused_per_head_qkv(tiny, tiny_dir, tmp_path):
    """GPT-NeoX (Pythia): q/k/v in one tensor laid out head by head (each head's q, k, v rows in
    turn; biases too), LayerNorms and a plain GELU MLP with biases, RoPE over the first quarter of
    each head, and attention and MLP side by side from two norms, added as (mlp + attn) + x.
    bf16 logits equal transformers' to the bit; the MLP from the first norm moves the fp32 ones;
    the sequential variant (use_parallel_residual false) matches too; the buffers old checkpoints
    saved (a causal mask, masked_bias, inv_freq) are skipped, and embed_out is the head."""
    import shutil

    from safetensors.torch import save_file

    path = tiny_dir["gpt_neox"]
    decoder = load_decoder(path, torch.bfloat16)
    attn = decoder.layers[1].self_attn
    assert decoder.spec.parallel_two_norms and decoder.inv_freq.numel() == 2 and decoder.spec.num_kv_heads == 4
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        qkv = f.get_tensor("gpt_neox.layers.1.attention.query_key_value.weight").bfloat16().unflatten(0, (4, 3, 16))
        bias = f.get_tensor("gpt_neox.layers.1.attention.query_key_value.bias").bfloat16().unflatten(0, (4, 3, 16))
        assert torch.equal(attn.k_proj.weight[16:32], qkv[1, 1]) and torch.equal(attn.v_proj.bias[48:], bias[3, 2])
        assert torch.equal(decoder.lm_head.weight, f.get_tensor("embed_out.weight").bfloat16())
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (40,))
    _bf16_equals_transformers(decoder, path, ids)
    fp32, ref = _fp32_parity(path, ids)
    for layer in fp32.layers:
        layer.post_attention_layernorm = layer.input_layernorm
    assert _max_rel_diff(fp32(ids, torch.arange(40), fp32.new_cache(40)), ref) > 0.01
    old = tmp_path / "old"  # as Pythia's first checkpoints were saved: with the attention's buffers
    shutil.copytree(path, old)
    buffers = {f"gpt_neox.layers.{i}.attention.{name}": torch.zeros(2) for i in range(4)
               for name in ("bias", "masked_bias", "rotary_emb.inv_freq")}
    save_file({**tensors, **buffers}, str(old / "model.safetensors"), metadata={"format": "pt"})
    assert torch.equal(load_decoder(old)(ids, torch.arange(40), fp32.new_cache(40)), tiny["gpt_neox"](
        ids, torch.arange(40), tiny["gpt_neox"].new_cache(40)))
    sequential = make_tiny_model(tmp_path / "seq", "gpt_neox", seed=44, init_std=0.2, norm_std=0.3, bias_std=0.1,
                                 use_parallel_residual=False)
    assert not load_decoder(sequential).spec.parallel_two_norms
    _fp32_parity(sequential, ids)
    _speculation_is_exact(load_decoder(sequential), tiny["gpt_neox-draft"])


def test_glm4_moe_routes_by_corrected_sigmoid_scores_within_groups_as_transformers_does(tiny, tiny_dir):
    """GLM-4.5 (glm4_moe): a dense first layer, then experts chosen by sigmoid scores plus a
    per-expert correction (the score correction, a float32 buffer) among the best group's experts
    only, weighed by the uncorrected scores renormalised and scaled (2.5), plus an ungated shared
    expert; the router kept in float32 as transformers keeps it. bf16 logits equal transformers'
    (its eager experts: its default grouped_mm kernel rounds otherwise) to the bit; the correction,
    the groups, the scale and the shared expert each count; int8 leaves the router alone."""
    from specctl.engine.moe import CorrectedRouter
    from specctl.engine.quant import quantize_decoder

    path = tiny_dir["glm4_moe"]
    decoder = load_decoder(path, torch.bfloat16)
    moe = decoder.layers[2].mlp
    assert decoder.spec.sparse_layers == (False, True, True, True) and not isinstance(decoder.layers[0].mlp, SparseMoE)
    assert moe.routing == Routing("sigmoid_grouped", True, 2, 1, 2.5) and moe.shared_expert_gate is None
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert decoder.layers[1].self_attn.q_proj.bias is not None and decoder.layers[1].self_attn.o_proj.bias is None
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        correction = f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias")
        assert torch.equal(moe.gate.e_score_correction_bias, correction) and correction.abs().min() > 0
        assert torch.equal(moe.shared_expert.up_proj.weight, f.get_tensor("model.layers.2.mlp.shared_experts.up_proj.weight").bfloat16())
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (40,))
    _bf16_equals_transformers(decoder, path, ids, experts_implementation="eager")
    fp32, ref = _fp32_parity(path, ids)

    def moved() -> bool:
        return _max_rel_diff(fp32(ids, torch.arange(40), fp32.new_cache(40)), ref) > 0.01

    sparse = [layer.mlp for layer in fp32.layers[1:]]
    for mlp in sparse:
        mlp.routing = Routing("sigmoid_grouped", True, 1, 1, 2.5)  # every group open
    assert moved()
    for mlp in sparse:
        mlp.routing = Routing("sigmoid_grouped", True, 2, 1, 1.0)  # unscaled
    assert moved()
    for mlp in sparse:
        mlp.routing = Routing("sigmoid_grouped", True, 2, 1, 2.5)
        mlp.gate.e_score_correction_bias.mul_(50.0)  # the correction decides the experts, not the weights
    assert moved()
    for mlp in sparse:
        mlp.gate.e_score_correction_bias.div_(50.0)
    assert not moved()
    for mlp in sparse:
        mlp.shared_expert = None
    assert moved()
    quantized = quantize_decoder(load_decoder(path), "int8")
    assert all(type(layer.mlp.gate) is CorrectedRouter for layer in quantized.layers[1:])


def test_deepseek_v3_s_latent_attention_equals_transformers_bitwise_in_bf16_with_keys_and_values_expanded(
        tiny, tiny_dir, tmp_path):
    """DeepSeek-V3 (Kimi K2, Moonlight): queries through a low-rank bottleneck, keys and values
    from one compressed latent per token plus a rotated key part every head shares, RoPE on
    neighbouring pairs put out as halves, values narrower (12) than keys (24). With the cache
    holding keys and values expanded and padded (``latent_cache=False``), attention reading the
    values at their width, bf16 logits equal transformers' (eager experts) to the bit; RoPE on
    halves instead moves the fp32 logits; DeepSeek-V2-Lite's single q_proj and YaRN's mscale on
    the scores match too (fp32, the default latent cache)."""
    path = tiny_dir["deepseek_v3"]
    decoder = load_decoder(path, torch.bfloat16, latent_cache=False)
    attn = decoder.layers[0].self_attn
    assert decoder.spec.latent_attention == (32, 16, 16, 8, 12) and decoder.spec.head_dim == 24
    assert decoder.spec.num_kv_heads == 4 and decoder.spec.kv_planes == 2 and not attn.absorbed
    assert attn.q_proj is None and attn.q_b_proj.weight.shape == (96, 32) and attn.kv_b_proj.weight.shape == (112, 16)
    assert decoder.spec.routing == "sigmoid_grouped" and decoder.spec.sparse_layers == (False, True, True, True)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (40,))
    _bf16_equals_transformers(decoder, path, ids, experts_implementation="eager")
    fp32, ref = _fp32_parity(path, ids)
    for layer in fp32.layers:
        layer.self_attn.deinterleave = False
    assert _max_rel_diff(fp32(ids, torch.arange(40), fp32.new_cache(40)), ref) > 0.01
    lite = make_tiny_model(tmp_path / "lite", "deepseek_v3", seed=49, init_std=0.2, norm_std=0.3, q_lora_rank=None)
    assert load_decoder(lite).layers[0].self_attn.q_proj.weight.shape == (96, 64)
    _fp32_parity(lite, ids)
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    scaled = make_tiny_model(tmp_path / "yarn", "deepseek_v3", seed=50, init_std=0.2, rope_parameters=yarn,
                             max_position_embeddings=640)
    assert load_decoder(scaled).spec.attn_scale == pytest.approx(24**-0.5 * (0.1 * math.log(40.0) + 1.0) ** 2)
    _fp32_parity(scaled, ids)
    _speculation_is_exact(load_decoder(scaled), tiny["deepseek_v3-draft"])
    _speculation_is_exact(load_decoder(scaled, latent_cache=False), load_decoder(tiny_dir["deepseek_v3-draft"],
                                                                                  latent_cache=False))


def test_latent_cache_holds_one_vector_a_token_and_layer_and_attends_as_transformers_by_absorption(tiny_dir):
    """The default latent cache (vLLM's MLA): a token's normed latent and rotated key part, one
    plane both keys and values read — 16 + 8 values a layer against 4 heads x (24 + 24) expanded
    (8x less); DeepSeek-V3's real shape: 70,272 bytes a token in bf16 (61 x 576 x 2) against
    6.0 MB. Attention absorbs kv_b_proj (the scores keep the heads' own 24 ** -0.5): fp32 logits
    within 1e-4 of transformers' prefilled and decoded step by step; bf16 near them, not their
    bits; a forward after a verification's rejected rows dropped (gather) equals a fresh one."""
    from specctl.bench.shapes import shape_config
    from specctl.config import build_config
    from specctl.spec.factory import load_named

    path = tiny_dir["deepseek_v3"]
    fp32 = load_decoder(path)
    spec = fp32.spec
    assert spec.latent_cache and spec.num_kv_heads == 1 and spec.head_dim == 24 and spec.kv_planes == 1
    assert spec.attn_scale == pytest.approx(24**-0.5) and fp32.layers[0].self_attn.absorbed
    expanded = load_decoder(path, latent_cache=False)
    assert fp32.kv_slot_bytes * 8 == expanded.kv_slot_bytes == 4 * 2 * 4 * 24 * 4
    cache = fp32.new_cache(40)
    assert cache.kv.shape == (4, 1, 1, 1, 48, 24) and cache.shared and cache.k.data_ptr() == cache.v.data_ptr()
    assert cache.nbytes == 48 * fp32.kv_slot_bytes
    for layout, latent in (("latent", True), ("expanded", False)):  # the configuration's mla_cache
        config = build_config("desktop", dtype="fp32", mla_cache=layout)
        assert load_named(str(path), config).decoder.spec.latent_cache is latent
    v3 = ModelSpec.from_hf(shape_config("deepseek-v3"))
    assert v3.kv_bytes_per_token(torch.bfloat16) == 70_272 == 61 * 576 * 2
    assert ModelSpec.from_hf(shape_config("deepseek-v3"), latent_cache=False).kv_bytes_per_token(torch.bfloat16) == (
        61 * 2 * 128 * 192 * 2)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (40,))
    _check_parity(path, ids, split=30)
    with torch.no_grad():
        fp32_ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids[None]).logits[0]
    bf16 = load_decoder(path, torch.bfloat16)
    logits = bf16(ids, torch.arange(40), bf16.new_cache(40))
    ref = _bf16_equals_transformers(load_decoder(path, torch.bfloat16, latent_cache=False), path, ids,
                                    experts_implementation="eager")
    # (this random model is chaotic in bf16: transformers' own bf16 logits are 0.62 of the largest off its fp32)
    assert not torch.equal(logits, ref) and _max_rel_diff(logits, fp32_ref) <= 1.25 * _max_rel_diff(ref, fp32_ref)
    # 30 tokens, then a tree a -> (b, c), c -> d whose path a, c, d is kept (c and d move a slot
    # back), then the step after them: as a fresh forward of the kept text
    cache = fp32.new_cache(40)
    fp32(ids[:30], torch.arange(30), cache)
    tree = torch.ones(4, 34, dtype=torch.bool)
    tree[:, 30:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    fp32(ids[30:34], torch.tensor([30, 31, 31, 32]), cache, tree)
    cache.gather(list(range(30)) + [30, 32, 33])
    after = fp32(ids[36:37], torch.tensor([33]), cache)
    kept = torch.cat((ids[:31], ids[32:34], ids[36:37]))
    assert _max_rel_diff(after, fp32(kept, torch.arange(34), fp32.new_cache(40))[-1:]) <= 1e-4


def test_llama4_chunks_attention_tunes_nope_queries_and_weighs_its_expert_s_input(tiny, tiny_dir):
    """Llama 4 (Scout, Maverick; text): RoPE on pairs as complex numbers in float32 then q/k RMS-
    normed without weight; RoPE layers attend within chunks of 16 positions, every 4th layer without
    RoPE over everything, its queries scaled by log1p(floor((p + 1) / 8)) * 0.1 + 1; odd layers
    route each token to its top expert, whose input the sigmoid of its logit weighs, beside a
    shared expert (dense layers 128 wide, experts 32). 60 tokens (four chunks): fp32 within 1e-4 of
    transformers' prefilled and step by step, bf16 to the bit; each departure taken away moves the
    logits. A tree whose path crosses a chunk boundary in a slot past its position attends as AR."""
    path = tiny_dir["llama4"]
    decoder = load_decoder(path, torch.bfloat16)
    spec = decoder.spec
    assert spec.layer_windows == (16, 16, 16, None) and spec.chunked_attention and spec.rope_layers == (True,) * 3 + (False,)
    assert spec.sparse_layers == (False, True, False, True) and spec.qk_l2_norm and spec.query_temperature == (0.1, 8)
    assert spec.intermediate_size == 128 and spec.expert_intermediate_size == 32 and not spec.gated_shared_expert
    moe = decoder.layers[1].mlp
    assert isinstance(moe, SparseMoE) and moe.routing.kind == "sigmoid_on_input" and moe.top_k == 1
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (60,))
    _bf16_equals_transformers(decoder, path, ids)
    _check_parity(path, ids, split=40)
    fp32, ref = _fp32_parity(path, ids)

    def moved() -> bool:
        return _max_rel_diff(fp32(ids, torch.arange(60), fp32.new_cache(60)), ref) > 0.01

    fp32.spec = dataclasses.replace(spec, chunked_attention=False)  # windows of 16 instead of chunks
    assert moved()
    fp32.spec = dataclasses.replace(spec, query_temperature=None)
    assert moved()
    fp32.spec = spec
    for layer in fp32.layers:
        layer.self_attn.qk_l2_eps = None
    assert moved()
    fp32 = load_decoder(path)
    for layer in fp32.layers[1::2]:
        layer.mlp.routing = Routing("softmax_over_chosen")  # the expert's output weighed (by 1: its softmax of one)
    assert moved()
    # 14 tokens, then a tree: x1, x2 at 14; y (child of x2) at 15 in slot 16; z at 16 (a new chunk) in slot
    # 17; w at 17: z and w must not see y (position 15, another chunk) though its slot is in theirs
    fp32 = load_decoder(path)
    cache = fp32.new_cache(32)
    fp32(ids[:14], torch.arange(14), cache)
    x1, x2, y, z, w = ids[20:25]
    tree = torch.ones(5, 19, dtype=torch.bool)
    tree[:, 14:] = torch.tensor([[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 1, 1, 1, 0],
                                 [0, 1, 1, 1, 1]], dtype=torch.bool)
    logits = fp32(torch.stack((x1, x2, y, z, w)), torch.tensor([14, 14, 15, 16, 17]), cache, tree)
    path_text = torch.cat((ids[:14], torch.stack((x2, y, z, w))))
    alone = fp32(path_text, torch.arange(18), fp32.new_cache(32))[14:]
    assert _max_rel_diff(logits[1:], alone) <= 1e-5
    _speculation_is_exact(tiny["llama4"], tiny["llama4-draft"])


def test_a_multimodal_llama4_checkpoint_serves_its_language_model(tmp_path):
    """Llama 4 ships as Llama4ForConditionalGeneration (text_config; the language model's tensors
    under language_model.model.*, its experts as stacks): decoded as that class's language model
    decodes text — bf16 logits to the bit (transformers 5.24's own text-only forward of the whole
    class fails, so its language_model is the reference) — with no vision tensor loaded."""
    from transformers import (
        Llama4Config,
        Llama4ForConditionalGeneration,
        Llama4VisionConfig,
    )

    from specctl.engine.tiny import make_byte_tokenizer

    vision = Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                projector_output_dim=64)
    config = Llama4Config(text_config=tiny_config("llama4_text", initializer_range=0.2).to_dict(),
                          vision_config=vision.to_dict(), image_token_index=300, boi_token_index=301,
                          eoi_token_index=302)
    torch.manual_seed(62)
    Llama4ForConditionalGeneration(config).save_pretrained(tmp_path / "mm")
    make_byte_tokenizer().save_pretrained(tmp_path / "mm")
    with safe_open(str(tmp_path / "mm" / "model.safetensors"), framework="pt") as f:
        assert "language_model.model.layers.1.feed_forward.experts.gate_up_proj" in f.keys()
        assert any(key.startswith("vision_model.") for key in f.keys())
    decoder = load_decoder(tmp_path / "mm", torch.bfloat16)
    assert decoder.spec.arch == "llama4_text" and not any("vision" in name for name in decoder.state_dict())
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0))
    whole = Llama4ForConditionalGeneration.from_pretrained(tmp_path / "mm", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = whole.language_model(input_ids=ids[None]).logits[0].float()
    assert torch.equal(decoder(ids, torch.arange(40), decoder.new_cache(40)), ref)


def test_phi2_s_parallel_layer_partial_rope_and_head_bias(tiny, tiny_dir):
    """Phi-1/1.5/2: one LayerNorm feeding attention (biases on q/k/v and its output projection,
    dense) and a plain gelu_new MLP (fc1, fc2) side by side, added as (attention + MLP) + x; RoPE
    on the first 40 % of each head (6 of 16 dims: 3 frequencies); the final LayerNorm
    (final_layernorm) and an LM head with a bias. bf16 logits equal transformers' to the bit;
    without the head's bias the logits move; the other sum order rounds otherwise in bf16;
    speculation is exact; per-head q/k LayerNorms are refused by name."""
    path = tiny_dir["phi"]
    decoder = load_decoder(path, torch.bfloat16)
    spec = decoder.spec
    assert spec.layer_norm and spec.parallel_residual and spec.parallel_branches_first and spec.head_bias
    assert spec.output_bias and spec.attention_bias and not spec.gated_mlp and spec.activation == "gelu_new"
    assert decoder.inv_freq.numel() == 3 and decoder.lm_head.bias is not None
    assert isinstance(decoder.layers[0].mlp, PlainMLP) and decoder.layers[0].self_attn.o_proj.bias is not None
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (40,))
    ref = _bf16_equals_transformers(decoder, path, ids)
    for layer in decoder.layers:
        layer.branches_first = False  # x + attention + MLP, Cohere's order
    assert not torch.equal(decoder(ids, torch.arange(40), decoder.new_cache(40)), ref)
    fp32, ref = _fp32_parity(path, ids)
    with torch.no_grad():
        fp32.lm_head.bias.zero_()
    assert _max_rel_diff(fp32(ids, torch.arange(40), fp32.new_cache(40)), ref) > 0.01
    _speculation_is_exact(tiny["phi"], tiny["phi-draft"])
    with pytest.raises(UnsupportedArchitecture, match="phi with qk_layernorm"):
        ModelSpec.from_hf(tiny_config("phi", qk_layernorm=True))


def test_deepseek_v2_routes_by_softmax_within_the_best_group_and_rotates_complex_pairs(tmp_path):
    """DeepSeek-V2 / V2-Lite / Coder-V2-Lite: V3's latent attention with RoPE applied to neighbouring
    pairs as complex numbers in float32 (left in place), and experts chosen by float32 softmax
    scores within the best group (group_limited_greedy), weighed by those scores times 2, never
    renormalised; the router kept float32, without V3's correction. bf16 logits equal
    transformers' (eager experts) to the bit with keys and values expanded; every group open moves the fp32 logits; speculation
    with its own first layers drafting is exact; int8 runs."""
    from specctl.engine.quant import quantize_decoder

    path = make_tiny_model(tmp_path / "v2", "deepseek_v2", seed=51, init_std=0.2, norm_std=0.3)
    decoder = load_decoder(path, torch.bfloat16, latent_cache=False)
    moe = decoder.layers[1].mlp
    assert moe.routing == Routing("softmax_grouped", False, 2, 1, 2.0) and not hasattr(moe.gate, "e_score_correction_bias")
    assert moe.gate.weight.dtype == torch.float32 and decoder.spec.rope_interleaved and decoder.spec.rope_in_float32
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (40,))
    _bf16_equals_transformers(decoder, path, ids, experts_implementation="eager")
    fp32, ref = _fp32_parity(path, ids)
    for layer in fp32.layers[1:]:
        layer.mlp.routing = Routing("softmax_grouped", False, 1, 1, 2.0)
    assert _max_rel_diff(fp32(ids, torch.arange(40), fp32.new_cache(40)), ref) > 0.01
    _speculation_is_exact(load_decoder(path), load_decoder(path, layer_range=(0, 2)))
    assert quantize_decoder(load_decoder(path), "int8")(ids, torch.arange(40), fp32.new_cache(40)).isfinite().all()
