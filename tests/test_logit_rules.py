"""What a request changes in the target's logits (logit_bias, min_tokens, the presence,
frequency and repetition penalties) is part of the target's distribution: the adjusted logits
are transformers' and OpenAI's, and every speculative mode produces what the target alone
produces with them — token for token greedy, the same distribution sampled."""

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from specctl.errors import InvalidSamplingParams
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.logit_rules import LogitRules
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate
from specctl.spec.sampling import probs_from_logits
from tests.conftest import mode_drafter
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
    penalties = LogitRules(PENALIZED, PROMPT[:3] + [40], set(), vocab, torch.device("cpu"))
    penalties.record(output)
    logits = torch.randn(3, vocab) * 4
    paths = [[], [7], [9, 3]]  # a root, a child repeating a token, a grandchild
    got = penalties.apply(logits, paths)
    for row, path in enumerate(paths):
        expected = reference_logits(logits[row], PROMPT[:3] + [40], output + path, PENALIZED)
        torch.testing.assert_close(got[row], expected)
    assert not SamplingParams().adjusts_logits and SamplingParams(repetition_penalty=1.1).adjusts_logits


def llama_cpp_penalized(logits: torch.Tensor, text: list[int], params: SamplingParams) -> torch.Tensor:
    """One row as llama.cpp's penalties sampler leaves it: each token's count in the text's last
    ``penalty_last_n`` tokens (the prompt's included); a counted token's logit divided by the
    repeat penalty when positive, multiplied when not, then ``- count * freq - (count > 0) * present``."""
    row = logits.float().clone()
    window = text[-params.penalty_last_n:]
    for token in set(window):
        count = window.count(token)
        row[token] = row[token] / params.repetition_penalty if row[token] > 0 else row[token] * params.repetition_penalty
        row[token] -= count * params.frequency_penalty + params.presence_penalty
    return row


WINDOWED = SamplingParams(max_tokens=32, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.4,
                          repetition_penalty=1.6, penalty_last_n=4)


def test_penalties_over_the_last_n_tokens_are_llama_cpp_s():
    torch.manual_seed(2)
    vocab, prompt, output = 50, [40, 7, 9, 3, 3], [7, 11]
    rules = LogitRules(WINDOWED, prompt, set(), vocab, torch.device("cpu"))
    rules.record(output[:1])
    rules.record(output[1:])
    logits = torch.randn(4, vocab) * 4
    paths = [[], [3], [3, 3], [12, 13, 14, 15]]  # the last one's window is its own path alone
    got = rules.apply(logits, paths)
    for row, path in enumerate(paths):
        torch.testing.assert_close(got[row], llama_cpp_penalized(logits[row], prompt + output + path, WINDOWED))
    assert torch.equal(got[0, 9], logits[0, 9])  # a prompt token before the window is not penalized
    # one in it counts for presence and frequency too (vLLM's count the output alone)
    assert got[0, 3] < (logits[0, 3] / 1.6 if logits[0, 3] > 0 else logits[0, 3] * 1.6) - 1.2
    guide = rules.guide(torch.device("cpu"))  # the draft's copy keeps its own window
    guide.record([20])
    assert rules.recent == [3, 3, 7, 11] and guide.recent == [3, 7, 11, 20]


def test_allowed_token_ids_bar_every_other_token_before_the_rest():
    torch.manual_seed(3)
    vocab = 30
    params = SamplingParams(allowed_token_ids=(4, 9, 17), logit_bias=((9, 3.0), (5, 50.0)), repetition_penalty=1.5)
    rules = LogitRules(params, [9, 1], set(), vocab, torch.device("cpu"))
    logits = torch.randn(2, vocab) * 4
    got = rules.apply(logits, [[], [4]])
    assert torch.isinf(got[:, [t for t in range(vocab) if t not in (4, 9, 17)]]).all()  # 5's bias cannot lift it
    for row, path in enumerate([[], [4]]):
        biased = logits[row].clone()
        biased[9] += 3.0
        expected = reference_logits(biased, [9, 1], path, dataclasses.replace(params, logit_bias=()))
        torch.testing.assert_close(got[row, [4, 9, 17]], expected[[4, 9, 17]])
    assert params.adjusts_logits and rules.guide(torch.device("cpu")).allowed.tolist() == rules.allowed.tolist()


@pytest.mark.parametrize("mode", ["chain", "tree", "ngram"])
def test_greedy_with_allowed_token_ids_every_mode_equals_the_target_alone_within_them(tiny, mode):
    target = tiny["llama"]
    allowed = tuple(range(40, 90, 3))
    params = SamplingParams(max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    alone, _, _ = generate(target, PROMPT, params)
    output, stats, _ = generate(target, PROMPT, params, mode_drafter(mode, tiny["llama-draft"]))
    assert output == alone and set(alone) <= set(allowed)
    assert alone != generate(target, PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))[0]


def test_logit_bias_then_min_tokens_then_penalties_as_vllm_orders_them():
    torch.manual_seed(1)
    vocab, stop = 40, {2, 5}
    params = SamplingParams(max_tokens=8, min_tokens=3, logit_bias=((7, 5.0), (9, -100.0)), repetition_penalty=1.5,
                            presence_penalty=0.5)
    rules = LogitRules(params, [7, 1], stop, vocab, torch.device("cpu"))
    rules.record([3])  # one token out: rows with fewer than 2 tokens on their path still bar the stop tokens
    logits = torch.randn(3, vocab) * 4
    paths = [[], [4], [4, 8]]
    got = rules.apply(logits, paths)
    for row, path in enumerate(paths):
        biased = logits[row].clone()
        biased[7] += 5.0
        biased[9] -= 100.0
        if 1 + len(path) < 3:
            biased[[2, 5]] = float("-inf")
        expected = reference_logits(biased, [7, 1], [3] + path, params)
        torch.testing.assert_close(got[row], expected)
    assert torch.isinf(got[:2, [2, 5]]).all() and not torch.isinf(got[2]).any()


@pytest.mark.parametrize("mode, params", [(mode, params) for mode in ("chain", "tree", "ngram")
                                          for params in (PENALIZED, STRONG, WINDOWED)
                                          if (mode, params) != ("ngram", STRONG)])
def test_greedy_with_penalties_every_mode_equals_the_target_alone(tiny, mode, params):
    target = tiny["llama"]
    drafter = {"chain": ModelChainDrafter(tiny["llama-draft"], 4),
               "tree": ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3), "ngram": NgramDrafter(3)}[mode]
    alone, _, _ = generate(target, PROMPT, params)
    output, stats, _ = generate(target, PROMPT, params, drafter)
    assert output == alone
    assert stats.drafts > 0
    assert alone != generate(target, PROMPT, SamplingParams(max_tokens=32, ignore_eos=True))[0]  # they bite


def test_a_window_changes_what_the_penalties_count(tiny):
    """llama.cpp's window is not vLLM's penalties: the same penalties over the last 4 tokens
    give another text than over the whole prompt and output."""
    import dataclasses

    target = tiny["llama"]
    assert generate(target, PROMPT, WINDOWED)[0] != generate(target, PROMPT, dataclasses.replace(WINDOWED, penalty_last_n=0))[0]


@pytest.mark.parametrize("mode, params", [("chain", STRONG), ("tree", STRONG), ("chain", WINDOWED)])
def test_the_draft_follows_the_penalties_so_more_is_accepted(tiny, mode, params, monkeypatch):
    """The target as its own draft: following the request's rules it proposes what the target
    picks (everything a chain proposes is accepted); drafting free, it misses where they bite."""
    drafter = {"chain": ModelChainDrafter(tiny["llama"], 4), "tree": ModelTreeDrafter(tiny["llama"], 3, 2, 3)}[mode]
    guided, stats, _ = generate(tiny["llama"], PROMPT, params, drafter)
    monkeypatch.setattr(LogitRules, "guide", lambda self, device: None)  # the draft drafts free
    free, free_stats, _ = generate(tiny["llama"], PROMPT, params, drafter)
    assert guided == free
    assert stats.accepted > free_stats.accepted
    if mode == "chain":
        assert stats.accepted == stats.drafted


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


def _joint(next_probs, target, params: SamplingParams) -> torch.Tensor:
    """P(token 2, token 3) of the target alone under ``params``, from ``next_probs`` (the
    adjusted next-token distribution by its definition), summed over token 1."""
    out = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = next_probs(target, [], params)
    for t1 in range(VOCAB):
        p2 = next_probs(target, [t1], params)
        for t2 in range(VOCAB):
            out[t2] += float(p1[t1]) * float(p2[t2]) * next_probs(target, [t1, t2], params).double()
    return out


def _assert_sampled_pairs_match(models, mode: str, params: SamplingParams, expected: torch.Tensor) -> None:
    """Tokens 2 and 3 of SAMPLES seeded speculative generations against ``expected`` (chi-square)."""
    target, draft = models
    drafter = ModelChainDrafter(draft, 2) if mode == "chain" else ModelTreeDrafter(draft, 2, 2, 3)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    accepted = 0
    for seed in range(SAMPLES):
        out, stats, _ = generate(target, SMALL_PROMPT, SamplingParams(**{**_fields(params), "seed": seed}), drafter)
        counts[out[1], out[2]] += 1
        accepted += stats.accepted > 0
    assert accepted > 0
    assert_counts_match(counts, expected)


# in --runslow (chain 40 s, tree 24 s on a slow 2-core machine; CI's second pass); greedy equality with penalties
# in every mode stays in the default run
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_with_penalties_keeps_the_targets_penalized_distribution(small, mode):  # noqa: F811
    params = SamplingParams(temperature=1.0, max_tokens=3, presence_penalty=0.8, frequency_penalty=0.5,
                            repetition_penalty=1.5)
    _assert_sampled_pairs_match(small, mode, params, _joint(_penalized_next_probs, small[0], params))


def _barred_next_probs(decoder, output, params):
    """vLLM's bad_words by their definition: a one-token word never; a longer word's last token
    where the output ends with the rest of it."""
    seq = SMALL_PROMPT + output
    logits = decoder(torch.tensor(seq), torch.arange(len(seq)), decoder.new_cache(len(seq)))[-1].float().clone()
    for word in params.bad_words:
        if len(word) == 1 or output[len(output) - len(word) + 1:] == list(word[:-1]):
            logits[word[-1]] = float("-inf")
    return probs_from_logits(logits, params)


@pytest.mark.slow  # as the penalties' chi-square above; greedy equality with bad_words stays in the default run
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_with_bad_words_keeps_the_targets_barred_distribution(small, mode):  # noqa: F811
    params = SamplingParams(temperature=1.0, max_tokens=3, bad_words=((3,), (5, 5), (2, 1)))  # likely ones
    expected = _joint(_barred_next_probs, small[0], params)
    assert expected[3].sum() == expected[:, 3].sum() == expected[5, 5] == expected[2, 1] == 0
    free = _joint(_barred_next_probs, small[0], SamplingParams(temperature=1.0, max_tokens=3))
    assert (expected - free).abs().sum() > 0.6  # the bars matter
    _assert_sampled_pairs_match(small, mode, params, expected)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


@pytest.mark.parametrize("fields, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be between -2 and 2, got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty must be between -2 and 2, got -3"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 100] (1 = off), got 0"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be between 0 and max_tokens (10), got 20"),
    ({"logit_bias": ((3, 101.0),)}, "logit_bias maps token ids (>= 0) to values between -100 and 100, got 3: 101.0"),
    ({"logit_bias": tuple((i, 1.0) for i in range(1025))}, "logit_bias may bias at most 1024 tokens, got 1025"),
    ({"bad_words": ((),)}, "bad_words are at most 64 token sequences of 1 to 32 token ids (>= 0)"),
    ({"bad_words": ((3, -1),)}, "bad_words are at most 64 token sequences of 1 to 32 token ids (>= 0)"),
    ({"bad_words": ((3,),) * 65}, "bad_words are at most 64 token sequences of 1 to 32 token ids (>= 0)"),
    ({"penalty_last_n": -1}, "penalty_last_n must be an integer between 0 (vLLM's penalties) and 1048576, got -1"),
])
def test_adjustments_out_of_range_are_refused(fields, message):
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


@pytest.mark.parametrize("mode", ["chain", "tree", "ngram"])
def test_greedy_with_logit_bias_and_min_tokens_every_mode_equals_the_target_alone(tiny, mode):
    target = tiny["llama"]
    drafter = {"chain": ModelChainDrafter(tiny["llama-draft"], 4),
               "tree": ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3), "ngram": NgramDrafter(3)}[mode]
    plain, _, _ = generate(target, PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))
    stop = plain[4]  # a stop token the plain output reaches early
    stopped = generate(target, PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop,)))[0]
    assert stopped == plain[:plain.index(stop)]
    for rules in ({"min_tokens": 12}, {"min_tokens": 12, "logit_bias": ((plain[1], -100.0), (plain[2], 3.0))}):
        params = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop,), **rules)
        alone, _, _ = generate(target, PROMPT, params)
        assert len(alone) >= 12 and stop not in alone
        if "logit_bias" in rules:
            assert plain[1] not in alone
        assert generate(target, PROMPT, params, drafter)[0] == alone


def test_bad_words_bar_a_words_last_token_where_the_text_ends_with_the_rest_of_it():
    """vLLM's bad_words: a one-token word everywhere; a longer one's last token only in rows whose
    text — the output so far (not the prompt), then the row's path — ends with the rest."""
    params = SamplingParams(max_tokens=8, bad_words=((5,), (7, 8), (1, 2, 3)))
    rules = LogitRules(params, [1, 2], set(), 20, torch.device("cpu"))
    rows = rules.apply(torch.zeros(4, 20), [[], [7], [9, 1, 2], [2]])
    barred = [sorted(torch.nonzero(torch.isinf(row)).flatten().tolist()) for row in rows]
    assert barred == [[5], [5, 8], [3, 5], [5]]  # the prompt's [1, 2] does not count
    rules.record([1])
    assert torch.isinf(rules.apply(torch.zeros(1, 20), [[2]])[0, 3])  # the output's last token, then the path
    guide = rules.guide(torch.device("cpu"))
    guide.record([7])
    assert rules.tail == [1] and guide.tail == [1, 7]  # the draft's copy keeps its own


@pytest.mark.parametrize("mode", ["chain", "tree", "ngram"])
def test_greedy_with_bad_words_every_mode_equals_the_target_alone_and_never_writes_them(tiny, mode):
    target = tiny["llama"]
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    free = generate(target, PROMPT, plain)[0]
    barred_one = generate(target, PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, bad_words=((free[3],),)))[0]
    words = ((free[3],), tuple(barred_one[8:10]))  # a token the free text picks, and a pair written without it
    params = SamplingParams(max_tokens=24, ignore_eos=True, bad_words=words)
    drafter = {"chain": ModelChainDrafter(tiny["llama-draft"], 4),
               "tree": ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3), "ngram": NgramDrafter(3)}[mode]
    alone = generate(target, PROMPT, params)[0]
    output, stats, _ = generate(target, PROMPT, params, drafter)
    assert output == alone != free and alone != barred_one and stats.drafts > 0
    assert words[0][0] not in alone
    assert all(alone[i:i + 2] != list(words[1]) for i in range(len(alone) - 1))
