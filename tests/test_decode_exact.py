"""Greedy exactness of every mode against the target alone, on tiny random models (fp32)."""

import pytest
import torch

from specctl.engine.kv_cache import KVPool
from specctl.errors import KVBudgetExceeded, PromptTooLong
from specctl.spec.decode import DecodeSession
from specctl.spec.rounds import InlineLane, LocalSpeculator, generate, run_inline, run_session
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.params import SamplingParams
from tests.conftest import TINY_ARCHS


def _prompts(seed: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        length = int(torch.randint(1, 40, (1,), generator=gen))
        prompts.append(torch.randint(0, 256, (length,), generator=gen).tolist())
    # Repetitive text, where n-gram lookup hits.
    prompts.append([7, 8, 9, 10] * 6)
    return prompts


def _drafters(tiny, arch):
    return {
        "chain/disagreeing": ModelChainDrafter(tiny[f"{arch}-draft"], 4),
        "chain/self-prefix": ModelChainDrafter(tiny[f"{arch}-self2"], 3),
        "chain/identical": ModelChainDrafter(tiny[arch], 5),
        "tree/disagreeing": ModelTreeDrafter(tiny[f"{arch}-draft"], 3, 2, 3),
        "tree/self-prefix": ModelTreeDrafter(tiny[f"{arch}-self2"], 4, 3, 4),
        "tree/identical": ModelTreeDrafter(tiny[arch], 4, 2, 2),
        "ngram": NgramDrafter(4),
    }


@pytest.mark.parametrize("arch, seed", [(arch, seed) for arch in ("llama", "qwen2") for seed in (0, 1, 2)] + [("qwen3", 0), ("phi3", 0), ("gemma2", 0), ("gemma3", 0), ("qwen2_moe", 0), ("qwen3_moe", 0),
                                                          ("mixtral", 0), ("olmo2", 0), ("olmo3", 0),
                                                          ("starcoder2", 0), ("smollm3", 0), ("glm4", 0),
                                                          ("exaone4", 0), ("cohere2", 0), ("gpt_oss", 0), ("gpt_neox", 0),
                                                          ("glm4_moe", 0), ("deepseek_v3", 0), ("llama4", 0),
                                                          ("granite", 0)])
def test_greedy_output_equals_target_alone(tiny, arch, seed):
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for prompt in _prompts(seed, 3):
        reference, _, _ = generate(tiny[arch], prompt, params)
        assert len(reference) == 32
        for name, drafter in _drafters(tiny, arch).items():
            output, stats, reason = generate(tiny[arch], prompt, params, drafter)
            assert output == reference, f"{name} diverged on prompt {prompt}"
            assert reason == "length"


def test_every_tiny_target_writes_varied_text_so_that_equal_outputs_mean_something(tiny):
    """A random checkpoint can collapse into one token repeated (found twice: a tied Gemma 2, a
    StarCoder2 with large drawn biases: 2 distinct tokens in 32), and then every mode equals the
    target by default. Each family's tiny target writes at least 8 distinct tokens in 32 on one
    of these prompts (measured: 8-26)."""
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for name in TINY_ARCHS:  # targets: drafts and layer prefixes need to disagree, not to vary
        decoder = tiny[name]
        prompts = ([7, 8, 9, 10] * 5, list(range(30, 60)), [1, 2, 3])
        assert max(len(set(generate(decoder, prompt, params)[0])) for prompt in prompts) >= 8, name


def test_identical_draft_accepts_everything(tiny):
    params = SamplingParams(max_tokens=21, ignore_eos=True)
    _, stats, _ = generate(tiny["llama"], [1, 2, 3], params, ModelChainDrafter(tiny["llama"], 4))
    # 1 token from the prefill, then 4 rounds of 4 accepted + 1 bonus.
    assert stats.rounds == 4 and stats.accepted == 16 and stats.mean_accepted_length == 5.0
    assert stats.acceptance_rate == 1.0 and stats.accepted_per_pos == [4, 4, 4, 4]


def test_stop_tokens_end_the_stream_without_emitting_them(tiny):
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    reference, _, _ = generate(tiny["llama"], [5, 6, 7], params)
    stop = reference[5]
    first = reference.index(stop)
    stopped = SamplingParams(max_tokens=32, stop_token_ids=(stop,))
    for drafter in (None, ModelTreeDrafter(tiny["llama-self2"], 3, 2, 2)):
        output, _, reason = generate(tiny["llama"], [5, 6, 7], stopped, drafter)
        assert output == reference[:first] and reason == "stop"


def test_session_state_is_freed(tiny):
    pool, draft_pool = KVPool(), KVPool()
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for drafter in (ModelChainDrafter(tiny["llama-draft"], 3), ModelTreeDrafter(tiny["llama-draft"], 3, 2, 2)):
        generate(tiny["llama"], [1, 2, 3], params, drafter, pool=pool, draft_pool=draft_pool)
        assert pool.used_bytes == 0 and draft_pool.used_bytes == 0 and pool.sessions == 0
    # A session that fails half-way (here: its emit raises) frees its state too.
    class Stop(Exception):
        pass

    def emit(tokens, result):
        assert pool.sessions == 1 and draft_pool.sessions == (1 if result is not None else 0)
        if result is not None:
            raise Stop

    lane = InlineLane()
    speculator = LocalSpeculator(ModelChainDrafter(tiny["llama-draft"], 3), lane, draft_pool)
    session = DecodeSession(tiny["llama"], [1, 2, 3], params, pool=pool, max_nodes=speculator.max_nodes)
    with pytest.raises(Stop):
        run_inline(run_session(session, speculator, lane, emit))
    assert pool.used_bytes == 0 and draft_pool.used_bytes == 0 and pool.sessions == 0 and draft_pool.sessions == 0


def test_budget_refuses_a_session_and_frees_the_target_reservation(tiny):
    pool, draft_pool = KVPool(), KVPool(budget_bytes=1)
    with pytest.raises(KVBudgetExceeded):
        generate(tiny["llama"], [1, 2], SamplingParams(), ModelChainDrafter(tiny["llama-draft"], 3), pool=pool,
                 draft_pool=draft_pool)
    assert pool.used_bytes == 0 and pool.sessions == 0


def test_prompt_longer_than_context_is_refused(tiny):
    with pytest.raises(PromptTooLong) as err:
        DecodeSession(tiny["llama"], [1] * 500, SamplingParams(max_tokens=20))
    assert str(err.value) == (
        "prompt of 500 tokens plus max_tokens 20 exceeds the context of 512 tokens; shorten the prompt or lower max_tokens"
    )
    with pytest.raises(PromptTooLong, match="the prompt is empty"):
        DecodeSession(tiny["llama"], [], SamplingParams())


def test_int8_quantized_draft_stays_exact(tiny_dir, tiny):
    from specctl.engine.loader import load_decoder
    from specctl.engine.quant import quantize_decoder

    draft = quantize_decoder(load_decoder(tiny_dir["llama"], layer_range=(0, 3)), "int8")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in _prompts(5, 3):
        reference, _, _ = generate(tiny["llama"], prompt, params)
        for drafter in (ModelChainDrafter(draft, 4), ModelTreeDrafter(draft, 3, 2, 3)):
            assert generate(tiny["llama"], prompt, params, drafter)[0] == reference


@pytest.mark.parametrize("sampled", [False, True])
def test_adaptive_depth_stays_exact_and_drafts_less(tiny, sampled):
    """Stopping a proposal early (the draft unsure of its path) changes what drafting costs,
    never what is accepted: greedy output equals the target alone."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8 if sampled else 0.0, seed=3)
    draft = tiny["llama-self2"]
    for full, adaptive in ((ModelChainDrafter(draft, 6), ModelChainDrafter(draft, 6, stop=0.3)),
                           (ModelTreeDrafter(draft, 5, 2, 3), ModelTreeDrafter(draft, 5, 2, 3, stop=0.3))):
        for prompt in _prompts(11, 3):
            _, full_stats, _ = generate(tiny["llama"], prompt, params, full)
            out, stats, _ = generate(tiny["llama"], prompt, params, adaptive)
            if not sampled:
                assert out == generate(tiny["llama"], prompt, params)[0]
            assert stats.drafted / stats.drafts < full_stats.drafted / full_stats.drafts
