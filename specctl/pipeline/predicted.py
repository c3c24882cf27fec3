"""A request's Predicted Output grafted onto SpecPipe's tree (§3.3 with spec.prediction).

Each forward stage 1 sends carries the prediction's next tokens as a chain hung under the
frontier node whose path the prediction continues (a chain's node first, then the draft's
likeliest path): one forward's output then decides the whole chain while it holds, where a
level decides a token per stage step. A chain's first forward carries the draft's level too,
and the chain merges with the draft's nodes where they agree (the tree bets on the prediction
below them); the forwards that continue it from its end are chains alone, and the draft reads
nothing while they go on — it reads the text it missed when it drafts again (the prediction
ended, or missed and the pipeline refills), in one forward, as the round loop's drafter
catches up. After a miss the refill forward carries the chain from the verified token. The
output is the target's all the same (a chain node is one more candidate the target accepts
or not, by argmax or by the rule for deterministic candidates).

How far a chain reaches adapts as in the round loop (``spec.prediction.next_depth``), and
the chains cached at once are bounded (``token_source.predicted_chain_nodes``: a session's
KV is sized for them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specctl.pipeline.live_tree import SpecTree
from specctl.spec.prediction import PredictionLookup, next_depth


@dataclass(slots=True)
class Chain:
    length: int  # tokens the chain proposed (its nodes merged with the draft's included)
    depth: int  # the lookup's depth when it was proposed


@dataclass(slots=True)
class PredictedChains:
    lookup: PredictionLookup
    budget: int  # chain nodes the session may keep cached at once
    prompt_len: int
    end: int  # the text's length at max_tokens: no chain reaches past it
    grafted: dict[int, tuple[Chain, int]] = field(default_factory=dict)  # node -> (its chain, index in it)
    accepted: int = 0  # chain tokens the target accepted
    rejected: int = 0  # chain tokens it did not (a rejected node and the rest of its chain)
    sent: int = 0  # chain nodes sent (new nodes; those merged with the draft's are the draft's)

    @classmethod
    def of(cls, prediction: Sequence[int], budget: int, prompt_len: int, max_tokens: int) -> "PredictedChains | None":
        if not prediction or budget <= 0:
            return None
        return cls(PredictionLookup(prediction), budget, prompt_len, prompt_len + max_tokens)

    def graft(self, tree: SpecTree, seq: list[int], frontier: list[int], new_levels: list[list[int]]) -> list[int]:
        """Hang the prediction's next tokens under the ``frontier`` node it continues, merged
        with the draft's ``new_levels`` under it (the levels about to be sent, frontier's
        children first); the chain's new nodes are added to ``tree`` and to ``new_levels``
        (one more level per node past their depth). Returns the new nodes' ids."""
        room = self.budget - sum(1 for node_id in self.grafted if node_id in tree.nodes)
        if room <= 0:
            return []
        # a chain's node first (the prediction goes on from there), then by the draft's score
        for parent in sorted(frontier, key=lambda n: (n not in self.grafted, -tree.nodes[n].score)):
            text = seq + tree.path(parent)
            shortest = 1 if len(text) - self.prompt_len < 2 else 2  # as the round loop looks up (spec.prediction)
            tokens = self.lookup.next_tokens(text, shortest)[:min(room, self.end - len(text))]
            if tokens:
                break
        else:
            return []
        chain, at, depth = Chain(len(tokens), self.lookup.depth), parent, 0
        while depth < len(tokens) and depth < len(new_levels):  # along the draft's nodes while they agree
            same = [n for n in new_levels[depth] if tree.nodes[n].parent == at and tree.nodes[n].token == tokens[depth]]
            if not same:
                break
            at = same[0]
            self.grafted[at] = (chain, depth)
            depth += 1
        added = []
        for index in range(depth, len(tokens)):
            at = tree.add(tokens[index], at, tree.nodes[at].pos + 1, tree.nodes[at].score)
            self.grafted[at] = (chain, index)
            if index < len(new_levels):
                new_levels[index].append(at)
            else:
                new_levels.append([at])
            added.append(at)
        self.sent += len(added)
        return added

    def chain_ends(self, frontier: list[int]) -> list[int]:
        """The frontier's nodes that end a chain: the next forward continues it alone."""
        return [n for n in frontier if n in self.grafted and self.grafted[n][1] == self.grafted[n][0].length - 1]

    def decided(self, children: list[int], new_root: int | None) -> None:
        """A verification of the root whose ``children`` were candidates chose ``new_root``:
        count a chain's node accepted or rejected, and adapt how far the next chain reaches
        (a whole chain accepted doubles it, a rejection falls back to what was accepted)."""
        ours = [c for c in children if c in self.grafted]
        if not ours:
            return
        chain, index = self.grafted[ours[0]]
        if new_root == ours[0]:
            self.accepted += 1
            if index == chain.length - 1:
                self.lookup.depth = next_depth(chain.depth, chain.length, chain.length)
        else:  # the rest of the chain goes with it
            self.rejected += chain.length - index
            self.lookup.depth = next_depth(chain.depth, chain.length, index)

    def forget(self, tree: SpecTree | None) -> None:
        """Drop what a re-rooting pruned from ``tree``; None: a flush dropped the whole tree
        (the next tree's ids start again)."""
        self.grafted = {} if tree is None else {n: c for n, c in self.grafted.items() if n in tree.nodes}
