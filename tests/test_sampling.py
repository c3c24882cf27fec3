import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specctl.errors import InvalidSamplingParams
from specctl.spec.sampling import SamplingParams, probs_from_logits


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature must be between 0 and 100, got -0.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -1}, "top_k must be a non-negative integer (0 = off), got -1"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
        ({"seed": -3}, "seed must be a non-negative integer, got -3"),
    ],
)
def test_bad_sampling_parameters_are_refused(kwargs, message):
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_greedy_is_one_hot_argmax():
    probs = probs_from_logits(torch.tensor([[0.1, 3.0, -1.0]]), SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (0.7, 0, 0.8), (1.3, 7, 0.9)])
def test_matches_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 32) * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = probs_from_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(ours, ref.softmax(-1))
