"""vLLM's thinking_token_budget (spec.thinking_budget): where a thought stands after a text, the
token forced once it has used its budget, and the same tokens in every mode (the rule is the
target's, applied to every proposal row)."""

import pytest
from hypothesis import given, settings, strategies as st

from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.rounds import generate
from specctl.errors import InvalidSamplingParams
from specctl.spec.params import SamplingParams
from specctl.spec.thinking_budget import ThinkingBudget, Thought

START, END = 50, 60  # the tiny models' <think> and </think> here: tokens like any other


def test_a_thought_counts_its_tokens_from_its_start_and_ends_at_its_budget():
    rule = ThinkingBudget(3, (START,), (END,))
    assert rule.of_prompt([1, 2, 3]) == Thought(False, 0, (3,)) and rule.forced(rule.of_prompt([1, 2, 3])) is None
    opened = rule.of_prompt([1, START, 9])  # a template that opened the thought: its tokens after <think> count
    assert opened == Thought(True, 1, (9,)) and rule.forced(opened) is None
    assert rule.forced(rule.after(opened, [4, 4])) == END  # 3 used: </think> next
    assert rule.of_prompt([START, 9, END, 7]).thinking is False  # an earlier thought, ended
    ended = rule.after(opened, [4, END, 4, 4, 4, 4])  # ended by itself within its budget: nothing forced after
    assert ended == Thought(False, 0, (4,)) and rule.forced(ended) is None
    again = rule.after(ended, [START, 1, 2])  # a later thought counts afresh
    assert again.used == 2 and rule.forced(again) is None and rule.forced(rule.after(again, [3])) == END
    assert rule.after(opened, [START]).used == 0  # a <think> inside a thought starts its count again


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(0, 6), prompt=st.lists(st.integers(0, 4), max_size=8),
       wanted=st.lists(st.integers(0, 4), max_size=40))
def test_no_thought_outlasts_its_budget_whatever_is_written(budget, prompt, wanted):
    """Tokens 0..4, <think> = 3, </think> = 4: a text written token by token, each the one wanted
    unless one is forced, never holds more than ``budget`` tokens between a <think> and its
    </think> (or the text's end); a thought that reached its budget ends on the next token."""
    rule = ThinkingBudget(budget, (3,), (4,))
    state, text = rule.of_prompt(prompt), list(prompt)
    for token in wanted:
        forced = rule.forced(state)
        token = token if forced is None else forced
        text.append(token)
        state = rule.after(state, [token])
    inside, run = False, 0
    for i, token in enumerate(text):
        if inside and token == 4:
            inside = False
        elif token == 3:
            inside, run = True, 0
        elif inside:
            run += 1
            assert run <= budget or i < len(prompt), (text, i)  # a prompt's thought is the prompt's


def test_a_text_markers_last_token_alone_is_no_marker():
    """Markers of several tokens (a tokenizer without <think> tokens): a lone ">" later in the
    prompt does not hide the thought a whole <think> opened before it."""
    rule = ThinkingBudget(5, (1, 2, 9), (1, 3, 9))  # "<think>" and "</think>" sharing their first and last tokens
    state = rule.of_prompt([7, 1, 2, 9, 4, 9, 4])  # <think>, then "a > b": 3 tokens in thought
    assert state.thinking and state.used == 3
    assert not rule.of_prompt([1, 2, 9, 4, 1, 3, 9, 4, 9]).thinking  # closed, then a lone ">"


def test_an_end_of_several_tokens_is_forced_token_by_token_and_budget_zero_ends_at_once():
    rule = ThinkingBudget(0, (7, 8), (60, 61, 62))
    state = rule.of_prompt([1, 7, 8])
    assert rule.forced(state) == 60
    state = rule.after(state, [60])
    assert rule.forced(state) == 61
    state = rule.after(state, [61])
    assert rule.forced(state) == 62 and rule.after(state, [62]).thinking is False
    with pytest.raises(ValueError, match="a thinking budget is >= 0 tokens, with start and end markers of 1 to 8"):
        ThinkingBudget(-1, (7,), (8,))


def test_sampling_params_check_the_budget_and_its_markers():
    with pytest.raises(InvalidSamplingParams, match=r"^thinking_budget must be a non-negative integer, got -2$"):
        SamplingParams(thinking_budget=-2, thinking_markers=((1,), (2,)))
    with pytest.raises(InvalidSamplingParams, match=r"^thinking_budget needs the thinking's start and end markers"):
        SamplingParams(thinking_budget=4)
    assert SamplingParams(thinking_budget=0, thinking_markers=((1,), (2,))).adjusts_logits


@pytest.mark.parametrize("mode", ["chain", "tree", "ngram", "self", "prediction"])
def test_every_mode_gives_the_target_alones_tokens_with_the_thought_cut_at_its_budget(tiny, mode):
    target, draft = tiny["llama"], tiny["llama-draft"]
    prompt = [1, 5, 9, 2, 7, START]  # the prompt opened a thought
    free, _, _ = generate(target, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    assert END not in free[:4]
    params = SamplingParams(max_tokens=24, ignore_eos=True, thinking_budget=3, thinking_markers=((START,), (END,)))
    alone, _, _ = generate(target, prompt, params)
    assert alone[:3] == free[:3] and alone[3] == END and alone != free
    drafters = {"chain": lambda: ModelChainDrafter(draft, 4), "tree": lambda: ModelTreeDrafter(draft, 3, 2, 3),
                "ngram": lambda: NgramDrafter(3), "self": lambda: ModelChainDrafter(target, 4),
                "prediction": lambda: None}
    if mode == "prediction":  # the unbudgeted output as the prediction: its 4th token is rejected
        params = SamplingParams(max_tokens=24, ignore_eos=True, thinking_budget=3, thinking_markers=((START,), (END,)),
                                prediction=tuple(free))
    assert generate(target, prompt, params, drafters[mode]())[0] == alone


def test_a_sampled_thought_is_cut_at_its_budget_too(tiny):
    target, draft = tiny["llama"], tiny["llama-draft"]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=5, thinking_budget=2,
                            thinking_markers=((START,), (END,)))
    for drafter in (None, ModelChainDrafter(draft, 4)):
        output, _, _ = generate(target, [1, 5, START], params, drafter)
        assert END in output and output.index(END) <= 2  # by itself within the budget, or forced


async def test_over_tcp_the_draft_server_follows_the_budget_and_the_tokens_are_the_target_alones(tiny_dir, monkeypatch):
    """The budget travels in GENERATE to the target instance and in OPEN_SESSION to the draft
    server, whose guide forces the same end (its proposals then agree at the cut)."""
    from specctl.engine.loader import load_model
    from specctl.verify.client import remote_generate
    from tests.test_star import start_star, stop_star

    models = (load_model("tiny-llama", tiny_dir["llama"], "fp32"),
              load_model("tiny-llama@2", tiny_dir["llama"], "fp32", num_layers=2))
    params = SamplingParams(max_tokens=20, ignore_eos=True, thinking_budget=4, thinking_markers=((START,), (END, 61)))
    prompt = [1, 5, 9, START]
    alone, _, _ = generate(models[0].decoder, prompt, params)
    assert alone[4:6] == [END, 61]
    draft_server, _, _, link, target_server, port = await start_star(models)
    guides, opened = [], type(draft_server.table).open

    def open_and_look(table, tag, message, *args, **kwargs):
        result = opened(table, tag, message, *args, **kwargs)
        guides.append(table.states[tag].session.guide)
        return result

    monkeypatch.setattr(type(draft_server.table), "open", open_and_look)
    try:
        tokens, _, _ = await remote_generate("127.0.0.1", port, prompt, params)
        assert tokens == alone
        (guide,) = guides
        assert (guide.thinking.budget, guide.thinking.start, guide.thinking.end) == (4, (START,), (END, 61))
        assert not guide.thought.thinking  # the prompt opened a thought; the draft saw it end at the cut
    finally:
        await stop_star(draft_server, link, target_server)


def test_markers_past_the_vocabulary_are_refused_by_name():
    from specctl.errors import BadRequest
    from specctl.spec.logit_rules import check_rule_token_ids

    params = SamplingParams(thinking_budget=1, thinking_markers=((5,), (400, 3)))
    with pytest.raises(BadRequest, match=r"^thinking_token_budget's markers must be in \[0, 384\), got 3\.\.400$"):
        check_rule_token_ids(params, 384)
    check_rule_token_ids(params, 401)


def test_generate_thinking_budget_forces_the_end_in_every_mode(tiny_dir):
    """``specctl generate --thinking-budget N``: the tokenizer's markers (the tiny byte tokenizer has
    none of its own: their text's tokens), the same tokens in AR and chain; a negative budget is refused
    before anything loads."""
    import json

    from specctl.engine.tiny import make_byte_tokenizer
    from tests.conftest import run_here

    def run(*flags) -> dict:
        proc = run_here("generate", "--target", str(tiny_dir["llama"]), "--draft", str(tiny_dir["llama-draft"]),
                        "--prompt", "why<think>", "--max-tokens", "16", "--dtype", "fp32", "--json", *flags)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    end = make_byte_tokenizer().encode("</think>", add_special_tokens=False)
    cut = run("--mode", "ar", "--thinking-budget", "2")
    assert cut["token_ids"][2:2 + len(end)] == end and "</think>" in cut["text"]  # after the thought's 2 tokens
    assert run("--mode", "chain", "--thinking-budget", "2")["token_ids"] == cut["token_ids"]
    assert run("--mode", "ar")["token_ids"][2:2 + len(end)] != end
    proc = run_here("generate", "--prompt", "x", "--thinking-budget", "-1")
    assert proc.returncode == 2 and "--thinking-budget must be 0 or more tokens, got -1" in proc.stderr
