"""OpenAI's Predicted Outputs: a request's ``prediction`` — text the answer is expected to
resemble, such as the file being edited — drafted from where the target runs. Each round the
output's last tokens are looked up in the prediction (the longest tail, up to MAX_NGRAM
tokens — two at least once the output has two, since one token matches by chance too often —
and of its matches the one ending nearest where the output is expected) and the tokens after
the match are proposed as a chain; the target verifies it as any draft, so the output is the target's
own — greedy token for token, sampled by the rule for deterministic candidates (a lookup
draws nothing from the target's randomness). A round with no match goes to the session's
usual speculator (a draft server, a drafter here), which is told every token committed since
it last proposed, as a fused drafter is.

The stats count the predicted tokens verification accepted and those it rejected (what the
target actually checked: the stats feed, /metrics). The usage OpenAI reports is another count
— the prediction's tokens found in the answer and the rest — which the gateway aligns at the
end (gateway.responses.prediction_details).

How far to propose adapts (``next_depth``): a round's whole predicted chain accepted doubles
the next one's (up to MAX_PREDICTED_DEPTH: a long unchanged stretch is copied in few rounds),
a rejection falls back to what was accepted, PREDICTED_DEPTH at least (shorter chains at the
chance matches near an edit saved rows but cost rounds where the output rejoined: 209 rounds
on the shipped edits against 195, the same time on this CPU, more on a GPU, where rows are
nearly free)."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from specctl.engine.tree import PlainTree
from specctl.spec.drafters import Proposal
from specctl.spec.rounds import Drafted, Speculator
from specctl.spec.turns import InnerTurns

MAX_NGRAM = 4  # the longest tail of the output looked up in the prediction
# Tokens proposed from the prediction a round: depth + 1 (the root) fills a static step's size
# bucket (engine.static) at each depth it takes.
PREDICTED_DEPTH = 15  # a session's first predicted round, and the least after a rejection
MAX_PREDICTED_DEPTH = 63
PREDICTION_NODES = MAX_PREDICTED_DEPTH + 1  # the largest proposal a session with a prediction verifies (root included)


def next_depth(depth: int, proposed: int, accepted: int) -> int:
    """How many tokens the next predicted round proposes, after one that proposed ``proposed``
    at ``depth`` and had ``accepted`` of them accepted."""
    if accepted >= proposed:
        return min(MAX_PREDICTED_DEPTH, 2 * depth + 1) if proposed == depth else depth
    return max(PREDICTED_DEPTH, accepted)


class PredictionLookup:
    """Where the output goes on in the prediction. The last match anchors it: the output's end
    is expected as far past that match's end as the output has grown since, and of a tail's
    matches the one ending nearest there is taken (a prediction that repeats itself, as code
    does, has many)."""

    def __init__(self, prediction: Sequence[int], depth: int = PREDICTED_DEPTH) -> None:
        self.prediction, self.depth = list(prediction), depth
        self.anchor = (0, None)  # (the last match's end in the prediction, the text's length then)
        self.index = NgramIndex(self.prediction)

    def next_tokens(self, text: Sequence[int], min_n: int = 1) -> list[int]:
        """The prediction's tokens after the longest tail of ``text`` it holds (at most
        ``depth``; [] when no tail of ``min_n`` tokens or more is in it with something after it).
        A caller may change ``depth`` between calls."""
        end_then, length_then = self.anchor
        expected = end_then + (len(text) - length_then if length_then is not None else 0)
        # Once the text has grown, a match ending at or before the last one's end would re-read
        # what the output already followed — in a run of one token (or of a pattern) the same
        # tail matches there round after round while the output has moved on. Matches past it
        # are taken first; one behind only when none is (the output repeating itself).
        past = end_then if length_then is not None and len(text) > length_then else -1
        for n in range(min(MAX_NGRAM, len(text)), min_n - 1, -1):
            tail = list(text[-n:])
            end = self._match_end(tail, expected, past)
            if end is None and past >= 0:
                end = self._match_end(tail, expected, -1)
            if end is not None and end < len(self.prediction):
                self.anchor = (end, len(text))
                return self.prediction[end:end + self.depth]
        return []

    def _match_end(self, tail: list[int], expected: int, past: int) -> int | None:
        """The end of the match of ``tail`` nearest ``expected`` of those ending after ``past``
        (the one at or after ``expected`` on a tie); None without one."""
        ends = self.index.ends(tail)

        def matches(end: int) -> bool:  # a hash shared by another n-gram is not a match
            return self.prediction[end - len(tail):end] == tail

        first = int(np.searchsorted(ends, past, side="right"))  # the first end > past
        at = max(first, int(np.searchsorted(ends, expected)))  # ... and >= expected
        ahead = next((int(end) for end in ends[at:] if matches(end)), None)
        behind = next((int(end) for end in ends[first:at][::-1] if matches(end)), None)
        if ahead is None or (behind is not None and expected - behind < ahead - expected):
            return behind
        return ahead


class NgramIndex:
    """Where each n-gram of a sequence (n = 1..MAX_NGRAM) ends, found in O(log length): per n,
    every position's n-gram hash, sorted (stably, so the ends of equal hashes ascend). A lookup
    then costs the same for a prediction of 131072 tokens of one token as for a file — a scan of
    a token's positions blocked the event loop ~25 ms a round there. ~50 bytes a token; a dict of
    n-gram tuples took ~600 and 2 s to build for 131072."""

    MULTIPLIER = np.uint64(0x100000001B3)  # FNV-1's prime: n-grams of token ids spread over 64 bits

    def __init__(self, tokens: Sequence[int]) -> None:
        ids = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)  # + 1: token 0 still moves the hash
        self.sorted: list[tuple[np.ndarray, np.ndarray]] = []  # per n - 1: (hashes ascending, their n-grams' ends)
        for n in range(1, MAX_NGRAM + 1):
            count = max(len(ids) - n + 1, 0)
            hashes = np.zeros(count, dtype=np.uint64)
            for j in range(n):  # uint64 arithmetic wraps: a polynomial hash mod 2**64
                hashes = hashes * self.MULTIPLIER + ids[j:j + count]
            order = np.argsort(hashes, kind="stable")
            self.sorted.append((hashes[order], (order + n).astype(np.int64)))

    @classmethod
    def key(cls, ngram: Sequence[int]) -> np.uint64:
        value = np.zeros(1, dtype=np.uint64)
        for token in ngram:
            value = value * cls.MULTIPLIER + np.uint64(token + 1)
        return value[0]

    def ends(self, ngram: Sequence[int]) -> np.ndarray:
        """The ends (exclusive) of the positions whose n-gram hashes as ``ngram`` does, ascending;
        almost always exactly ``ngram``'s occurrences (a caller compares the tokens)."""
        hashes, ends = self.sorted[len(ngram) - 1]
        key = self.key(ngram)
        return ends[np.searchsorted(hashes, key, side="left"):np.searchsorted(hashes, key, side="right")]


class PredictionSpeculator:
    """A speculator that drafts from the request's prediction where the output follows it, and
    asks ``inner`` (which takes an ``outcome``: RemoteSpeculator, LocalSpeculator,
    FusedSpeculator) in the other rounds."""

    def __init__(self, inner: Speculator, prediction: Sequence[int], depth: int = PREDICTED_DEPTH) -> None:
        self.inner, self.lookup = inner, PredictionLookup(prediction, depth)
        self.max_nodes = max(inner.max_nodes, MAX_PREDICTED_DEPTH + 1)
        self.turns = InnerTurns()
        self.predicted: tuple[int, int] | None = None  # (the text's length, tokens proposed) of the last predicted round

    def begin(self, session) -> None:
        self.inner.begin(session)

    async def propose(self, session) -> Drafted:
        started = time.perf_counter()
        before_last = len(session.seq) - len(session.last_committed)
        self.turns.round_ended(session.last_path)
        if self.predicted is not None and self.predicted[0] == before_last:
            _, proposed = self.predicted
            self.lookup.depth = next_depth(self.lookup.depth, proposed, len(session.last_path))
        self.predicted = None
        shortest = 1 if len(session.seq) - session.prompt_len < 2 else 2
        # no more than the output still takes besides the round's bonus token: rows past
        # max_tokens would be verified for nothing (one at the last token, which it may be)
        room = max(session.params.max_tokens - len(session.output) - 1, 1)
        tokens = self.lookup.next_tokens(session.seq, shortest)[: max(min(session.max_nodes - 1, room), 0)]
        if tokens:
            self.predicted = (len(session.seq), len(tokens))
            return Drafted(Proposal(PlainTree.checked([session.seq[-1], *tokens], list(range(-1, len(tokens))))),
                           time.perf_counter() - started, predicted=True)
        # no outcome after the inner speculator's own round: nothing came between (a drafter that
        # times its rounds measures that one)
        return await self.inner.propose(session, self.turns.outcome(session))

    def close(self) -> None:
        self.inner.close()


def with_prediction(speculator: Speculator, params) -> Speculator:
    """``speculator``, drafting from ``params.prediction`` first when the request gives one."""
    return PredictionSpeculator(speculator, params.prediction) if params.prediction else speculator
