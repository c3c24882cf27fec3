"""specctl's decoder against transformers on the same weights (fp32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specctl.engine.loader import load_decoder
from specctl.errors import UnsupportedArchitecture
from specctl.store import resolve_model
from tests.conftest import needs_smollm


def _max_rel_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def _check_parity(path, ids: torch.Tensor, split: int):
    # eager: the reference math whatever transformers' default (5.17's SDPA drops Gemma 2's soft-capping)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    decoder = load_decoder(path)
    cache = decoder.new_cache(ids.numel() + 4)
    prefill = decoder(ids[:split], torch.arange(split), cache)
    steps = [decoder(ids[i : i + 1], torch.tensor([i]), cache) for i in range(split, ids.numel())]
    assert _max_rel_diff(prefill, ref[:split]) <= 1e-4
    assert _max_rel_diff(torch.cat(steps), ref[split:]) <= 1e-4
    assert cache.length == ids.numel()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe",
                                  "mixtral", "granite", "olmo2", "olmo3", "starcoder2", "smollm3", "glm4", "exaone4",
                                  "cohere2", "gpt_oss", "gpt_neox", "glm4_moe", "deepseek_v3", "llama4", "phi"])
def test_tiny_parity_prefill_and_incremental(tiny_dir, arch):
    torch.manual_seed(0)
    _check_parity(tiny_dir[arch], torch.randint(0, 300, (24,)), split=17)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64, "rope_theta": 500000.0},  # Llama 3.1-3.3's
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
], ids=lambda rope: rope["rope_type"])
def test_scaled_rope_checkpoints_load_and_match_transformers(tmp_path, rope):
    """RoPE scaling (Llama 3.x's llama3, yarn with its attention factor, linear): these loaded
    with a "Cannot copy out of meta tensor" until the frequencies were computed off the meta
    device the decoder is built on; 160 tokens, past llama3's and yarn's original 64 and 128."""
    from specctl.engine.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama", seed=1, rope_parameters=rope)
    torch.manual_seed(0)
    _check_parity(path, torch.randint(0, 300, (160,)), split=150)


def test_longrope_decodes_as_transformers_up_to_its_original_context_and_stops_there(tmp_path):
    """longrope's frequencies switch to the long factors once a sequence passes the original
    context (transformers, one token past: logits differ); the engine's are fixed, so its
    context is the original one."""
    from specctl.engine.tiny import make_tiny_model

    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7], "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    path = make_tiny_model(tmp_path / "m", "llama", seed=1, rope_parameters=rope)
    torch.manual_seed(0)
    _check_parity(path, torch.randint(0, 300, (64,)), split=50)
    decoder = load_decoder(path)
    assert decoder.spec.max_position == 64
    ids = torch.randint(0, 300, (65,))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids[None]).logits[0]
    assert _max_rel_diff(decoder(ids, torch.arange(65), decoder.new_cache(65)), ref) > 0.01


def test_a_checkpoint_tensor_the_decoder_would_not_use_is_refused_by_name(tiny_dir, tmp_path):
    """A tensor of the loaded layers that the decoder has no place for means a variant it does
    not run: refused, never dropped. Other layers' tensors (a pipeline stage's neighbours) and
    old checkpoints' RoPE buffers are not the load's business."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_dir["llama"], tmp_path / "m")
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    state["model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    state["model.layers.3.mlp.down_proj.bias"] = torch.zeros(64)
    save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    stage = load_decoder(tmp_path / "m", layer_range=(0, 2), embed=True, head=False)  # layer 3 is another stage's
    assert stage.num_layers == 2
    with pytest.raises(UnsupportedArchitecture, match=r"holds tensors specctl's llama decoder does not use: "
                                                      r"\['model.layers.3.mlp.down_proj.bias'\] — a variant"):
        load_decoder(tmp_path / "m")


@pytest.mark.slow  # 31 s on a slow 2-core machine; the tiny models' parity stays in the default run
@needs_smollm
def test_smollm2_parity():
    torch.manual_seed(0)
    _check_parity(resolve_model("smollm2-135m"), torch.randint(0, 49152, (20,)), split=14)


def test_tree_forward_equals_per_branch_forwards(tiny):
    """A two-branch tree verified in one forward gives each branch the logits it would get alone."""
    decoder = tiny["llama"]
    prefix = torch.tensor([5, 9, 13, 2])
    # Tree under the last prefix token: a=[40] -> [41]; b=[50]
    tokens = torch.tensor([40, 41, 50])
    depth = torch.tensor([1, 2, 1])
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    cache = decoder.new_cache(16)
    decoder(prefix, torch.arange(4), cache)
    mask = torch.cat([torch.ones(3, 4, dtype=torch.bool), tree_mask], 1)
    tree_logits = decoder(tokens, 3 + depth, cache, mask=mask)
    for rows, branch in (([0, 1], [40, 41]), ([2], [50])):
        ref_cache = decoder.new_cache(16)
        ref = decoder(torch.tensor(prefix.tolist() + branch), torch.arange(4 + len(branch)), ref_cache)[4:]
        torch.testing.assert_close(tree_logits[rows], ref, rtol=1e-5, atol=1e-5)


def test_layer_range_loads_only_its_layers(tiny_dir):
    full = load_decoder(tiny_dir["llama"])
    first = load_decoder(tiny_dir["llama"], layer_range=(0, 2), head=False)
    last = load_decoder(tiny_dir["llama"], layer_range=(2, 4), embed=False)
    assert first.num_layers == 2 and last.num_layers == 2
    assert first.lm_head is None and last.embed_tokens is None
    ids = torch.tensor([1, 2, 3, 4, 5])
    hidden = first(ids, torch.arange(5), first.new_cache(8))
    split_logits = last(hidden, torch.arange(5), last.new_cache(8))
    torch.testing.assert_close(split_logits, full(ids, torch.arange(5), full.new_cache(8)), rtol=1e-5, atol=1e-5)


def test_bad_layer_range_is_refused(tiny_dir):
    with pytest.raises(ValueError, match=r"layer range \[2, 9\) outside the model's 4 layers"):
        load_decoder(tiny_dir["llama"], layer_range=(2, 9))


def test_an_emulated_step_floor_pads_every_forward_and_changes_no_logit(tiny, monkeypatch):
    """`draft --step-time-ms`: each forward (one session or several) sleeps the rest of the floor
    after its compute; with the floor off nothing sleeps; the logits are the same either way."""
    from specctl.runtime import compute

    decoder = tiny["llama"]
    slept: list[float] = []
    monkeypatch.setattr(compute.time, "sleep", slept.append)
    prompt = torch.tensor([5, 9, 13, 2])

    def run() -> list[torch.Tensor]:
        caches = [decoder.new_cache(16), decoder.new_cache(16)]
        one = decoder(prompt, torch.arange(4), caches[0])
        many = decoder.forward_many([torch.tensor([7]), torch.tensor([3, 4])], [torch.tensor([4]), torch.arange(2)],
                                    caches, [None, None], [torch.tensor([0]), torch.tensor([1])])
        return [one, *many]

    plain = run()
    assert slept == []
    decoder.step_floor_s = 30.0
    try:
        floored = run()
    finally:
        decoder.step_floor_s = 0.0
    assert len(slept) == 2 and all(0 < s <= 30.0 for s in slept)  # one per forward, the compute inside the floor
    for a, b in zip(plain, floored):
        assert torch.equal(a, b)


def test_an_emulated_step_floor_pads_static_steps_too(tiny_dir, monkeypatch):
    """The floor also pads a step that runs padded to a bucket (engine.static: CUDA graphs on a GPU)."""
    from specctl.runtime import compute

    decoder = load_decoder(tiny_dir["qwen2"]).use_static_steps(graphs=False)
    slept: list[float] = []
    monkeypatch.setattr(compute.time, "sleep", slept.append)
    cache = decoder.new_cache(16)
    decoder(torch.tensor([5, 9, 13, 2]), torch.arange(4), cache)
    assert slept == []
    decoder.step_floor_s = 30.0
    decoder(torch.tensor([7]), torch.tensor([4]), cache)
    assert len(slept) == 1 and 0 < slept[0] <= 30.0


def test_a_batch_of_sessions_replayed_one_step_each_equals_each_alone_under_one_floor(tiny_dir, monkeypatch):
    """Where static steps are graph replays (CUDA), a forward of 2-8 sessions runs as one step
    per session: each session's logits are exactly its forward alone, and an emulated step
    floor pads the batch once, as it pads one forward of it. (On the CPU steps are not replays:
    the switch is set by hand here.)"""
    from specctl.engine.static import REPLAY_PER_SESSION_UP_TO
    from specctl.runtime import compute

    decoder = load_decoder(tiny_dir["qwen2"]).use_static_steps(graphs=False)
    assert not decoder.static.per_session and not decoder.static.replays_each(2)
    decoder.static.per_session = True
    assert [decoder.static.replays_each(n) for n in (1, 2, REPLAY_PER_SESSION_UP_TO, REPLAY_PER_SESSION_UP_TO + 1)] == [
        False, True, True, False]
    prompts = [[5, 9, 13, 2], [7, 8], [100, 3, 4, 5, 6, 7]]
    tree_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # two new tokens, the second masked off the first

    def batch(caches):
        return decoder.forward_many([torch.tensor([11]), torch.tensor([12, 13]), torch.tensor([14, 15])],
                                    [torch.tensor([4]), torch.tensor([2, 3]), torch.tensor([6, 6])],
                                    caches, [None, None, torch.cat([torch.ones(2, 4, dtype=torch.bool), tree_mask], 1)],
                                    [torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([1])])

    def fresh():
        caches = [decoder.new_cache(32) for _ in prompts]
        for prompt, cache in zip(prompts, caches):
            decoder(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        return caches

    together = batch(fresh())
    alone_caches = fresh()
    alone = [decoder(torch.tensor([11]), torch.tensor([4]), alone_caches[0], logits_at=torch.tensor([0])),
             decoder(torch.tensor([12, 13]), torch.tensor([2, 3]), alone_caches[1], logits_at=torch.tensor([0, 1])),
             decoder(torch.tensor([14, 15]), torch.tensor([6, 6]), alone_caches[2],
                     mask=torch.cat([torch.ones(2, 4, dtype=torch.bool), tree_mask], 1), logits_at=torch.tensor([1]))]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    caches = fresh()
    slept: list[float] = []
    monkeypatch.setattr(compute.time, "sleep", slept.append)
    decoder.step_floor_s = 30.0
    try:
        floored = batch(caches)
    finally:
        decoder.step_floor_s = 0.0
    assert len(slept) == 1 and 0 < slept[0] <= 30.0
    assert all(torch.equal(a, b) for a, b in zip(floored, alone))
