"""Log-probabilities of the output tokens (the OpenAI/vLLM ``logprobs``): the target's raw
distribution at each token's position, the same whichever drafter proposed the token."""

import pytest
import torch

from specctl.errors import InvalidSamplingParams
from specctl.spec.decode import DecodeSession
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter, NoDrafter
from specctl.spec.rounds import InlineLane, LocalSpeculator, run_inline, run_session
from specctl.spec.params import SamplingParams

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
    for i, (token, (chosen, ids, values, rank)) in enumerate(zip(session.output, session.logprobs)):
        assert chosen == pytest.approx(float(expected[i, token]), abs=1e-4)
        assert ids[0] == token and len(ids) == len(values) == 3 and rank == 1  # greedy: the token is the likeliest
        assert values == pytest.approx(expected[i].topk(3).values.tolist(), abs=1e-4)


def test_sampled_logprobs_are_the_raw_distributions_and_a_stop_token_has_none(tiny):
    target = tiny["qwen2"]
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=7, ignore_eos=True, logprobs=0)
    session = decode(target, params, ModelChainDrafter(tiny["qwen2-draft"], 3))
    expected = reference(target, session.output)
    # before temperature and top-k, as vLLM reports them; no alternatives asked for
    assert [c for c, _, _, _ in session.logprobs] == pytest.approx(
        [float(expected[i, t]) for i, t in enumerate(session.output)], abs=1e-4)
    assert all(ids == values == [] for _, ids, values, _ in session.logprobs)
    # each token's rank in its raw row, whether or not alternatives were asked for (vLLM's)
    ranks = [rank for _, _, _, rank in session.logprobs]
    assert ranks == [int((expected[i] >= expected[i, t]).sum()) for i, t in enumerate(session.output)]
    assert max(ranks) > 1  # sampled at T 0.8 from a random model: some tokens below their row's likeliest
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


def test_prompt_logprobs_are_the_targets_and_leave_the_output_alone(tiny, monkeypatch):
    import specctl.spec.logprobs as logprobs_module
    from specctl.engine.kv_cache import KVPool

    target = tiny["llama"]
    monkeypatch.setattr(logprobs_module, "PROMPT_CHUNK", 4)  # 6 rows scored: a chunk of 4, then one of 2
    pool = KVPool()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = decode(target, params)
    lane = InlineLane()
    speculator = LocalSpeculator(ModelChainDrafter(tiny["llama-draft"], 3), lane, None)
    session = DecodeSession(target, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=2), (),
                            None, pool, speculator.max_nodes)
    assert pool.sessions == 1  # the scoring pass's scratch cache is gone before the session's is taken
    run_inline(run_session(session, speculator, lane, lambda tokens, result: None))
    assert session.output == plain.output
    full = target(torch.tensor(PROMPT), torch.arange(len(PROMPT)), target.new_cache(len(PROMPT)))
    expected = full[:-1].float().log_softmax(-1)
    assert len(session.prompt_logprobs) == len(PROMPT) - 1
    ranks = []
    for row, token, (chosen, ids, values, rank) in zip(expected, PROMPT[1:], session.prompt_logprobs):
        assert chosen == pytest.approx(float(row[token]), abs=1e-5)
        assert ids == row.topk(2).indices.tolist() and values == pytest.approx(row.topk(2).values.tolist(), abs=1e-5)
        assert rank == row.argsort(descending=True).tolist().index(token) + 1  # vLLM's: 1 is the likeliest
        ranks.append(rank)
    assert max(ranks) > 2  # a random model's prompt: some tokens far down their rows (the rank is not the top-k's)
    assert decode(target, params).prompt_logprobs is None
    one = DecodeSession(target, PROMPT[:1], SamplingParams(max_tokens=2, prompt_logprobs=0), (), None, pool)
    assert one.prompt_logprobs == []  # nothing precedes the only token
    one.close()
    session.close()
    assert pool.used_bytes == 0 and pool.sessions == 0


def test_prompt_logprobs_that_do_not_fit_the_kv_budget_leave_nothing_reserved(tiny):
    from specctl.engine.kv_cache import KVPool
    from specctl.errors import KVBudgetExceeded

    target = tiny["llama"]
    pool = KVPool(budget_bytes=target.kv_slot_bytes * 4)
    with pytest.raises(KVBudgetExceeded, match="KV cache budget exhausted"):
        DecodeSession(target, PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0), (), None, pool)
    assert pool.used_bytes == 0 and pool.sessions == 0
    with pytest.raises(InvalidSamplingParams, match=r"^prompt_logprobs must be between 0 and 20"):
        SamplingParams(prompt_logprobs=-1)
