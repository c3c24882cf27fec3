"""Packed linear weights (engine.packed): reordered once at load for oneDNN, the same products
as F.linear to rounding, and row-exact targets built on them still reproduce AR bit for bit."""

import pytest
import torch
from torch import nn

from specctl.config import Config
from specctl.engine import packed
from specctl.engine.loader import load_decoder
from specctl.engine.packed import PackedLinear, pack, pack_linears
from specctl.engine.rows import PaddedRowLinear, make_row_exact, pad_small_products
from specctl.errors import ConfigError
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter
from specctl.spec.factory import load_named
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate

needs_packing = pytest.mark.skipif(not packed.candidate("cpu", "bf16", "none"),
                                   reason="this CPU's oneDNN has no native bf16 kernels: nothing packs")


@pytest.mark.parametrize("device, dtype, quant", [
    ("cpu", "fp32", "none"), ("cpu", "fp16", "none"), ("cpu", "bf16", "int8"), ("cuda", "bf16", "none"),
    ("cuda:1", "bf16", "none"),
])
def test_only_unquantized_bf16_on_the_cpu_packs(device, dtype, quant):
    assert packed.candidate(device, dtype, quant) is False


def test_bf16_on_the_cpu_packs_where_onednn_has_bf16_kernels():
    assert packed.candidate("cpu", "bf16", "none") is torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_the_config_switch_is_a_boolean():
    assert Config().packed_weights is True
    with pytest.raises(ConfigError, match="packed_weights must be true or false, got 'yes'"):
        Config(packed_weights="yes")


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_keeps_its_weight_and_bias_and_computes_the_same_product(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=bias).to(torch.bfloat16).requires_grad_(False)
    layer = pack(linear)
    assert type(layer) is PackedLinear and layer.weight.is_mkldnn and (layer.min_rows, layer.max_rows) == (1, None)
    assert torch.equal(layer.weight.to_dense(), linear.weight)
    assert layer.bias is linear.bias  # shared, not copied
    x = torch.randn(2, 3, 48, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
        assert out.shape == (2, 3, 40) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out, linear(x))  # the same product, to bf16 rounding


@needs_packing
def test_packing_replaces_plain_bf16_linears_but_not_ones_read_as_tensors():
    torch.manual_seed(0)
    model = nn.ModuleDict({"q_proj": nn.Linear(8, 8), "kv_b_proj": nn.Linear(8, 16), "norm": nn.LayerNorm(8),
                           "fp32": nn.Linear(8, 8)}).requires_grad_(False)
    for name in ("q_proj", "kv_b_proj", "norm"):
        model[name].to(torch.bfloat16)
    assert pack_linears(model) == 1
    assert [type(m) for m in model.values()] == [PackedLinear, nn.Linear, nn.LayerNorm, nn.Linear]


@needs_packing
def test_row_padding_and_blocks_reach_packed_layers_and_their_products_keep_their_bits():
    """pad_small_products gives a packed layer the probe's counts as it does a plain one; a
    product of 65 rows is then blocks of 32, 32 and 1 padded to 2, each row the same bits as in
    its block alone."""
    torch.manual_seed(0)
    model = nn.Sequential(pack(nn.Linear(64, 96).to(torch.bfloat16).requires_grad_(False)),
                          nn.Linear(96, 8).to(torch.bfloat16).requires_grad_(False))
    pad_small_products(model, 2, 32)
    assert type(model[0]) is PackedLinear and type(model[1]) is PaddedRowLinear
    assert [(m.min_rows, m.max_rows) for m in model] == [(2, 32), (2, 32)]
    x = torch.randn(65, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = model[0](x)
        assert torch.equal(out[:32], model[0](x[:32])) and torch.equal(out[32:64], model[0](x[32:64]))
        assert torch.equal(out[64:], model[0](x[64:]))  # padded to 2 rows alone too


def _packed_row_exact_target(tiny_dir, arch: str):
    target = load_decoder(tiny_dir[arch], dtype=torch.bfloat16)
    assert pack_linears(target) > 0
    if not make_row_exact(target, "none"):
        pytest.skip("packed bf16 products are not row-independent on this CPU: row-exact attention stays off")
    return target


@needs_packing
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "deepseek_v3", "phi", "qwen3_moe"])
def test_speculative_output_of_a_packed_bf16_target_equals_the_target_alone(tiny_dir, tiny, arch):
    target = _packed_row_exact_target(tiny_dir, arch)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    draft = tiny[f"{arch}-draft"]
    for prompt in ([7, 8, 9, 10] * 5, list(range(30, 60))):
        reference, _, _ = generate(target, prompt, params)
        for name, drafter in {"chain": ModelChainDrafter(draft, 4), "tree": ModelTreeDrafter(draft, 3, 2, 3)}.items():
            assert generate(target, prompt, params, drafter)[0] == reference, f"{name} diverged on {prompt}"


@needs_packing
def test_a_packed_target_decodes_as_the_unpacked_one_to_rounding(tiny_dir):
    """The same greedy text where no near-tie decides it: packing changes a product's last bits
    at most (oneDNN's blocked layout sums in another order)."""
    plain = load_decoder(tiny_dir["llama"], dtype=torch.bfloat16)
    packed_target = load_decoder(tiny_dir["llama"], dtype=torch.bfloat16)
    pack_linears(packed_target)
    with torch.inference_mode():
        cache_plain, cache_packed = plain.new_cache(32), packed_target.new_cache(32)
        prompt = torch.tensor([5, 9, 14, 3, 77, 21, 8])
        logits_plain = plain(prompt, torch.arange(7), cache_plain)
        logits_packed = packed_target(prompt, torch.arange(7), cache_packed)
    torch.testing.assert_close(logits_packed, logits_plain, atol=0.05, rtol=0.05)


@needs_packing
@pytest.mark.parametrize("packed_weights", [True, False])
def test_load_named_packs_a_bf16_target_and_draft_unless_configured_off(tiny_dir, packed_weights):
    config = Config(dtype="bf16", packed_weights=packed_weights)
    target = load_named(str(tiny_dir["llama"]), config, target=True).decoder
    draft = load_named(str(tiny_dir["llama-draft"]), config).decoder
    target_layers = (target.layers[0].mlp.down_proj, target.layers[0].self_attn.q_proj, target.lm_head)
    assert all(isinstance(layer, PackedLinear) is packed_weights for layer in target_layers)
    assert type(draft.layers[0].mlp.down_proj) is (PackedLinear if packed_weights else nn.Linear)
