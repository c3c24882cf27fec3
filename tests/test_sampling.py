import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from specctl.errors import InvalidSamplingParams
from specctl.spec.params import SamplingParams
from specctl.spec.sampling import probs_from_logits


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature must be between 0 and 100, got -0.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"min_p": 1.5}, "min_p must be between 0 and 1, got 1.5"),
        ({"top_k": -1}, "top_k must be a non-negative integer (0 = off), got -1"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
        ({"seed": 2**63}, "seed must be an integer from -9223372036854775808 to 9223372036854775807, got "
                          "9223372036854775808"),
        ({"seed": -2**63 - 1}, "seed must be an integer from -9223372036854775808 to 9223372036854775807, got "
                               "-9223372036854775809"),
        ({"sampler_order": ("top_k", "temperature")}, "sampler_order names temperature, top_k, top_p, min_p once each, "
                                                      "in the order they apply, got ['top_k', 'temperature']"),
    ],
)
def test_bad_sampling_parameters_are_refused(kwargs, message):
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_greedy_is_one_hot_argmax():
    probs = probs_from_logits(torch.tensor([[0.1, 3.0, -1.0]]), SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (0.7, 0, 0.8, 0.0),
                                                             (1.3, 7, 0.9, 0.0), (1.0, 0, 1.0, 0.1), (0.8, 9, 0.9, 0.05)])
def test_matches_transformers_warpers(temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 32) * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    if min_p:
        ref = MinPLogitsWarper(min_p)(None, ref)
    ours = probs_from_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    torch.testing.assert_close(ours, ref.softmax(-1))


def test_temperature_last_filters_the_unscaled_distribution_as_llama_cpp_does():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    first = SamplingParams(temperature=0.5, top_p=0.8)
    last = SamplingParams(temperature=0.5, top_p=0.8, sampler_order=("top_k", "top_p", "min_p", "temperature"))
    # scaled first, [4, 2, 0, -2]: tokens 1-3 hold 13.3 % <= 20 %, so top-p keeps token 0 alone
    assert probs_from_logits(logits, first).tolist() == [1.0, 0.0, 0.0, 0.0]
    # unscaled, tokens 2 and 3 hold 11.9 % (token 1 would make 35.6 %): 0 and 1 stay, then T = 0.5 on [2, 1]
    torch.testing.assert_close(probs_from_logits(logits, last),
                               torch.cat([(torch.tensor([2.0, 1.0]) / 0.5).softmax(-1), torch.zeros(2)]))
    # min-p reads the probabilities where it stands: 0.3 x 0.644 keeps tokens 0 and 1 unscaled, token 0 alone scaled
    assert (probs_from_logits(logits, SamplingParams(temperature=0.5, min_p=0.3, sampler_order=last.sampler_order))
            > 0).tolist() == [True, True, False, False]
    assert (probs_from_logits(logits, SamplingParams(temperature=0.5, min_p=0.3)) > 0).tolist() == [True] + [False] * 3
    # greedy is the argmax in any order
    assert probs_from_logits(logits, SamplingParams(top_p=0.5, sampler_order=last.sampler_order)).tolist() == [
        1.0, 0.0, 0.0, 0.0]


def test_sample_never_draws_a_token_without_mass_and_is_seeded():
    from specctl.spec.sampling import sample

    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    draws = [sample(probs, torch.Generator().manual_seed(s)) for s in range(300)]
    assert set(draws) == {1, 3}
    again = [sample(probs, torch.Generator().manual_seed(s)) for s in range(300)]
    assert draws == again


def test_sample_follows_the_distribution():
    from scipy.stats import chisquare

    from specctl.spec.sampling import sample

    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(probs, generator) for _ in range(4000)]), minlength=4)
    assert chisquare(counts.tolist(), (probs * 4000).tolist()).pvalue > 0.01


def test_sample_edge_cases(monkeypatch):
    import specctl.spec.sampling as sampling

    with pytest.raises(ValueError, match="cannot sample from a distribution with no mass"):
        sampling.sample(torch.zeros(4), None)
    # A uniform that rounds onto the total still lands on a token with mass (the last one).
    monkeypatch.setattr(sampling, "uniform", lambda generator: 1.0)
    assert sampling.sample(torch.tensor([0.5, 0.5, 0.0]), None) == 1
    monkeypatch.setattr(sampling, "uniform", lambda generator: 0.0)
    assert sampling.sample(torch.tensor([0.0, 0.5, 0.5]), None) == 1
