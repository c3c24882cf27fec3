"""Sampling penalties (presence, frequency, repetition) are part of the target's distribution:
the penalized logits are transformers' and OpenAI's, and every speculative mode produces what
the target alone produces with them — token for token greedy, the same distribution sampled."""

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from specctl.errors import InvalidSamplingParams
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.penalties import Penalties
from specctl.spec.rounds import generate
from specctl.spec.sampling import SamplingParams, probs_from_logits
from tests.test_sampling_exact import PROMPT as SMALL_PROMPT
from tests.test_sampling_exact import SAMPLES, VOCAB, assert_counts_match, small  # noqa: F401 - the fixture

PROMPT = [3, 17, 42, 99, 3, 17, 42, 99, 3, 17]  # a pattern the n-gram lookup proposes from
PENALIZED = SamplingParams(max_tokens=32, ignore_eos=True, presence_penalty=0.2, frequency_penalty=0.2,
                           repetition_penalty=1.15)
STRONG = SamplingParams(max_tokens=32, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.4,
                        repetition_penalty=1.6)  # no token repeats: nothing for the n-gram lookup to find


def reference_logits(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """One row penalized by the libraries' and the API's own definitions: transformers'
    RepetitionPenaltyLogitsProcessor over prompt + output, then OpenAI's
    ``logit - frequency * count - presence * (count > 0)`` over the output."""
    row = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(
        torch.tensor([prompt + output]), logits.float().clone().unsqueeze(0))[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).float()
    return row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


def test_penalized_rows_are_transformers_and_openais():
    torch.manual_seed(0)
    vocab, output = 50, [7, 7, 3, 11]
    penalties = Penalties(PENALIZED, PROMPT[:3] + [40], vocab, torch.device("cpu"))
    penalties.record(output)
    logits = torch.randn(3, vocab) * 4
    paths = [[], [7], [9, 3]]  # a root, a child repeating a token, a grandchild
    got = penalties.apply(logits, paths)
    for row, path in enumerate(paths):
        expected = reference_logits(logits[row], PROMPT[:3] + [40], output + path, PENALIZED)
        torch.testing.assert_close(got[row], expected)
    assert not SamplingParams().penalized and SamplingParams(repetition_penalty=1.1).penalized


@pytest.mark.parametrize("mode, params", [(mode, params) for mode in ("chain", "tree", "ngram")
                                          for params in (PENALIZED, STRONG) if (mode, params) != ("ngram", STRONG)])
def test_greedy_with_penalties_every_mode_equals_the_target_alone(tiny, mode, params):
    target = tiny["llama"]
    drafter = {"chain": ModelChainDrafter(tiny["llama-draft"], 4),
               "tree": ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3), "ngram": NgramDrafter(3)}[mode]
    alone, _, _ = generate(target, PROMPT, params)
    output, stats, _ = generate(target, PROMPT, params, drafter)
    assert output == alone
    assert stats.drafts > 0
    assert alone != generate(target, PROMPT, SamplingParams(max_tokens=32, ignore_eos=True))[0]  # they bite


def test_the_target_alone_with_penalties_is_a_full_forward_per_token(tiny):
    """AR decoding with penalties against the definition: one forward over the whole text per
    token, the last row penalized by the reference, its argmax."""
    target = tiny["llama"]
    params = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.4,
                            repetition_penalty=1.6)
    text = list(PROMPT)
    for _ in range(params.max_tokens):
        logits = target(torch.tensor(text), torch.arange(len(text)), target.new_cache(len(text)))[-1]
        text.append(int(reference_logits(logits, PROMPT, text[len(PROMPT):], params).argmax()))
    assert generate(target, PROMPT, params)[0] == text[len(PROMPT):]


def _penalized_next_probs(decoder, output, params):
    seq = SMALL_PROMPT + output
    logits = decoder(torch.tensor(seq), torch.arange(len(seq)), decoder.new_cache(len(seq)))[-1]
    return probs_from_logits(reference_logits(logits, SMALL_PROMPT, output, params), params)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_with_penalties_keeps_the_targets_penalized_distribution(small, mode):  # noqa: F811
    target, draft = small
    params = SamplingParams(temperature=1.0, max_tokens=3, presence_penalty=0.8, frequency_penalty=0.5,
                            repetition_penalty=1.5)
    expected = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)  # P(token 2, token 3)
    p1 = _penalized_next_probs(target, [], params)
    for t1 in range(VOCAB):
        p2 = _penalized_next_probs(target, [t1], params)
        for t2 in range(VOCAB):
            expected[t2] += float(p1[t1]) * float(p2[t2]) * _penalized_next_probs(target, [t1, t2], params).double()
    drafter = ModelChainDrafter(draft, 2) if mode == "chain" else ModelTreeDrafter(draft, 2, 2, 3)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    accepted = 0
    for seed in range(SAMPLES):
        out, stats, _ = generate(target, SMALL_PROMPT, SamplingParams(**{**_fields(params), "seed": seed}), drafter)
        counts[out[1], out[2]] += 1
        accepted += stats.accepted > 0
    assert accepted > 0
    assert_counts_match(counts, expected)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


@pytest.mark.parametrize("fields, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be between -2 and 2, got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty must be between -2 and 2, got -3"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 100] (1 = off), got 0"),
])
def test_penalties_out_of_range_are_refused(fields, message):
    with pytest.raises(InvalidSamplingParams) as refused:
        SamplingParams(**fields)
    assert str(refused.value) == message


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_with_penalties_on_six_tokens_where_paths_repeat_them(small, mode):  # noqa: F811
    """With six tokens a proposal's path repeats tokens all the time: each node must be penalized
    for the path before it, not only for the committed text."""
    target, draft = small
    drafter = ModelChainDrafter(draft, 4) if mode == "chain" else ModelTreeDrafter(draft, 3, 2, 3)
    params = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=0.3, frequency_penalty=0.3,
                            repetition_penalty=1.3)
    for prompt in ([1, 4, 2], [5, 5, 0, 3], [2]):
        alone, _, _ = generate(target, prompt, params)
        output, stats, _ = generate(target, prompt, params, drafter)
        assert output == alone, prompt
        assert stats.accepted > 0
