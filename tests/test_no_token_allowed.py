"""Rules that bar every token: a request's allowed_token_ids, bad_words, min_tokens, grammar and
thinking budget can together leave the target no token to write (found by tests/test_combinations.py: greedy
decoding then wrote token 0 — outside allowed_token_ids, or outside the grammar, where the
grammar's record failed — and sampling failed with "no mass" or an index of -1). Now such a
session ends with NoTokenAllowed (a 400) where the target alone would take that token, in every
mode and after the same output; a draft's row barred where the target never goes costs nothing."""

import json

import pytest
import torch

from specctl.engine.kv_cache import KVPool
from specctl.errors import BadRequest, NoTokenAllowed
from specctl.spec.logit_rules import LogitRules
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.multi import MultiDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate, run_to_end
from specctl.spec.sampling import probs_from_logits
from tests.test_gateway import PROMPT as TEXT
from tests.test_gateway import post

PROMPT = [1, 2, 3]
# after the first 5, both words bar the only other allowed token: the tiny llama writes 5 first
CORNERED = dict(max_tokens=12, ignore_eos=True, allowed_token_ids=(5, 6), bad_words=((5, 6), (5, 5)))
MESSAGE = ("no token is left to write after 1 of output: the request's allowed_token_ids, bad_words, min_tokens, "
           "grammar and thinking budget together bar every one; loosen them")


def _drafters(tiny):
    draft = tiny["llama-draft"]
    return {"ar": None, "chain": ModelChainDrafter(draft, 3), "tree": ModelTreeDrafter(draft, 3, 2, 3),
            "ngram": NgramDrafter(3),
            "multi": MultiDrafter({"draft": ModelChainDrafter(draft, 3), "ngram": NgramDrafter(3)})}


def test_a_barred_row_takes_token_0_as_its_argmax_would_and_other_rows_are_untouched():
    rules = LogitRules(SamplingParams(allowed_token_ids=(1, 2), bad_words=((1,), (3, 2))), [4], set(), 5,
                       torch.device("cpu"))
    logits = torch.tensor([[0.5, 1.0, 2.0, 3.0, 4.0]] * 2)
    adjusted = rules.apply(logits, [[], [3]])  # after 3, both allowed tokens are barred
    assert adjusted.tolist() == [[float("-inf"), float("-inf"), 2.0, float("-inf"), float("-inf")],
                                 [0.0] + [float("-inf")] * 4]
    assert rules.barred_at([1, 0]) == [True, False] and logits[1, 0] == 0.5  # the caller's logits untouched
    assert probs_from_logits(adjusted, SamplingParams(temperature=0.7))[1].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("mode", ["ar", "chain", "tree", "ngram", "multi"])
def test_greedy_rules_that_bar_every_token_end_every_mode_after_the_same_output(tiny, mode):
    pool = KVPool(64 << 20)
    with pytest.raises(NoTokenAllowed) as caught:
        run_to_end(tiny["llama"], PROMPT, SamplingParams(**CORNERED), _drafters(tiny)[mode], pool=pool)
    assert str(caught.value) == MESSAGE and isinstance(caught.value, BadRequest)
    assert pool.used_bytes == 0  # the session's KV freed


@pytest.mark.parametrize("mode", ["ar", "chain", "tree", "ngram"])
def test_sampled_rules_that_bar_every_token_end_with_the_same_error_not_a_failed_draw(tiny, mode):
    for seed in range(3):
        params = SamplingParams(temperature=0.8, seed=seed, **CORNERED)
        with pytest.raises(NoTokenAllowed, match="^no token is left to write after "):
            generate(tiny["llama"], PROMPT, params, _drafters(tiny)[mode])


def test_a_grammar_and_allowed_ids_with_nothing_in_common_end_before_any_output(tiny):
    from specctl.engine.tiny import make_byte_tokenizer

    tokenizer = make_byte_tokenizer()
    params = SamplingParams(max_tokens=8, structured=("choice", json.dumps(["yes", "no"])),
                            allowed_token_ids=tuple(tokenizer.encode("abc")))
    for drafter in (None, ModelChainDrafter(tiny["llama-draft"], 3)):
        with pytest.raises(NoTokenAllowed, match="^no token is left to write after 0 of output"):
            generate(tiny["llama"], tokenizer.encode("x"), params, drafter, eos_token_ids=(256,), tokenizer=tokenizer)


def test_a_thought_s_forced_end_that_the_grammar_refuses_ends_before_any_output(tiny):
    """A budget of 0 forces the thought's end (token 0, "!") where a grammar over the whole text
    wants "s": the grammar's record used to fail on it ("committed tokens outside the grammar")."""
    from specctl.engine.tiny import make_byte_tokenizer

    tokenizer = make_byte_tokenizer()
    params = SamplingParams(max_tokens=8, structured=("regex", "s[a-c]{1,3}"), thinking_budget=0,
                            thinking_markers=((tokenizer.encode("x")[0],), (0,)))
    for drafter in (None, ModelChainDrafter(tiny["llama-draft"], 3)):
        with pytest.raises(NoTokenAllowed, match="^no token is left to write after 0 of output"):
            generate(tiny["llama"], tokenizer.encode("x"), params, drafter, eos_token_ids=(256,), tokenizer=tokenizer)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_draft_row_barred_where_the_target_never_goes_costs_nothing(tiny, temperature, monkeypatch):
    """The bias keeps the target on 6, so its rows always hold a token; a tree's second child (5)
    leads the draft into rows with none."""
    empty_rows, apply = [], LogitRules.apply

    def counted(rules, logits, paths):
        adjusted = apply(rules, logits, paths)
        empty_rows.append(int(rules.barred.sum()))
        return adjusted

    monkeypatch.setattr(LogitRules, "apply", counted)
    params = SamplingParams(temperature=temperature, seed=4, logit_bias=((6, 6.0),), **CORNERED)
    alone = generate(tiny["llama"], PROMPT, params)[0]
    assert set(alone) == {6}
    output, stats, _ = generate(tiny["llama"], PROMPT, params, ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3))
    assert len(output) == 12 and set(output) == {6} and stats.drafts > 0 and sum(empty_rows) > 0
    if temperature == 0.0:
        assert output == alone


def test_through_the_gateway_it_is_the_request_s_400_and_the_next_request_is_served(cluster):
    """The one allowed token is a stop token, barred until min_tokens are out."""
    base = cluster[1]["gateway"]
    ids = json.loads(post(base + "/tokenize", {"prompt": TEXT})[2])["tokens"]
    code, _, raw = post(base + "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                   "allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 2})
    assert code == 400, raw
    assert json.loads(raw)["error"]["message"] == (
        "target instance: generation failed: no token is left to write after 0 of output: the request's "
        "allowed_token_ids, bad_words, min_tokens, grammar and thinking budget together bar every one; loosen them")
    code, _, raw = post(base + "/v1/completions", {"prompt": TEXT, "max_tokens": 3})
    assert code == 200, raw
