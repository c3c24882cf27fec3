"""Log-probabilities of the output tokens (the OpenAI/vLLM ``logprobs``): the target's raw
distribution at each token's position, the same whichever drafter proposed the token."""

import pytest
import torch

from specctl.errors import InvalidSamplingParams
from specctl.spec.decode import DecodeSession
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter, NoDrafter
from specctl.spec.rounds import InlineLane, LocalSpeculator, run_inline, run_session
from specctl.spec.sampling import SamplingParams

PROMPT = [3, 17, 42, 99, 5, 8, 13]


def decode(target, params, drafter=None, run_ahead=None):
    lane = InlineLane()
    speculator = LocalSpeculator(drafter or NoDrafter(), lane, None)
    session = DecodeSession(target, PROMPT, params, (), None, None, speculator.max_nodes, run_ahead)
    run_inline(run_session(session, speculator, lane, lambda tokens, result: None))
    return session


def reference(target, output):
    """log-softmax of one forward over prompt + output: row i is output token i's distribution."""
    text = PROMPT + output
    logits = target(torch.tensor(text[:-1]), torch.arange(len(text) - 1), target.new_cache(len(text) + 1))
    return logits[len(PROMPT) - 1:].float().log_softmax(-1)


@pytest.mark.parametrize("drafter", ["ar", "chain", "tree", "ngram", "ar running ahead"])
def test_greedy_logprobs_are_the_targets_whichever_drafter_proposed(tiny, drafter):
    target = tiny["llama"]
    drafters = {"chain": ModelChainDrafter(tiny["llama-draft"], 4), "tree": ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3),
                "ngram": NgramDrafter(4)}
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)
    session = decode(target, params, drafters.get(drafter), run_ahead=True if drafter == "ar running ahead" else None)
    assert session.output == decode(target, SamplingParams(max_tokens=24, ignore_eos=True)).output
    expected = reference(target, session.output)
    assert len(session.logprobs) == len(session.output) == 24
    for i, (token, (chosen, ids, values)) in enumerate(zip(session.output, session.logprobs)):
        assert chosen == pytest.approx(float(expected[i, token]), abs=1e-4)
        assert ids[0] == token and len(ids) == len(values) == 3  # greedy: the token is the likeliest
        assert values == pytest.approx(expected[i].topk(3).values.tolist(), abs=1e-4)


def test_sampled_logprobs_are_the_raw_distributions_and_a_stop_token_has_none(tiny):
    target = tiny["qwen2"]
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=7, ignore_eos=True, logprobs=0)
    session = decode(target, params, ModelChainDrafter(tiny["qwen2-draft"], 3))
    expected = reference(target, session.output)
    # before temperature and top-k, as vLLM reports them; no alternatives asked for
    assert [c for c, _, _ in session.logprobs] == pytest.approx(
        [float(expected[i, t]) for i, t in enumerate(session.output)], abs=1e-4)
    assert all(ids == values == [] for _, ids, values in session.logprobs)
    stop = session.output[5]
    first = session.output.index(stop)
    stopped = decode(target, SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=7, ignore_eos=True,
                                            stop_token_ids=(stop,), logprobs=0), ModelChainDrafter(tiny["qwen2-draft"], 3))
    assert stopped.output == session.output[:first] and stopped.logprobs == session.logprobs[:first]


def test_no_logprobs_unless_asked_and_at_most_twenty_alternatives(tiny):
    assert decode(tiny["llama"], SamplingParams(max_tokens=5, ignore_eos=True)).logprobs == []
    with pytest.raises(InvalidSamplingParams, match=r"^logprobs must be between 0 and 20 \(the alternatives listed "
                                                    r"beside each token\), got 21$"):
        SamplingParams(logprobs=21)
