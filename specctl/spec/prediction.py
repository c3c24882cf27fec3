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

The counts OpenAI reports: ``accepted_prediction_tokens`` are the predicted tokens
verification accepted, ``rejected_prediction_tokens`` the predicted tokens it rejected
(OpenAI's definition — prediction tokens not in the answer — needs an alignment of the two
texts; these are what the target actually checked)."""

from __future__ import annotations

import bisect
import time
from typing import Sequence

from specctl.engine.tree import PlainTree
from specctl.spec.drafters import Proposal
from specctl.spec.rounds import Drafted, Speculator

MAX_NGRAM = 4  # the longest tail of the output looked up in the prediction
PREDICTED_DEPTH = 16  # tokens proposed from the prediction a round
PREDICTION_NODES = PREDICTED_DEPTH + 1  # the largest proposal a session with a prediction verifies (root included)


class PredictionLookup:
    """Where the output goes on in the prediction. The last match anchors it: the output's end
    is expected as far past that match's end as the output has grown since, and of a tail's
    matches the one ending nearest there is taken (a prediction that repeats itself, as code
    does, has many)."""

    def __init__(self, prediction: Sequence[int], depth: int = PREDICTED_DEPTH) -> None:
        self.prediction, self.depth = list(prediction), depth
        self.anchor = (0, None)  # (the last match's end in the prediction, the text's length then)
        self.where: dict[int, list[int]] = {}  # token -> its positions in the prediction, ascending
        for i, token in enumerate(self.prediction):
            self.where.setdefault(token, []).append(i)

    def next_tokens(self, text: Sequence[int], min_n: int = 1) -> list[int]:
        """The prediction's tokens after the longest tail of ``text`` it holds (at most
        ``depth``; [] when no tail of ``min_n`` tokens or more is in it with something after it)."""
        end_then, length_then = self.anchor
        expected = end_then + (len(text) - length_then if length_then is not None else 0)
        for n in range(min(MAX_NGRAM, len(text)), min_n - 1, -1):
            end = self._match_end(list(text[-n:]), expected)
            if end is not None and end < len(self.prediction):
                self.anchor = (end, len(text))
                return self.prediction[end:end + self.depth]
        return []

    def _match_end(self, tail: list[int], expected: int) -> int | None:
        """The end of the match of ``tail`` nearest ``expected`` (the one at or after it on a
        tie); None without a match."""
        n, positions = len(tail), self.where.get(tail[-1], [])

        def matches(p: int) -> bool:
            return p + 1 >= n and self.prediction[p + 1 - n:p + 1] == tail

        at = bisect.bisect_left(positions, expected - 1)  # the first match ending at p + 1 >= expected
        ahead = next((p + 1 for p in positions[at:] if matches(p)), None)
        behind = next((p + 1 for p in reversed(positions[:at]) if matches(p)), None)
        if ahead is None or (behind is not None and expected - behind < ahead - expected):
            return behind
        return ahead


class PredictionSpeculator:
    """A speculator that drafts from the request's prediction where the output follows it, and
    asks ``inner`` (which takes an ``outcome``: RemoteSpeculator, LocalSpeculator,
    FusedSpeculator) in the other rounds."""

    def __init__(self, inner: Speculator, prediction: Sequence[int], depth: int = PREDICTED_DEPTH) -> None:
        self.inner, self.lookup = inner, PredictionLookup(prediction, depth)
        self.max_nodes = max(inner.max_nodes, depth + 1)
        self.synced: int | None = None  # the text's length when the inner speculator last proposed
        self.inner_path: list[int] = []  # its last proposal's accepted path, while no newer one came

    def begin(self, session) -> None:
        self.inner.begin(session)

    async def propose(self, session) -> Drafted:
        started = time.perf_counter()
        if self.synced is not None and self.synced == len(session.seq) - len(session.last_committed):
            self.inner_path = list(session.last_path)  # the last round was the inner speculator's
        shortest = 1 if len(session.seq) - session.prompt_len < 2 else 2
        tokens = self.lookup.next_tokens(session.seq, shortest)[: max(session.max_nodes - 1, 0)]
        if tokens:
            return Drafted(Proposal(PlainTree.checked([session.seq[-1], *tokens], list(range(-1, len(tokens))))),
                           time.perf_counter() - started, predicted=True)
        synced = session.prompt_len if self.synced is None else self.synced
        outcome = (self.inner_path, session.seq[synced:])
        self.synced, self.inner_path = len(session.seq), []
        return await self.inner.propose(session, outcome)

    def close(self) -> None:
        self.inner.close()


def with_prediction(speculator: Speculator, params) -> Speculator:
    """``speculator``, drafting from ``params.prediction`` first when the request gives one."""
    return PredictionSpeculator(speculator, params.prediction) if params.prediction else speculator
