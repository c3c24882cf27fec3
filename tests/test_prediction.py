"""OpenAI's Predicted Outputs (spec.prediction): the lookup in the prediction, exactness in every
mode whatever the prediction, the counts usage reports, through the gateway and the command
line. (The sampled distribution with a prediction: tests/test_sampling_exact.py.)"""

import json

import pytest
from hypothesis import given, settings, strategies as st

from specctl.gateway.responses import prediction_details
from specctl.spec.drafters import Drafter, DraftSession, ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.prediction import MAX_NGRAM, MAX_PREDICTED_DEPTH, PREDICTED_DEPTH, NgramIndex, PredictionLookup, next_depth
from specctl.spec.rounds import generate, run_to_end
from specctl.errors import InvalidSamplingParams
from specctl.spec.params import SamplingParams
from tests.conftest import run_here
from tests.test_gateway import _metrics, post, specctl_generate

PROMPT = [1, 5, 9, 2, 7]


def test_the_lookup_follows_the_longest_tail_and_resyncs_after_an_edit():
    lookup = PredictionLookup([10, 11, 12, 13, 10, 11, 14, 15], depth=3)
    assert lookup.next_tokens([99, 10, 11]) == [12, 13, 10]  # (10, 11) ends at 2 and 6: the first, nearest 0
    assert lookup.anchor == (2, 3)
    text = [99, 10, 11, 12, 13, 10]  # 12 and 13 accepted, 10 the bonus
    assert lookup.next_tokens(text) == [11, 14, 15]  # the longest tail, (11, 12, 13, 10), ends at 5
    text += [11, 99]  # the output leaves the prediction: no tail of it is there
    assert lookup.next_tokens(text) == [] and lookup.anchor == (5, 6)
    text += [10, 11]  # and comes back: (10, 11) ends at 2 and 6; 6 is nearest the 9 expected
    assert lookup.next_tokens(text) == [14, 15]
    assert PredictionLookup([10, 11]).next_tokens([5, 11]) == []  # nothing after the match
    assert PredictionLookup([10, 11]).next_tokens([5, 6]) == []  # no match
    assert PredictionLookup([10, 11, 12]).next_tokens([5, 10], min_n=2) == []  # one token is not enough here
    assert PredictionLookup([7, 10, 11, 12]).next_tokens([7, 10], min_n=2) == [11, 12]


def test_of_a_tail_that_repeats_the_match_nearest_where_the_output_is_expected_is_taken():
    """Code repeats itself: the match ending nearest the last match's end plus the output's growth
    since (a tie: the one ahead)."""
    prediction = [1, 2, 3, 1, 2, 4, 1, 2, 5]  # (1, 2) ends at 2, 5 and 8
    text = [9] * 8 + [1, 2]
    for anchor, expected in (((0, None), [3]), ((6, 9), [5]), ((3, 9), [4]), ((2, 10), [3]), ((4, 10), [4])):
        lookup = PredictionLookup(prediction, depth=1)
        lookup.anchor = anchor
        assert lookup.next_tokens(text) == expected, anchor
    tied = PredictionLookup([1, 2, 7, 7, 1, 2, 8], depth=1)  # (1, 2) ends at 2 and 6, both 2 from 4
    tied.anchor = (4, 10)
    assert tied.next_tokens(text) == [8]


def test_the_depth_doubles_while_whole_chains_are_accepted_and_falls_at_a_rejection():
    assert (PREDICTED_DEPTH, MAX_PREDICTED_DEPTH) == (15, 63)  # depth + 1 fills a bucket
    assert next_depth(15, 15, 15) == 31 and next_depth(31, 31, 31) == 63 and next_depth(63, 63, 63) == 63
    assert next_depth(31, 20, 20) == 31  # the prediction ran out: nothing learned about going further
    assert next_depth(63, 63, 40) == 40 and next_depth(31, 31, 1) == PREDICTED_DEPTH
    assert next_depth(15, 15, 0) == 15


def test_a_session_following_its_prediction_proposes_longer_chains_and_shorter_after_an_edit(tiny):
    """The target's own output as the prediction: 15, 31, 63 tokens proposed; with an edit the
    round after the one that meets it proposes what that one accepted, and chains grow again
    once the output follows the prediction."""
    target = tiny["llama"]
    plain = SamplingParams(max_tokens=160, ignore_eos=True)
    alone, _, _ = generate(target, PROMPT, plain)

    def predicted_rounds(prediction: list[int]) -> list[tuple[int, int]]:
        rounds: list[tuple[int, int]] = []
        params = SamplingParams(max_tokens=160, ignore_eos=True, prediction=tuple(prediction))
        session = run_to_end(target, PROMPT, params, on_tokens=lambda tokens, result: rounds.append(
            (result.nodes, result.accepted)) if result is not None and result.predicted else None)
        assert session.output == alone
        return rounds

    assert predicted_rounds(alone)[:3] == [(15, 15), (31, 31), (63, 63)]
    edited = predicted_rounds(alone[:40] + [0, 0, 0] + alone[43:])  # token 0 never comes
    assert 0 not in alone
    # 1 + 15 + 1 tokens before the edit, 23 accepted of the next 31; then the 23 accepted, and
    # (once fewer are) PREDICTED_DEPTH until a whole chain is accepted again
    assert edited[:5] == [(15, 15), (31, 23), (23, 0), (PREDICTED_DEPTH, 13), (PREDICTED_DEPTH, 0)]
    assert edited[-3:] == [(15, 15), (31, 31), (40, 40)]  # 40: what max_tokens left, less the bonus


def test_a_predicted_chain_stops_where_max_tokens_does(tiny):
    """A prediction longer than the answer may be: the last rounds propose no more than the
    output still takes besides the bonus, so no row past max_tokens is verified and the stats
    count only predicted tokens that are in the output."""
    target = tiny["llama"]
    alone, _, _ = generate(target, PROMPT, SamplingParams(max_tokens=160, ignore_eos=True))
    rounds: list[tuple[int, int, int]] = []
    params = SamplingParams(max_tokens=20, ignore_eos=True, prediction=tuple(alone))
    session = run_to_end(target, PROMPT, params, on_tokens=lambda tokens, result: rounds.append(
        (result.nodes, result.accepted, len(tokens))) if result is not None else None)
    assert session.output == alone[:20]
    # the prefill's token, 15 + its bonus, then 2 + its bonus: 20 (a chain of 15 before the fix)
    assert rounds == [(15, 15, 16), (2, 2, 3)]
    assert (session.stats.prediction_accepted, session.stats.prediction_rejected) == (17, 0)


def test_a_match_the_output_has_moved_past_is_not_taken_again():
    """In a run of one token the same tail matches at the same place round after round: once the
    text has grown, matches past the last one's end come first; one behind only when none is."""
    lookup = PredictionLookup([5, 5, 5, 5, 0, 5, 5, 5, 5, 5, 5, 9], depth=2)
    assert lookup.next_tokens([1, 5, 5, 5, 5]) == [0, 5] and lookup.anchor == (4, 5)
    assert lookup.next_tokens([1, 5, 5, 5, 5, 5]) == [5, 5]  # 0 rejected: ends at 9 (4 is nearer, passed)
    assert lookup.anchor == (9, 6)
    repeating = PredictionLookup([1, 2, 3, 4], depth=2)
    assert repeating.next_tokens([8, 1, 2]) == [3, 4]
    assert repeating.next_tokens([8, 1, 2, 7, 1, 2]) == [3, 4]  # nothing past 2: the output repeats itself


def _nearest_end(prediction: list[int], tail: list[int], expected: int, past: int) -> int | None:
    """The lookup's rule written out over every position: the reference the index must agree with."""
    ends = [end for end in range(len(tail), len(prediction) + 1)
            if prediction[end - len(tail):end] == tail and end > past]
    ahead = min((end for end in ends if end >= expected), default=None)
    behind = max((end for end in ends if end < expected), default=None)
    if ahead is None or (behind is not None and expected - behind < ahead - expected):
        return behind
    return ahead


@settings(max_examples=300, deadline=None)
@given(prediction=st.lists(st.integers(0, 3), max_size=60), tail=st.lists(st.integers(0, 3), min_size=1, max_size=4),
       expected=st.integers(0, 64), past=st.integers(-1, 64))
def test_the_indexed_match_is_the_nearest_of_every_position(prediction, tail, expected, past):
    assert PredictionLookup(prediction)._match_end(tail, expected, past) == _nearest_end(prediction, tail, expected, past)


def test_the_index_finds_each_ngrams_ends_and_a_long_run_in_one_step():
    index = NgramIndex([0, 7, 0, 7, 0])
    assert index.ends([0]).tolist() == [1, 3, 5] and index.ends([0, 7]).tolist() == [2, 4]
    assert index.ends([7, 0, 7, 0]).tolist() == [5] and index.ends([7, 7]).tolist() == [] and index.ends([9]).tolist() == []
    assert NgramIndex([]).ends([1]).tolist() == []
    run = PredictionLookup([5] * 131072)  # every position ends a [5, 5, 5]: the first candidate compared matches
    compared = []
    run.prediction = _Counting(run.prediction, compared)
    assert run.next_tokens([1, 6, 5, 5, 5], min_n=2) == [5] * PREDICTED_DEPTH and len(compared) == 1


class _Counting(list):
    """A list that records the slices a lookup compares with a tail."""

    def __init__(self, items, log: list) -> None:
        super().__init__(items)
        self.log = log

    def __getitem__(self, item):
        if isinstance(item, slice) and item.stop - item.start <= MAX_NGRAM:  # a tail's length: a comparison
            self.log.append(item)
        return super().__getitem__(item)


def test_a_prediction_is_bounded_and_must_be_token_ids():
    with pytest.raises(InvalidSamplingParams, match=r"^prediction is at most 131072 token ids \(>= 0\)$"):
        SamplingParams(prediction=(1, -2))
    with pytest.raises(InvalidSamplingParams, match="prediction is at most"):
        SamplingParams(prediction=(0,) * 131073)


@pytest.mark.parametrize("mode", ["ar", "chain", "tree", "ngram"])
def test_greedy_output_is_the_target_alones_whatever_the_prediction(tiny, mode):
    """The target's own output as the prediction (few rounds, nearly all of it accepted), the
    same with an edit in the middle, and one that never matches: the same tokens every time;
    the draft of the other rounds is told what the predicted rounds committed."""
    target, draft = tiny["llama"], tiny["llama-draft"]
    drafters = {"ar": lambda: None, "chain": lambda: ModelChainDrafter(draft, 4),
                "tree": lambda: ModelTreeDrafter(draft, 3, 2, 3), "ngram": lambda: NgramDrafter(3)}
    plain = SamplingParams(max_tokens=48, ignore_eos=True)
    alone, alone_stats, _ = generate(target, PROMPT, plain)
    edited = alone[:20] + [3, 3, 3] + alone[24:]
    for prediction in (alone, edited, [0] * 5):
        params = SamplingParams(max_tokens=48, ignore_eos=True, prediction=tuple(prediction))
        output, stats, _ = generate(target, PROMPT, params, drafters[mode]())
        assert output == alone, prediction
        if prediction is alone:  # whole chains of it accepted: a first round of PREDICTED_DEPTH + 1 tokens
            assert stats.rounds <= -(-(len(alone) - 1) // (PREDICTED_DEPTH + 1)) + 1 < alone_stats.rounds
            assert stats.prediction_accepted >= len(alone) - 1 - stats.rounds
        if prediction == [0] * 5:  # token 0 never comes: nothing predicted
            assert 0 not in alone and stats.prediction_accepted == stats.prediction_rejected == 0


class _Hearing(Drafter):
    """A drafter that records, per outcome it is told, whether rounds came between (``rounds_between``)."""

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.max_nodes, self.heard = inner, inner.max_nodes, []

    def open(self, capacity, pool=None):
        inner, heard = self.inner.open(capacity, pool), self.heard
        between = []

        class _Session(DraftSession):
            def propose(self, seq, params, generator):
                return inner.propose(seq, params, generator)

            def rounds_between(self):
                between.append(True)

            def on_verified(self, path):
                heard.append(bool(between))
                between.clear()
                inner.on_verified(path)

            def close(self):
                inner.close()

        return _Session()


def test_a_draft_is_told_when_predicted_rounds_came_between_its_proposal_and_its_outcome(tiny):
    """So that a drafter timing its rounds (spec.pays) does not count the predicted rounds' time
    as its own; after a round of its own nothing came between."""
    target, draft = tiny["llama"], tiny["llama-draft"]
    alone, _, _ = generate(target, PROMPT, SamplingParams(max_tokens=64, ignore_eos=True))
    edited = alone[:12] + alone[40:]  # rounds go: predicted, the draft's, predicted again, ...
    predicted: list[bool] = []
    params = SamplingParams(max_tokens=64, ignore_eos=True, prediction=tuple(edited))
    drafter = _Hearing(ModelChainDrafter(draft, 4))
    session = run_to_end(target, PROMPT, params, drafter, on_tokens=lambda tokens, result: predicted.append(
        result.predicted) if result is not None else None)
    assert session.output == alone
    # each of the draft's rounds but its last is told an outcome: whether the next of its rounds came after predicted ones
    own = [i for i, by_prediction in enumerate(predicted) if not by_prediction]
    expected = [later - earlier > 1 for earlier, later in zip(own, own[1:])]
    assert drafter.heard == expected and True in expected and False in expected


def _lcs(a: list[int], b: list[int]) -> int:
    """The longest common subsequence's length by the textbook table (rapidfuzz computes it bit-parallel)."""
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], (diagonal + 1 if x == y else max(row[j], row[j - 1]))
    return row[-1]


def test_usage_counts_the_prediction_s_tokens_found_in_each_choice_and_the_rest():
    details = lambda accepted, rejected: {"accepted_prediction_tokens": accepted,  # noqa: E731
                                          "rejected_prediction_tokens": rejected}
    assert prediction_details([1, 2, 3, 4, 5], [[1, 3, 5, 9], [2, 3]]) == details(5, 5)
    assert prediction_details(list(range(10)), [[0, 1, 2]]) == details(3, 7)  # an answer cut short: its tail rejected
    assert prediction_details([7, 7], [[7, 1, 7, 7]]) == details(2, 0)  # each predicted token found once at most
    assert prediction_details([], [[1, 2]]) == details(0, 0)


@given(st.lists(st.integers(0, 5), max_size=30), st.lists(st.lists(st.integers(0, 5), max_size=30), min_size=1,
                                                           max_size=3))
def test_usage_s_prediction_counts_are_the_longest_common_subsequence(prediction, outputs):
    found = sum(_lcs(prediction, output) for output in outputs)
    rejected = len(prediction) * len(outputs) - found
    assert prediction_details(prediction, outputs) == {"accepted_prediction_tokens": found,
                                                       "rejected_prediction_tokens": rejected}


def test_a_chat_prediction_gives_the_same_answer_and_counts_its_tokens(cluster, tiny_dir):
    """Through the gateway (the prediction travels to the target instance): the answer of the
    same request without it, usage's completion_tokens_details, whole and streamed; bad
    predictions are 400s."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir["llama"])
    base = cluster[1]["gateway"]
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    code, _, raw = post(base + "/v1/chat/completions", body)
    assert code == 200
    plain = json.loads(raw)
    answer = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]  # only with a prediction
    for content in (answer, [{"type": "text", "text": answer[:10]}, {"type": "text", "text": answer[10:]}]):
        _, before = _metrics(base)
        code, _, raw = post(base + "/v1/chat/completions", {**body, "return_token_ids": True,
                                                             "prediction": {"type": "content", "content": content}})
        assert code == 200, raw
        predicted = json.loads(raw)
        assert predicted["choices"][0]["message"]["content"] == answer
        # usage as OpenAI defines it: the prediction's tokens found in the answer, and the rest
        expected = tokenizer.encode(answer, add_special_tokens=False)  # both contents are the answer's text
        found = _lcs(expected, predicted["choices"][0]["token_ids"])
        assert predicted["usage"]["completion_tokens_details"] == {
            "accepted_prediction_tokens": found, "rejected_prediction_tokens": len(expected) - found}
        assert found > 0 and predicted["specctl"]["rounds"] < plain["specctl"]["rounds"]
        _, after = _metrics(base)  # /metrics counts what verification took of the prediction and turned down
        assert after["specctl:prediction_accepted_tokens_total"] > before["specctl:prediction_accepted_tokens_total"]
        assert after["specctl:prediction_rejected_tokens_total"] >= before["specctl:prediction_rejected_tokens_total"]
    import urllib.request

    request = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": "hello world", "max_tokens": 16, "temperature": 0,
                                                      "stream": True, "stream_options": {"include_usage": True},
                                                      "prediction": {"type": "content", "content": "x y z"}}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == specctl_generate(
        tiny_dir, "hello world", 16)["text"]
    assert set(chunks[-1]["usage"]["completion_tokens_details"]) == {"accepted_prediction_tokens",
                                                                     "rejected_prediction_tokens"}
    for bad, message in (({"type": "file", "content": "x"}, "prediction.type must be 'content', got 'file'"),
                         ({"type": "content", "content": [{"type": "image_url"}]},
                          "prediction.content parts must be text, got ['image_url']"),
                         ({"type": "content", "content": "x" * 600},  # the byte tokenizer: a token a character
                          "prediction is 600 tokens, longer than the model's context (512): give the part of the "
                          "answer you expect"),
                         ({"type": "content", "content": "x" * (512 * 14 + 1)},  # refused before it is tokenized
                          "prediction is 7169 characters, longer than the model's context (512 tokens) however it "
                          "is split: give the part of the answer you expect")):
        code, _, raw = post(base + "/v1/chat/completions", {**body, "prediction": bad})
        assert code == 400 and json.loads(raw)["error"] == {"message": message, "type": "invalid_request_error",
                                                             "param": "prediction", "code": None}


def test_generate_prediction_flag_gives_the_same_tokens_in_fewer_rounds(tiny_dir, tmp_path):
    def run(*flags) -> dict:
        proc = run_here("generate", "--target", str(tiny_dir["llama"]), "--draft", str(tiny_dir["llama-draft"]),
                        "--prompt", "hello world", "--max-tokens", "40", "--dtype", "fp32", "--json", "--mode",
                        "chain", *flags)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    plain = run()
    (tmp_path / "prediction.txt").write_text(plain["text"])
    predicted = run("--prediction", f"@{tmp_path / 'prediction.txt'}")
    assert predicted["token_ids"] == plain["token_ids"]
    assert predicted["stats"]["prediction_accepted"] > 0 and plain["stats"]["prediction_accepted"] == 0
    proc = run_here("generate", "--prompt", "x", "--prediction", "@/no/such/file")
    assert proc.returncode == 2 and "cannot read /no/such/file: No such file or directory" in proc.stderr
