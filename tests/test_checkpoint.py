"""How checkpoints lay their tensors out (engine.checkpoint): fine-grained FP8 weights — DeepSeek-V3's
and R1's, Qwen3's and GLM-4.5's -FP8 releases: e4m3 values, a float32 scale per 128 x 128
block — dequantized at load as transformers dequantizes them."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from specctl.engine.checkpoint import dequantize_fp8, fp8_block_size
from specctl.engine.loader import load_decoder
from specctl.errors import ModelNotFound

BLOCK = 32  # the tiny layers' 64 x 64 and 128 x 64 weights in whole blocks


def _fp8_checkpoint(source, directory, block: int = BLOCK, drop: str | None = None):
    """``source``'s checkpoint with each layer projection stored as e4m3 values and a float32 scale
    per ``block`` x ``block`` (amax / 448, as DeepSeek's quantizer picks it), and the
    quantization_config saying so; ``drop``: a stored tensor left out."""
    shutil.copytree(source, directory)
    tensors = {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            weight = f.get_tensor(key)
            if key.startswith("model.layers.") and key.endswith("proj.weight"):
                blocks = weight.float().unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [R, b, C, b]
                scale = blocks.abs().amax(dim=(1, 3)) / 448.0
                values = (blocks / scale[:, None, :, None]).flatten(2, 3).flatten(0, 1)
                tensors[key], tensors[f"{key}_scale_inv"] = values.to(torch.float8_e4m3fn), scale
            else:
                tensors[key] = weight
    tensors.pop(drop, None)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [block, block]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_fp8_weights_load_dequantized_as_transformers_loads_them(tiny_dir, tmp_path):
    """Each block's e4m3 values times its scale, the product in float32 then cast: the loaded
    weights and bf16 logits equal transformers' (which dequantizes FP8 on a CPU) to the bit, fp32
    too; a pipeline stage reads its own layers' pairs."""
    path = _fp8_checkpoint(tiny_dir["llama"], tmp_path / "fp8")
    decoder = load_decoder(path, torch.bfloat16)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        values, scale = f.get_tensor("model.layers.1.mlp.up_proj.weight"), f.get_tensor(
            "model.layers.1.mlp.up_proj.weight_scale_inv")  # [128, 64] e4m3, [4, 2]
    expected = (values.float() * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)).bfloat16()
    assert values.dtype == torch.float8_e4m3fn and torch.equal(decoder.layers[1].mlp.up_proj.weight, expected)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (24,))
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        assert torch.equal(decoder(ids, torch.arange(24), decoder.new_cache(24)), reference(ids[None]).logits[0].float())
        fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(load_decoder(path).layers[2].self_attn.o_proj.weight, fp32.model.layers[2].self_attn.o_proj.weight)
    stage = load_decoder(path, torch.bfloat16, layer_range=(1, 3), embed=False, head=False)
    assert torch.equal(stage.layers[0].mlp.up_proj.weight, expected)


def test_fp8_block_size_reads_the_quantization_config_and_partial_blocks_are_covered():
    class Config:
        quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}

    assert fp8_block_size(Config) == [128, 128] and fp8_block_size(object()) is False
    weight = torch.ones(3, 5).to(torch.float8_e4m3fn)  # a 2 x 2 block grid over 3 x 5: the last blocks partial
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert dequantize_fp8(weight, scale, [2, 4], torch.float32).tolist() == [[1, 1, 1, 1, 2]] * 2 + [[3, 3, 3, 3, 4]]
    assert dequantize_fp8(weight, torch.tensor(0.5), None, torch.float32).tolist() == [[0.5] * 5] * 3


def test_an_fp8_weight_without_its_scale_is_refused_by_name(tiny_dir, tmp_path):
    path = _fp8_checkpoint(tiny_dir["llama"], tmp_path / "fp8", drop="model.layers.0.self_attn.k_proj.weight_scale_inv")
    with pytest.raises(ModelNotFound, match=r"quantized tensors without their other part: \['model.layers.0.self_attn."
                                            r"k_proj.weight'\]"):
        load_decoder(path)
