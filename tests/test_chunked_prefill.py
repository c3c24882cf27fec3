"""Chunked prefill (spec.decode.DecodeSession.prefill_step): a prompt's prefill in jobs of
``prefill_chunk`` tokens, so other sessions' rounds run between them — with the whole
prefill's output in every mode, and the chunk size resolved from the configuration."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

from specctl.config import ConfigError, build_config
from specctl.engine.prefill_jobs import GRAIN, job_rows, key_cost
from specctl.runtime.compute import ComputeThread
from specctl.spec.batch_drafting import prefill_step
from specctl.spec.decode import DecodeSession
from specctl.spec.drafters import ModelChainDrafter, NoDrafter
from specctl.spec.factory import prefill_chunk
from tests.conftest import mode_drafter
from specctl.spec.rounds import LocalSpeculator, generate, run_session
from specctl.spec.params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture
def chunked(tiny):
    """The tiny llama target and draft, the target prefilling 8 tokens a job (this test only)."""
    target, draft = tiny["llama"], tiny["llama-draft"]
    target.prefill_chunk = 8
    yield target, draft
    target.prefill_chunk = 0


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _whole(target, prompt, params=GREEDY, drafter=None):
    chunk, target.prefill_chunk = target.prefill_chunk, 0
    try:
        return generate(target, prompt, params, drafter)[0]
    finally:
        target.prefill_chunk = chunk


def test_a_prompt_is_prefilled_a_chunk_a_step_and_the_first_token_comes_with_the_last(chunked):
    target, _ = chunked
    prompt = _prompt(1, 37)
    session = DecodeSession(target, prompt, GREEDY)
    steps = []
    while (first := session.prefill_step()) is None:
        steps.append(session.prefilled)
    assert steps == [8, 16, 24, 32] and session.prefilled == 37 and session.cache.length == 37
    assert first == _whole(target, prompt)[:1]
    session.close()


@pytest.mark.parametrize("mode", ["ar", "chain", "tree", "ngram"])
def test_every_mode_gives_the_whole_prefill_s_output(chunked, mode):
    target, draft = chunked
    drafter = mode_drafter(mode, draft)
    prompt = _prompt(2, 45)
    assert generate(target, prompt, GREEDY, drafter)[0] == _whole(target, prompt)


def test_sampled_output_is_the_seeded_whole_prefill_s(chunked):
    target, draft = chunked
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    prompt = _prompt(3, 30)
    drafter = ModelChainDrafter(draft, 3)  # seeded sampling draws the same numbers in the same mode
    assert generate(target, prompt, params, drafter)[0] == _whole(target, prompt, params, drafter)


def test_logits_after_a_chunked_prefill_are_the_whole_prefill_s(chunked):
    target, _ = chunked
    prompt = _prompt(4, 40)
    chunked_cache = target.new_cache(48)
    for start in range(0, 40, 8):
        logits = target(torch.tensor(prompt[start:start + 8]), torch.arange(start, start + 8), chunked_cache)
    whole = target(torch.tensor(prompt), torch.arange(40), target.new_cache(48))
    torch.testing.assert_close(logits[-1], whole[-1], atol=1e-5, rtol=0)


def test_a_restored_prefix_is_followed_by_chunks_of_the_rest(chunked):
    target, _ = chunked
    target.use_prefix_cache(16 << 20)
    try:
        system = _prompt(5, 20)
        generate(target, system + _prompt(6, 3), GREEDY)
        prompt = system + _prompt(7, 17)
        session = DecodeSession(target, prompt, GREEDY)
        steps = []
        while session.prefill_step() is None:
            steps.append(session.prefilled)
        assert session.stats.cached_prompt_tokens == 20 and steps == [28, 36]
        session.close()
        assert generate(target, prompt, GREEDY)[0] == _whole(target, prompt)
    finally:
        target.prefix_cache = None


@pytest.mark.parametrize("chunk, interleaved", [(0, False), (8, True)])
async def test_a_long_prompt_lets_a_running_session_take_rounds_between_its_chunks(tiny, chunk, interleaved):
    """Two sessions on one compute thread: while the second's 64-token prompt is prefilled,
    the first (already decoding) gets rounds between the chunks; whole, it waits for all of it."""
    target = tiny["llama"]
    lane = ComputeThread("test-compute").lane(owns_thread=True)
    events: list[str] = []
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    running = DecodeSession(target, _prompt(8, 10), params)
    arriving = DecodeSession(target, _prompt(9, 64), SamplingParams(max_tokens=4, ignore_eos=True))
    step = arriving.prefill_step

    def logged_step():
        events.append("chunk")
        return step()

    arriving.prefill_step = logged_step
    accept = running.accept

    def logged_accept(*args):  # on the compute thread, as the chunks: the order they ran in
        events.append("round")
        return accept(*args)

    running.accept = logged_accept
    target.prefill_chunk = chunk
    try:
        first = asyncio.ensure_future(run_session(running, LocalSpeculator(NoDrafter(), lane), lane,
                                                  lambda tokens, result: None))
        while events.count("round") < 3:  # the first session is decoding
            await asyncio.sleep(0.001)
        await run_session(arriving, LocalSpeculator(NoDrafter(), lane), lane, lambda tokens, result: None)
        await first
    finally:
        target.prefill_chunk = 0
        lane.stop()
    during = events[events.index("chunk"):len(events) - events[::-1].index("chunk")]
    assert during.count("chunk") == (8 if chunk else 1)
    assert (during.count("round") > 0) == interleaved
    assert running.output == _whole(target, _prompt(8, 10), params)
    assert arriving.output == _whole(target, _prompt(9, 64), SamplingParams(max_tokens=4, ignore_eos=True))


# left for the first proposal's catch-up: at most a job (it reads the last token's logits); with a key
# cost the jobs shrink as the target's do (64 tokens, then 32 from position 64, 16 from 160)
@pytest.mark.parametrize("chunk, key_cost, length, steps, left_at", [
    (8, 0.0, 37, [8, 16, 24], 32), (64, 0.01, 200, [64, 96, 128, 160, 176], 192)], ids=["even", "shrinking"])
def test_a_draft_session_is_prefilled_in_jobs_and_proposes_as_one_fed_whole(tiny, chunk, key_cost, length, steps,
                                                                             left_at):
    draft = tiny["llama-draft"]
    draft.prefill_chunk, draft.prefill_key_cost = chunk, key_cost
    try:
        drafter = ModelChainDrafter(draft, 4)
        prompt = _prompt(10, length)
        session = drafter.open(256)
        fed = []
        while not prefill_step(session, prompt):
            fed.append(session.cache.length)
        assert fed == steps and session.cache.length == left_at
        proposal = session.propose(prompt, GREEDY, None)
        fresh = drafter.open(256)
        assert proposal.tree.tokens.tolist() == fresh.propose(prompt, GREEDY, None).tree.tokens.tolist()
        session.close()
        fresh.close()
    finally:
        draft.prefill_chunk, draft.prefill_key_cost = 0, 0.0


def test_the_chunk_size_resolves_by_device_and_is_validated():
    assert prefill_chunk(-1, torch.device("cpu")) == 512
    assert prefill_chunk(-1, torch.device("cuda")) == 2048
    assert prefill_chunk(0, torch.device("cpu")) == 0 and prefill_chunk(64, torch.device("cuda")) == 64
    assert build_config(None, prefill_chunk=256).prefill_chunk == 256
    with pytest.raises(ConfigError, match="prefill_chunk"):
        build_config(None, prefill_chunk=-2)


QWEN_1_5B = SimpleNamespace(num_heads=12, num_kv_heads=2, head_dim=128, hidden_size=1536, intermediate_size=8960,
                            gated_mlp=True, num_experts=0, experts_per_token=0, expert_intermediate_size=0,
                            shared_expert_intermediate_size=0)


def test_deeper_jobs_of_the_default_target_hold_fewer_tokens_as_its_row_by_row_attention_costs_more():
    """The 1.5B bf16 target row by row on the CPU (its measured 3e-4 a key against a row's
    linear layers): 512 tokens at the start, 144 at 8,192, 64 at 25,000; CUDA's attention
    costs its flops only, so its 2,048-token jobs shrink far less."""
    w = key_cost(QWEN_1_5B, "cpu", row_exact=True)
    assert w == pytest.approx(2.95e-4, rel=0.01)
    assert [job_rows(512, start, w) for start in (0, 2048, 8192, 25_000)] == [512, 320, 144, 64]
    assert key_cost(QWEN_1_5B, "cpu", row_exact=False) == pytest.approx(w * 2.0 / 4.5)
    cuda = key_cost(QWEN_1_5B, "cuda", row_exact=False)
    assert cuda == pytest.approx(w / 4.5) and [job_rows(2048, s, cuda) for s in (0, 32_000)] == [2048, 688]
    # a mixture of experts: the width its tokens run (8 experts of 1,120 = the dense 8,960 above)
    experts = SimpleNamespace(**{**vars(QWEN_1_5B), "intermediate_size": 0, "num_experts": 64,
                                 "experts_per_token": 8, "expert_intermediate_size": 1120})
    assert key_cost(experts, "cpu", row_exact=True) == pytest.approx(w)


@given(chunk=st.integers(1, 4096), start=st.integers(0, 200_000), w=st.floats(0, 0.1))
def test_a_job_costs_at_most_the_first_job_and_deeper_jobs_are_never_larger(chunk, start, w):
    rows = job_rows(chunk, start, w)
    cost = lambda t, at: t + w * (t * at + t * t / 2)  # noqa: E731
    assert 1 <= rows <= chunk and (rows == chunk or rows % GRAIN == 0)
    assert rows == min(chunk, GRAIN) or cost(rows, start) <= cost(chunk, 0) * (1 + 1e-9)
    assert job_rows(chunk, start + 1000, w) <= rows and job_rows(chunk, 0, w) == chunk
    assert job_rows(0, start, w) == 0 and job_rows(chunk, start, 0.0) == chunk


def test_a_session_s_jobs_shrink_as_the_key_cost_says_and_give_the_whole_prefill_s_output(chunked):
    target, draft = chunked
    target.prefill_chunk, target.prefill_key_cost = 64, 0.01
    try:
        prompt = _prompt(11, 200)
        session = DecodeSession(target, prompt, GREEDY)
        steps = []
        while session.prefill_step() is None:
            steps.append(session.prefilled)
        session.close()
        assert steps == [64, 96, 128, 160, 176, 192]  # 64 tokens, then 32 from position 64, 16 from 160
        assert generate(target, prompt, GREEDY, ModelChainDrafter(draft, 4))[0] == _whole(target, prompt)
    finally:
        target.prefill_key_cost = 0.0


def test_every_family_s_spec_gives_a_key_cost_whose_jobs_shrink(tiny_dir):
    """Every decoder family the tests build (dense, mixtures of experts, latent attention...):
    a positive cost, its first job the whole chunk and a job at 100,000 smaller."""
    from transformers import AutoConfig

    from specctl.engine.spec import ModelSpec

    for name, path in tiny_dir.items():
        spec = ModelSpec.from_hf(AutoConfig.from_pretrained(path))
        for device, row_exact in (("cpu", True), ("cpu", False), ("cuda", False)):
            w = key_cost(spec, device, row_exact)
            assert w > 0 and job_rows(512, 0, w) == 512 and job_rows(512, 100_000, w) < 512, (name, device)


def test_a_loaded_model_gets_its_chunk_and_key_cost_and_a_pipeline_stage_neither(tiny_dir):
    from specctl.spec.factory import load_named

    config = build_config(None, target=str(tiny_dir["llama"]), dtype="fp32")
    model = load_named(str(tiny_dir["llama"]), config, target=True).decoder
    assert model.prefill_chunk == 512 and model.prefill_key_cost == key_cost(model.spec, "cpu", model.row_exact) > 0
    stage = load_named(str(tiny_dir["llama"]), config, stage=((0, 1), True, False), target=True).decoder
    assert (stage.prefill_chunk, stage.prefill_key_cost) == (0, 0.0)
