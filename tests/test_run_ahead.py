"""AR that runs the target's next step before reading its token back (spec.decode,
``DecodeSession.run_ahead``): the same tokens (greedy, and sampled from the same seed), finish
and KV as reading each step, on the CPU (where it is forced on: the auto rule keeps it to CUDA
graphs)."""

from types import SimpleNamespace

import pytest
import torch

from specctl.engine.loader import load_decoder
from specctl.engine.tree import TokenTree
from specctl.spec.batched_verify import apply_many
from specctl.spec.decode import DecodeSession, runs_ahead
from specctl.spec.drafters import NoDrafter, Proposal
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import InlineLane, LocalSpeculator, run_inline, run_session

PROMPT = [5, 9, 14, 3, 77, 120, 8]


@pytest.fixture(scope="module")
def decoders(tiny_dir):
    return {"eager": load_decoder(tiny_dir["qwen2"]),
            "static": load_decoder(tiny_dir["qwen2"]).use_static_steps(graphs=False)}


def _run(target, params, run_ahead, prompt=PROMPT):
    session = DecodeSession(target, prompt, params, eos_token_ids=(), run_ahead=run_ahead)
    lane = InlineLane()
    emitted = []

    def emit(tokens, _):
        emitted.append(tokens)
        session.final_cache_length = session.cache.length  # the cache is released when the session ends

    run_inline(run_session(session, LocalSpeculator(NoDrafter(), lane), lane, emit))
    return session, emitted


SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=50, seed=11)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["eager", "static"])
def test_running_ahead_gives_the_tokens_of_reading_each_step(decoders, kind, sampling):
    target = decoders[kind]
    plain, plain_emitted = _run(target, SamplingParams(max_tokens=12, ignore_eos=True, **sampling), False)
    ahead, ahead_emitted = _run(target, SamplingParams(max_tokens=12, ignore_eos=True, **sampling), True)
    assert ahead.output == plain.output and ahead_emitted == plain_emitted and ahead.finish_reason == "length"
    assert ahead.steps_ahead == 11  # every token but the last: no step is run for a token never emitted
    assert ahead.stats.rounds == plain.stats.rounds == 11
    assert ahead.final_cache_length == plain.final_cache_length == len(ahead.seq) - 1


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["eager", "static"])
def test_a_stop_token_drops_the_step_run_ahead_and_its_kv(decoders, kind, sampling):
    target = decoders[kind]
    reference, _ = _run(target, SamplingParams(max_tokens=12, ignore_eos=True, **sampling), False)
    stop = reference.output[5]
    params = SamplingParams(max_tokens=12, stop_token_ids=(stop,), **sampling)
    plain, _ = _run(target, params, False)
    ahead, _ = _run(target, params, True)
    first = reference.output.index(stop)
    assert ahead.output == plain.output == reference.output[:first] and ahead.finish_reason == plain.finish_reason == "stop"
    assert ahead.steps_ahead == first + 1  # the step fed the stop token ran, and was dropped
    # as reading each step leaves it: the root that gave the stop token verified, nothing after it
    assert ahead.ahead is None and ahead.final_cache_length == plain.final_cache_length == len(ahead.seq)


def test_the_cache_holds_the_text_but_its_last_token_between_rounds_with_one_step_ahead(decoders):
    target = decoders["static"]
    session = DecodeSession(target, PROMPT, SamplingParams(max_tokens=6, ignore_eos=True), run_ahead=True)
    session.prefill()
    for _ in range(3):
        assert session.cache.length == len(session.seq)  # the next root's KV, written by the step ahead
        session.apply(Proposal(TokenTree.root(session.seq[-1])))
    session.close()


def test_a_larger_proposal_after_running_ahead_drops_that_step_and_verifies_the_tree(decoders):
    target = decoders["static"]
    reference, _ = _run(target, SamplingParams(max_tokens=16, ignore_eos=True), False)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = DecodeSession(target, PROMPT, params, max_nodes=5, run_ahead=False)
    ahead = DecodeSession(target, PROMPT, params, max_nodes=5, run_ahead=True)
    for session in (plain, ahead):
        session.prefill()
    # rounds: the root alone, a chain of the next 3 true tokens and a wrong one, the root alone, a chain
    for round_ in range(4):
        for session in (plain, ahead):
            done = len(session.output)
            if round_ % 2:
                chain = reference.output[done : done + 3] + [(reference.output[done + 3] + 1) % 256]
                proposal = Proposal(TokenTree.chain(session.seq[-1], chain))
            else:
                proposal = Proposal(TokenTree.root(session.seq[-1]))
            session.apply(proposal)
        assert ahead.output == plain.output == reference.output[: len(plain.output)]
        pending = 1 if ahead.ahead is not None else 0
        assert ahead.cache.length == plain.cache.length + pending
    assert ahead.ahead is None  # the last round verified a chain: nothing was run ahead after it
    for session in (plain, ahead):
        session.close()


def test_sessions_verified_together_take_their_steps_run_ahead(decoders):
    target = decoders["static"]
    prompts = [PROMPT, [3, 3, 40, 41, 42], [200, 1]]
    alone = [_run(target, SamplingParams(max_tokens=8, ignore_eos=True), False, prompt)[0].output for prompt in prompts]
    sessions = [DecodeSession(target, prompt, SamplingParams(max_tokens=8, ignore_eos=True), run_ahead=ahead)
                for prompt, ahead in zip(prompts, (True, False, True))]
    for session in sessions:
        session.prefill()
    while not all(session.finished for session in sessions):
        live = [session for session in sessions if not session.finished]
        results = apply_many([(session, Proposal(TokenTree.root(session.seq[-1]))) for session in live])
        assert not any(isinstance(result, BaseException) for result in results)
    assert [session.output for session in sessions] == alone
    assert [session.steps_ahead for session in sessions] == [7, 0, 7]


def test_a_draw_with_no_mass_fails_as_reading_each_step_fails(decoders):
    target = decoders["static"]
    for run_ahead in (False, True):
        session = DecodeSession(target, PROMPT, SamplingParams(max_tokens=8, temperature=0.7), run_ahead=run_ahead)
        nan = torch.full((1, target.spec.vocab_size), float("nan"))
        with pytest.raises(ValueError, match="cannot sample from a distribution with no mass"):
            session.accept(Proposal(TokenTree.root(PROMPT[-1])), nan)
        session.close()


def test_only_ar_on_cuda_graphs_runs_ahead():
    graphs, padded = SimpleNamespace(static=SimpleNamespace(graphs=True)), SimpleNamespace(static=SimpleNamespace(graphs=False))
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8)
    assert runs_ahead(greedy, 1, graphs) and runs_ahead(sampled, 1, graphs)
    assert not runs_ahead(greedy, 5, graphs)  # a speculator's proposals re-verify the root: the step would be wasted
    assert not runs_ahead(greedy, 1, padded)  # the CPU computes as it launches: nothing to overlap
    assert not runs_ahead(greedy, 1, SimpleNamespace())  # a pipeline of stages
