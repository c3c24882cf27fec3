"""Suffix decoding (SuffixDecoding, Oliaro et al.; vLLM's ``method: suffix``, Arctic
Inference's cache): a model-free drafter that proposes a token tree from the continuations
of the context's longest earlier matches, in the session's own prompt and output and in the
outputs of the other sessions this drafter served (a target instance's: its earlier and
running requests; each output remembered after its prompt's last KEY - 1 tokens, so that a
repeated prompt finds its first tokens). Agents, edits and repeated tasks rewrite what was
written before; there it proposes long runs for nothing, and elsewhere little or nothing
(with nothing, the round is plain AR).

Arctic's rule, written here over an index of the sequences rather than its C++ suffix tree:
for each match length m (the longest first), the occurrences whose preceding m tokens equal
the context's last m, and from them a tree grown best-first, each node's probability the
share of its parent's occurrences that continue with its token (Arctic's counts), nodes
under ``min_token_prob`` left out, at most min(depth, m x max_spec_factor +
max_spec_offset) nodes; the tree whose probabilities sum highest is proposed. Choices of
ours (DESIGN "Choice made here"): occurrences are found by the context's last KEY tokens (a
match is at least KEY long); the session's own occurrences and everyone else's are pooled
into one tree (Arctic proposes the better of two); the context's own end is not an
occurrence (it has no continuation, and would dilute every probability); at most
MAX_OCCURRENCES a proposal, the latest written first. The proposal's nodes are
deterministic candidates, verified losslessly as n-gram tokens are (spec.verify)."""

from __future__ import annotations

import heapq
import itertools
import threading
from array import array

from specctl.engine.kv_cache import KVPool
from specctl.engine.tree import PlainTree
from specctl.spec.drafters import DraftSession, Drafter, Proposal

KEY = 2  # tokens that find an occurrence: a match is at least this long
MAX_OCCURRENCES = 256  # occurrences a proposal weighs, the latest written first
Occurrence = tuple["array[int]", int]  # a sequence and the position of its last matched token


class SequenceIndex:
    """Sequences that grow at their end, each position indexed by the KEY tokens ending there.
    ``drop`` forgets a sequence and its index entries. Tokens are int32 arrays, an index
    entry one int64 (sequence << 32 | position) in its key's array: ~80 bytes a token of
    varied text (measured with tracemalloc), where lists and dicts of ints took ~210."""

    def __init__(self) -> None:
        self.sequences: dict[int, array] = {}
        self.positions: dict[int, array] = {}  # key -> its entries, in the order written

    @staticmethod
    def key(tokens) -> int:
        first, second = tokens  # KEY = 2 tokens, one int
        return first << 32 | second

    def extend(self, sequence_id: int, tokens: list[int]) -> None:
        sequence = self.sequences.setdefault(sequence_id, array("i"))
        start = len(sequence)
        sequence.extend(tokens)
        for end in range(max(start, KEY - 1), len(sequence)):
            key = self.key(sequence[end - KEY + 1:end + 1])
            entries = self.positions.get(key)
            if entries is None:
                entries = self.positions[key] = array("q")
            entries.append(sequence_id << 32 | end)

    def drop(self, sequence_id: int) -> None:
        sequence = self.sequences.pop(sequence_id, array("i"))
        for key in {self.key(sequence[end - KEY + 1:end + 1]) for end in range(KEY - 1, len(sequence))}:
            kept = array("q", (entry for entry in self.positions[key] if entry >> 32 != sequence_id))
            if kept:
                self.positions[key] = kept
            else:
                del self.positions[key]

    def occurrences(self, key: tuple[int, ...], skip: int | None = None) -> list[Occurrence]:
        """Where ``key`` ends, the latest written first (``skip``: a sequence left out)."""
        found: list[Occurrence] = []
        for entry in reversed(self.positions.get(self.key(key), ())):
            if entry >> 32 != skip:
                found.append((self.sequences[entry >> 32], entry & 0xFFFFFFFF))
                if len(found) == MAX_OCCURRENCES:
                    break
        return found


def match_length(context: list[int], sequence: array, end: int, limit: int) -> int:
    """How many tokens before and at ``end`` equal the context's last ones (at most ``limit``)."""
    length = 0
    while length < limit and length <= end and length < len(context) and sequence[end - length] == context[-1 - length]:
        length += 1
    return length


def grow(occurrences: list[Occurrence], max_nodes: int, min_token_prob: float, tree: bool, max_levels: int = 0,
         ) -> tuple[list[int], list[int], list[float]]:
    """The draft the occurrences continue into, best-first (Arctic's priority queue): (tokens,
    parents (-1: the root), probabilities from the root); a node is taken when it is the likeliest
    left, so the budget goes to the likeliest nodes wherever they hang, down to ``max_levels``
    (0: any depth). A chain (``tree`` False) follows the likeliest child only. Children of equal
    counts: the one continuing the latest written occurrence first."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    tie = itertools.count()
    queue = [(-1.0, next(tie), occurrences, 1, -1, None)]  # (-prob, order, occurrences, offset, parent, token)
    while queue and len(tokens) < max_nodes:
        negative, _, here, offset, parent, token = heapq.heappop(queue)
        if token is not None:  # the root's item holds none
            tokens.append(token)
            parents.append(parent)
            probs.append(-negative)
            parent, offset = len(tokens) - 1, offset + 1
        if max_levels and offset > max_levels:  # its children would be deeper than asked
            continue
        children: dict[int, list[Occurrence]] = {}
        for sequence, end in here:
            if end + offset < len(sequence):
                children.setdefault(sequence[end + offset], []).append((sequence, end))
        ranked = sorted(children.items(), key=lambda item: -len(item[1]))  # stable: the latest written first on ties
        for child, continuing in ranked[:None if tree else 1]:
            prob = -negative * len(continuing) / len(here)
            if prob < min_token_prob:
                break
            heapq.heappush(queue, (-prob, next(tie), continuing, offset, parent, child))
    return tokens, parents, probs


def speculate(context: list[int], occurrences: list[Occurrence], depth: int, *, max_depth: int = 64,
              max_spec_factor: float = 1.0, max_spec_offset: float = 0.0, min_token_prob: float = 0.1,
              tree: bool = True, max_levels: int = 0) -> tuple[list[int], list[int], list[float]]:
    """Arctic's choice among match lengths: for each (the longest first), the draft of the
    occurrences matching at least that long, capped at min(depth, m x factor + offset) nodes
    and ``max_levels`` levels (0: any); the one whose probabilities sum highest (the longer
    match on a tie)."""
    matched = sorted(((match_length(context, sequence, end, max_depth), (sequence, end))
                      for sequence, end in occurrences), key=lambda item: -item[0])
    best: tuple[list[int], list[int], list[float]] = ([], [], [])
    best_score = 0.0
    for cut, (length, _) in enumerate(matched):
        if length < KEY or (cut + 1 < len(matched) and matched[cut + 1][0] == length):
            continue  # each length once, with every occurrence at least that long
        budget = min(depth, int(length * max_spec_factor + max_spec_offset + 1e-6))
        if budget <= best_score:  # no draft of this length can sum higher
            continue
        draft = grow([occurrence for _, occurrence in matched[:cut + 1]], budget, min_token_prob, tree, max_levels)
        if sum(draft[2]) > best_score:
            best, best_score = draft, sum(draft[2])
    return best


def proposal_tree(root: int, tokens: list[int], parents: list[int], probs: list[float]) -> PlainTree:
    """A best-first draft as a breadth-first PlainTree (the order verification needs), each
    node's probability given its parent; siblings stay likeliest first."""
    depth = [0] * len(tokens)
    for i, parent in enumerate(parents):
        depth[i] = 1 if parent < 0 else depth[parent] + 1
    order = sorted(range(len(tokens)), key=lambda i: depth[i])
    place = {old: new + 1 for new, old in enumerate(order)}
    return PlainTree.checked(
        [root, *(tokens[i] for i in order)], [-1, *(0 if parents[i] < 0 else place[parents[i]] for i in order)],
        [1.0, *(probs[i] / (1.0 if parents[i] < 0 else probs[parents[i]]) for i in order)])


class SuffixDrafter(Drafter):
    """Suffix decoding over the session's own text and the outputs of every session it served
    (the last ``max_cached`` of them, first in first out; running ones included as they grow;
    vLLM keeps 10,000 in Arctic's C++ tree; ours costs ~80 bytes a token: 1,000 by default).
    ``depth``: most draft tokens a proposal holds."""

    name = "suffix"
    free = True  # a lookup in the text

    def __init__(self, depth: int, *, tree: bool = True, max_depth: int = 64, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1, max_cached: int = 1000) -> None:
        if depth < 1 or max_depth < KEY or max_spec_factor <= 0 or not 0 <= min_token_prob <= 1 or max_cached < 0:
            raise ValueError(f"suffix decoding needs depth >= 1, max_depth >= {KEY}, max_spec_factor > 0, "
                             f"min_token_prob in [0, 1] and max_cached >= 0")
        self.depth, self.tree, self.max_depth = depth, tree, max_depth
        self.max_spec_factor, self.max_spec_offset = max_spec_factor, max_spec_offset
        self.min_token_prob = min_token_prob
        self.max_cached = max_cached
        self.max_nodes = depth + 1
        self.outputs = SequenceIndex()  # every session's output, by session number (insertion order: FIFO)
        self.lock = threading.Lock()  # sessions of several threads share the outputs
        self.numbers = itertools.count()

    def open(self, capacity: int, pool: KVPool | None = None) -> DraftSession:
        return _SuffixSession(self, next(self.numbers))

    def forget(self) -> None:
        """Drop every session's output remembered so far (running sessions add their later tokens)."""
        with self.lock:
            self.outputs = SequenceIndex()

    def remember(self, number: int, tokens: list[int]) -> None:
        """A session's new output tokens, for every session's proposals from now on."""
        if not self.max_cached:
            return
        with self.lock:
            fresh = number not in self.outputs.sequences
            self.outputs.extend(number, tokens)
            while fresh and len(self.outputs.sequences) > self.max_cached:
                self.outputs.drop(next(iter(self.outputs.sequences)))

    def found(self, key: tuple[int, ...], own: int) -> list[Occurrence]:
        with self.lock:
            return self.outputs.occurrences(key, skip=own)


class _SuffixSession(DraftSession):
    """One session: its prompt and output indexed (freed at close); its output also goes to
    the drafter's, which outlives it."""

    def __init__(self, drafter: SuffixDrafter, number: int) -> None:
        self.drafter, self.number = drafter, number
        self.text = SequenceIndex()
        self.prompt_len: int | None = None
        self.depth_cap = 0  # the next proposal at most this many levels (0: any), as the target's load asks

    def observe(self, seq: list[int]) -> None:
        if self.prompt_len is None:  # first seen after the prefill's token
            self.prompt_len = len(seq) - 1
        seen = len(self.text.sequences.get(0, []))
        self.text.extend(0, seq[seen:])
        # the output, after the prompt's last KEY - 1 tokens: a request that repeats the prompt's
        # end finds the output's first tokens
        self.drafter.remember(self.number, seq[max(seen, self.prompt_len - KEY + 1, 0):])

    def propose(self, seq, params, generator):
        return Proposal(self.plain_draft(seq, self.depth_cap).built())

    def plain_draft(self, seq: list[int], max_levels: int = 0) -> PlainTree:
        """The proposal's tree in plain Python (a target instance's fusion asks on its event
        loop), at most ``max_levels`` deep (0: as deep as its node budget goes)."""
        drafter = self.drafter
        self.observe(seq)
        key = tuple(seq[-KEY:])
        own = [(sequence, end) for sequence, end in self.text.occurrences(key) if end < len(seq) - 1]
        occurrences = (own + drafter.found(key, self.number))[:MAX_OCCURRENCES]
        draft = speculate(seq, occurrences, drafter.depth, max_depth=drafter.max_depth,
                          max_spec_factor=drafter.max_spec_factor, max_spec_offset=drafter.max_spec_offset,
                          min_token_prob=drafter.min_token_prob, tree=drafter.tree, max_levels=max_levels)
        return proposal_tree(seq[-1], *draft)

    def close(self) -> None:
        self.text = SequenceIndex()
