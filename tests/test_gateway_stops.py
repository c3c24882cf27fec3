"""A stop string that comes mid-round: the output is what a target making a token at a time
makes — its text, and its tokens, their count and their log-probabilities up to the token that
completed the stop, not the rest of the round that brought it."""

import pytest

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config
from tests.test_gateway import PROMPT


@pytest.fixture(scope="module")
def whole_rounds(tiny_dir):
    """A gateway over a target whose draft is itself (drafting to its depth, whatever its
    probabilities): every round brings depth + 1 tokens."""
    import openai

    config = build_config(None, target=str(tiny_dir["llama"]), draft=str(tiny_dir["llama"]), mode="chain", depth=5,
                          dtype="fp32", draft_quant="none", draft_stop=0.0, max_sessions=4)
    thread = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0))
    urls = thread.start()
    yield openai.OpenAI(base_url=urls["gateway"] + "/v1", api_key="unused", max_retries=0), str(tiny_dir["llama"])
    thread.stop()


def _through(pieces: list[str], stop: str) -> int:
    """How many tokens a target making a token at a time makes before ``stop`` is in its text."""
    return next(n for n in range(1, len(pieces) + 1) if stop in "".join(pieces[:n]))


def _mid_round_stop(pieces: list[str], round_tokens: int = 6) -> tuple[str, int]:
    """A stop string that the second round's second token (or a later one short of a round's
    end) completes, and that token's count."""
    for n in range(round_tokens + 2, len(pieces)):
        if n % round_tokens:
            text = "".join(pieces[:n])
            for stop in (text[-width:] for width in range(1, 6)):
                if _through(pieces, stop) == n:
                    return stop, n
    raise AssertionError(f"no stop string completes mid-round in {pieces}")


def _completion(client, model, **options):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True}, **options)


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_string_counts_and_scores_the_tokens_up_to_the_one_that_completed_it(whole_rounds, include_stop):
    client, model = whole_rounds
    reference = _completion(client, model)
    assert reference.model_extra["specctl"]["mean_accepted_length"] == 6.0  # whole rounds of six tokens
    pieces = reference.choices[0].logprobs.tokens
    text = "".join(pieces)
    stop, through = _mid_round_stop(pieces)
    options = {"stop": [stop], "extra_body": {"ignore_eos": True, "include_stop_str_in_output": include_stop}}
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0, **options)
    end = text.index(stop) + (len(stop) if include_stop else 0)
    assert cut.choices[0].text == text[:end] and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].logprobs.tokens == pieces[:through] and cut.usage.completion_tokens == through
    # (to float noise: the reference ran without the prompt's cached prefix)
    assert cut.choices[0].logprobs.token_logprobs == pytest.approx(
        reference.choices[0].logprobs.token_logprobs[:through], abs=1e-4)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0,
                                            stream=True, stream_options={"include_usage": True}, **options))
    streamed = [token for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for token in chunk.choices[0].logprobs.tokens]
    assert streamed == pieces[:through] and chunks[-1].usage.completion_tokens == through


def test_a_stop_pattern_counts_the_tokens_up_to_the_one_that_completed_its_match(whole_rounds):
    import re

    client, model = whole_rounds
    pieces = _completion(client, model).choices[0].logprobs.tokens
    stop, through = _mid_round_stop(pieces)
    pattern = re.escape(stop)
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "stop_regex": [pattern]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == through
    assert cut.choices[0].logprobs.tokens == pieces[:through]
