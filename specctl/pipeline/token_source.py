"""SpecPipe's token source (§3.3): the shape of the tree, and a draft model growing it one
fixed-width level at a time (its top-k children per node, the w likeliest paths overall).
A draft server grows it the same way for a remote stage 1 (``pipeline/remote_levels.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specctl.engine.kv_cache import KVPool
from specctl.engine.model import Decoder
from specctl.pipeline.live_tree import CacheMirror, SpecTree
from specctl.spec.decode import DecodeSession
from specctl.spec.logit_rules import LogitRules
from specctl.spec.prediction import PREDICTION_NODES


SPREADS = ("likeliest", "every-node")
MAX_TREE_NODES = 320  # the most tree nodes a SpecPipe session may keep cached (its KV is sized for them)


@dataclass(frozen=True, slots=True)
class TreeShape:
    width: int = 4  # nodes per level (a fixed-width tree balances the stages' work)
    topk: int = 2  # children considered per node
    # How a level's w nodes are chosen among the frontier's top-k children:
    # "likeliest": the w likeliest paths (SpecPipe §3.3.3) — the likely next roots get several
    #   children, an unlikely node none;
    # "every-node": every frontier node keeps its likeliest child first, then the likeliest paths
    #   fill the level — no level is ever pruned away whole, but once a level is full every node
    #   has one child and the tree is w chains (measured: 1.28 steps per token against 1.13-1.19).
    spread: str = "likeliest"
    # Levels drafted under the verified token after a miss and sent with it as one forward
    # (None: stages - 1; 0: the token alone, one level per step as before). Their output
    # decides several tokens at once while they hit, where a lone token decides one.
    refill: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.width <= 256 or not 1 <= self.topk <= 64:
            raise ValueError(f"width must be in 1..256 and topk in 1..64, got {self.width}, {self.topk}")
        if self.spread not in SPREADS:
            raise ValueError(f"spread must be one of {', '.join(SPREADS)}, got {self.spread!r}")
        if self.refill is not None and not 0 <= self.refill <= 16:
            raise ValueError(f"refill depth must be in 0..16, got {self.refill}")

    def refill_depth(self, stages: int) -> int:
        """Levels sent with the verified token after a miss (the default: one per stage but the first)."""
        return max(stages - 1, 0) if self.refill is None else self.refill


def max_tree_nodes(stages: int, shape: TreeShape, predicted: bool = False) -> int:
    """The most tree nodes a session ever has cached: the root's level, a refill's levels and
    up to one level per stage in flight (plus one being drafted), ``width`` nodes each; with a
    request's prediction, its grafted chains too (``predicted_chain_nodes``)."""
    nodes = (stages + 2 + shape.refill_depth(stages)) * shape.width + 1
    return nodes + predicted_chain_nodes(stages) if predicted else nodes


def predicted_chain_nodes(stages: int) -> int:
    """The most nodes of a request's predicted chains a SpecPipe session keeps cached at once
    (pipeline.predicted): a full chain in every forward in flight."""
    return stages * PREDICTION_NODES


def level_capacity(prompt_len: int, max_tokens: int, stages: int, shape: TreeShape, predicted: bool = False) -> int:
    """KV positions a draft growing a session's tree may need: its text, the new tokens and
    the most tree nodes ever cached."""
    return prompt_len + max_tokens + max_tree_nodes(stages, shape, predicted) + 2


Candidate = tuple[float, int, int]  # (path probability, frontier row, token)


def spread_level(candidates: list[Candidate], topk: int, width: int, spread: str) -> list[Candidate]:
    """The ``width`` nodes of the next level among the frontier's candidates (``topk`` per
    frontier row, likeliest first), as ``TreeShape.spread`` says (pure)."""
    firsts = sorted(candidates[::topk], reverse=True)[:width] if spread == "every-node" else []
    rest = sorted(set(candidates) - set(firsts), reverse=True)
    return firsts + rest[: width - len(firsts)]


def unread_ancestors(tree: SpecTree, mirror: CacheMirror, frontier: list[int]) -> list[int]:
    """The frontier's ancestors a device has not read, parents first: the nodes of a chain
    grafted under the frontier's level (a request's prediction, pipeline.predicted) — the
    draft reads them with the frontier at its end. None in a tree grown only level by level."""
    cached, unread = set(mirror.order), set()
    for node_id in frontier:
        parent = tree.nodes[node_id].parent
        while parent is not None and parent not in cached and parent not in unread:
            unread.add(parent)
            parent = tree.nodes[parent].parent
    return sorted(unread - set(frontier))  # ids grow as nodes are added: parents first


class LevelSource(Protocol):
    """Where SpecPipe's levels come from: a draft model here (DraftLevels) or on a draft server."""
    alive: bool

    def start(self, token: int, position: int) -> None: ...
    def next_level(self, tree: SpecTree, frontier: list[int]) -> list[int] | None: ...
    def graft(self, tree: SpecTree, nodes: list[int]) -> None: ...
    def reroot(self, tree: SpecTree, committed: int, new_root: int | None, token: int, position: int) -> None: ...
    def revive(self, seq: list[int]) -> bool: ...  # a draft that went away, back at a flush: True when it is
    def close(self) -> None: ...


class DraftLevels:
    """The token source: a draft model growing the tree one level at a time, with its own
    KV of the committed text and the tree nodes it has read. (A draft server runs one per
    session for a remote stage 1: ``pipeline/remote_levels.py``.)"""

    alive = True  # a local draft never goes away (a remote one may: stage 1 then decodes as plain PP)

    def __init__(self, draft: Decoder, shape: TreeShape, prefix: list[int], capacity: int,
                 pool: KVPool | None = None, guide: LogitRules | None = None) -> None:
        """``prefix``: the committed text before the first tree's root (may be empty);
        ``guide``: the session's logit rules, followed while drafting (read, never changed:
        the session records its commits into them, on the same thread)."""
        self.draft, self.shape, self.guide = draft, shape, guide
        self.cache = draft.new_cache(capacity, pool)
        if prefix:
            draft(torch.tensor(prefix), torch.arange(len(prefix)), self.cache, logits_at=torch.tensor([len(prefix) - 1]))
        self.mirror = CacheMirror(len(prefix))
        self.pending: list[tuple[int, int]] = []  # committed (token, position) the cache still lacks

    @classmethod
    def for_session(cls, draft: Decoder, shape: TreeShape, session: DecodeSession,
                    pool: KVPool | None = None) -> "DraftLevels":
        capacity = level_capacity(session.prompt_len, session.params.max_tokens, session.target.stages, shape,
                                  bool(session.params.prediction))
        return cls(draft, shape, session.seq[: session.prompt_len - 1], capacity, pool, session.rules)

    def start(self, token: int, position: int) -> None:
        """The first tree's root (the prompt's last token): the draft reads it with the first level."""

    def next_level(self, tree: SpecTree, frontier: list[int]) -> list[int]:
        """Read the frontier nodes and add the next level to ``tree``; returns its node ids."""
        if self.pending:
            tokens, positions = zip(*self.pending)
            self.draft(torch.tensor(tokens), torch.tensor(positions), self.cache, logits_at=torch.tensor([0]))
            self.mirror.prefix += len(self.pending)
            self.pending = []
        read = unread_ancestors(tree, self.mirror, frontier) + frontier
        tail = self.mirror.level_mask(tree, read)
        mask = torch.cat([torch.ones(len(read), self.mirror.prefix, dtype=torch.bool), tail], 1)
        nodes = [tree.nodes[i] for i in frontier]
        logits = self.draft(torch.tensor([tree.nodes[i].token for i in read]),
                            torch.tensor([tree.nodes[i].pos for i in read]), self.cache, mask=mask,
                            logits_at=torch.arange(len(read) - len(frontier), len(read)))
        self.mirror.append(read)
        guide = self.guide
        if guide is not None and (logits.shape[-1], logits.device) == (guide.counts.shape[-1], guide.counts.device):
            # each frontier node's row after its path past the committed text (the tree's root);
            # a draft of another vocabulary width or on another device drafts free
            logits = guide.apply(logits, [tree.path(i) for i in frontier])
        probs, tokens = logits.float().softmax(-1).topk(self.shape.topk, dim=-1)
        probs, tokens = probs.tolist(), tokens.tolist()  # one copy each off the draft's device, not one per item
        candidates = [(nodes[r].score * probs[r][j], r, tokens[r][j])
                      for r in range(len(frontier)) for j in range(self.shape.topk)]
        chosen = spread_level(candidates, self.shape.topk, self.shape.width, self.shape.spread)
        chosen.sort(key=lambda c: (c[1], -c[0]))  # by parent, likeliest child first (tried first)
        return [tree.add(token, frontier[r], nodes[r].pos + 1, score) for score, r, token in chosen]

    def graft(self, tree: SpecTree, nodes: list[int]) -> None:
        """A predicted chain was hung in ``tree`` (pipeline.predicted): its nodes are read with
        the next level under them (``unread_ancestors``)."""

    def reroot(self, tree: SpecTree, committed: int, new_root: int | None, token: int = -1,
               position: int = -1) -> None:
        """``committed``'s next token was verified (``token`` at ``position``): keep the draft's
        KV of the committed path and of ``new_root``'s subtree (None: a flush)."""
        if self.mirror.order and self.mirror.order[0] == committed:
            self.cache.gather(self.mirror.reroot(tree, committed, new_root))
        else:  # verified before the draft read it (nothing under it read either): read it next time
            node = tree.nodes[committed]
            self.pending.append((node.token, node.pos))

    def revive(self, seq: list[int]) -> bool:
        return False  # never went away

    def close(self) -> None:
        self.cache.release()
