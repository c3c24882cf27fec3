"""A proposal's rows, adjusted by a request's drawn options all at once (LogitRules.apply over
every node of a tree), are the rows the target alone computes one token at a time along each
node's path: exactly, not only their argmax — what sampled verification reads. No model: drawn
logits, prompts, outputs and trees."""

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specctl.spec.logit_rules import LogitRules
from specctl.spec.sampling import probs_from_logits
from tests.test_combinations import VOCAB, _options

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True)


def _tree_paths(data, tokens: list[int]) -> list[list[int]]:
    """A drawn tree's node paths past the committed text (the root's empty), tokens drawn
    mostly from ``tokens`` so that penalties, bad words and markers meet them."""
    paths = [[]]
    for _ in range(data.draw(st.integers(0, 12))):
        parent = paths[data.draw(st.integers(0, len(paths) - 1))]
        paths.append(parent + [data.draw(st.sampled_from(tokens) | st.integers(0, VOCAB - 1))])
    return paths


def _samplers():
    """Greedy, or temperature with top-k, top-p and min-p in a drawn order."""
    return st.one_of(st.just({}), st.fixed_dictionaries({
        "temperature": st.sampled_from([0.3, 1.0, 1.7]), "top_k": st.sampled_from([0, 1, 5, 40]),
        "top_p": st.sampled_from([1.0, 0.95, 0.5]), "min_p": st.sampled_from([0.0, 0.05, 0.3]),
        "sampler_order": st.sampled_from([(), ("top_k", "top_p", "min_p", "temperature")])}))


def _rules(params, prompt: list[int], stop_ids: set[int]) -> LogitRules:
    return LogitRules(params, prompt, stop_ids, VOCAB, torch.device("cpu"))


@SETTINGS
@given(data=st.data())
def test_every_nodes_row_of_a_drawn_tree_is_the_target_alones_row_after_its_path(data):
    seed = data.draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (data.draw(st.integers(1, 20)),), generator=generator).tolist()
    text = torch.randint(0, VOCAB, (24,), generator=generator).tolist()
    params = dataclasses.replace(_options(data, text), **data.draw(_samplers()))
    if data.draw(st.booleans()):  # a thought's budget over a drawn output, with its end's markers in it
        params = dataclasses.replace(params, thinking_budget=data.draw(st.integers(0, 4)),
                                     thinking_markers=((text[0],), tuple(text[1:data.draw(st.integers(2, 3))])))
    stop_ids = set(data.draw(st.lists(st.sampled_from(text), max_size=2))) | set(params.stop_token_ids)
    committed = text[: data.draw(st.integers(0, 10))]
    paths = _tree_paths(data, text)
    logits = torch.randn(len(paths), VOCAB, generator=generator) * 4

    rules = _rules(params, prompt, stop_ids)
    for token in committed:  # the session's output so far, a token a round
        rules.record([token])
    rows = rules.apply(logits, paths)
    barred = rules.barred.tolist() if rules.barred is not None else [False] * len(paths)

    for r, path in enumerate(paths):
        alone = _rules(params, prompt, stop_ids)
        for token in committed + path:
            alone.record([token])
        row = alone.apply(logits[r : r + 1], [[]])
        assert torch.equal(rows[r : r + 1], row), f"node {r} (path {path}) with {params}"
        # and the distribution sampled verification draws from at the node: the same
        assert torch.equal(probs_from_logits(rows, params)[r : r + 1], probs_from_logits(row, params))
        assert barred[r] == (alone.barred is not None and bool(alone.barred[0]))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_with_a_drawn_grammar_every_reachable_nodes_row_is_the_target_alones_after_its_path(data):
    from specctl.engine.tiny import make_byte_tokenizer
    from specctl.spec.structured import Structure
    from tests.test_combinations import _grammars

    tokenizer, eos, vocab = make_byte_tokenizer(), 256, 320  # the tiny models' vocabulary
    kind, spec, _ = data.draw(_grammars())
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    prompt = tokenizer.encode("answer: ")
    params = dataclasses.replace(_options(data, tokenizer.encode('{"ok": true, "n": 12} yes-a1')),
                                 structured=(kind, spec), ignore_eos=False)
    stop_ids = {eos} | set(params.stop_token_ids)

    def rules() -> LogitRules:
        return LogitRules(params, prompt, stop_ids, vocab, torch.device("cpu"),
                          Structure(kind, spec, tokenizer, vocab, stop_ids, torch.device("cpu")))

    session = rules()

    def allowed_after(path: list[int]) -> list[int]:
        """The tokens the session's rules allow after ``path`` (none where they bar every one:
        the session ends there with NoTokenAllowed)."""
        allowed = session.apply(torch.zeros(1, vocab), [path])[0] > float("-inf")
        return [] if session.barred is not None and session.barred[0] else allowed.nonzero().flatten().tolist()

    committed: list[int] = []
    for _ in range(data.draw(st.integers(0, 6))):  # an output so far the grammar allows
        choices = [t for t in allowed_after([]) if t not in stop_ids]
        if not choices:
            break
        committed.append(data.draw(st.sampled_from(choices)))
        session.record(committed[-1:])
    # a tree whose nodes each follow a token its parent's row allows (a node off the grammar is
    # never reached: refused at its parent's row), or now and then one it refuses
    paths, reachable = [[]], [True]
    for _ in range(data.draw(st.integers(0, 10))):
        parent = data.draw(st.integers(0, len(paths) - 1))
        choices = allowed_after(paths[parent]) if reachable[parent] else []
        refused = not choices or data.draw(st.integers(0, 9)) == 0
        paths.append(paths[parent] + [data.draw(st.integers(0, vocab - 1) if refused else st.sampled_from(choices))])
        reachable.append(reachable[parent] and not refused and paths[parent][-1:] != [eos])
    logits = torch.randn(len(paths), vocab, generator=generator) * 4
    rows = session.apply(logits, paths)

    for r, path in enumerate(paths):
        if not reachable[r] or any(t in stop_ids for t in path):  # the target alone never computes it
            continue
        alone = rules()
        for token in committed + path:
            alone.record([token])
        assert torch.equal(rows[r : r + 1], alone.apply(logits[r : r + 1], [[]])), f"node {r} (path {path})"
        assert session.ended[r] == alone.ended[0]
