"""``generate --logprobs / --prompt-logprobs``: vLLM's offline shape of the target's
log-probabilities, from a local session's lists and from a target instance's TOKENS frames."""

import io
import math

from rich.console import Console

from specctl.cli import logprob_report
from specctl.net.protocol import Tokens

PROMPT = [5, 6, 7]
NAMES = {5: "a", 6: "b", 7: "c", 8: "d", 9: "e"}


def text(token: int) -> str:
    return NAMES[token]


def test_frames_and_a_local_session_give_the_same_entries():
    """The first frame carries the prompt's scores (even with no token); the output's come per
    frame, each token with its rank in its row — from a peer that sent none, its rank among its
    alternatives where it is one, else None (below those listed)."""
    scores, older = logprob_report.Scores(PROMPT), logprob_report.Scores(PROMPT)
    for frames, ranks in ((scores, ([1, 4], [1])), (older, ([], []))):
        frames.add(Tokens(req=1, tokens=[], prompt_logprobs=[-1.0, -2.0], prompt_top_ids=[[6], [8]],
                          prompt_top_logprobs=[[-1.0], [-0.5]], prompt_ranks=[1, 3]))
        frames.add(Tokens(req=1, tokens=[8, 9], logprobs=[-0.1, -3.0], top_ids=[[8], [5]],
                          top_logprobs=[[-0.1], [-0.2]], ranks=ranks[0]))
        frames.add(Tokens(req=1, tokens=[5], logprobs=[-0.3], top_ids=[[5]], top_logprobs=[[-0.3]], ranks=ranks[1]))
    local = logprob_report.local_scores(PROMPT, [8, 9, 5], [(-0.1, [8], [-0.1], 1), (-3.0, [5], [-0.2], 4),
                                                            (-0.3, [5], [-0.3], 1)],
                                        [(-1.0, [6], [-1.0], 1), (-2.0, [8], [-0.5], 3)])
    assert scores.output == local.output and scores.prompt_entries == local.prompt_entries
    assert [entry.rank for entry in scores.output] == [1, 4, 1]
    assert [entry.rank for entry in older.output] == [1, None, 1]
    body = logprob_report.as_json(older, 1, 1, text)
    assert body["prompt_logprobs"] == [
        None,
        {"6": {"logprob": -1.0, "rank": 1, "decoded_token": "b"}},
        {"7": {"logprob": -2.0, "rank": 3, "decoded_token": "c"}, "8": {"logprob": -0.5, "rank": 1,
                                                                        "decoded_token": "d"}}]
    assert body["logprobs"][1] == {"9": {"logprob": -3.0, "rank": None, "decoded_token": "e"},
                                   "5": {"logprob": -0.2, "rank": 1, "decoded_token": "a"}}


def test_only_what_was_asked_for_is_in_the_json():
    scores = logprob_report.local_scores(PROMPT, [8], [(-0.1, [], [], None)], None)
    assert logprob_report.as_json(scores, None, None, text) == {}
    assert logprob_report.as_json(scores, 0, None, text) == {
        "logprobs": [{"8": {"logprob": -0.1, "rank": None, "decoded_token": "d"}}]}
    assert "prompt_logprobs" not in logprob_report.as_json(scores, None, 2, text)  # not scored: nothing to show


def test_the_table_has_a_row_a_token_with_its_probability_rank_and_alternatives():
    scores = logprob_report.local_scores(PROMPT, [8, 9], [(math.log(0.5), [8, 9], [math.log(0.5), -1.5], 1),
                                                          (-3.0, [5], [-0.2], None)],
                                         [(-1.0, [], [], 4), (-2.0, [], [], 2)])
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(logprob_report.table("logprobs", scores.output, text))
    console.print(logprob_report.table("prompt logprobs", scores.prompt_entries, text))
    lines = [line.split() for line in console.export_text().splitlines()]
    assert ["0", "│", "'d'", "│", "-0.6931", "│", "50.0%", "│", "1", "│", "'d'", "-0.69", "'e'", "-1.50"] in lines
    assert ["1", "│", "'e'", "│", "-3.0000", "│", "5.0%", "│", "-", "│", "'a'", "-0.20"] in lines
    assert ["0", "│", "'a'", "│", "-", "│", "-", "│", "-", "│"] in lines  # the prompt's first token: nothing before it
    assert ["2", "│", "'c'", "│", "-2.0000", "│", "13.5%", "│", "2", "│"] in lines
    assert len(lines) == 2 * 3 + 5  # a title, a header and a rule a table; 2 + 3 rows
