"""SpecPipe's tree levels drafted on the draft server for a remote stage 1 (``verify --stage
1/n --draft H:P --specpipe``). Each session holds the draft's KV and the tree; stage 1
mirrors the tree (both sides add the same nodes in the same order and re-root alike, so
the node ids agree). The levels follow the request's logit rules and grammar as a local
draft does (DraftLevels' guide), each re-rooting's token recorded as output. Runs on the
draft server's compute thread, in message order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from specctl.draft.sessions import wire_rules
from specctl.engine.kv_cache import KVPool
from specctl.engine.model import Decoder
from specctl.engine.spec import check_token_ids
from specctl.errors import BadRequest
from specctl.net.protocol import Graft, Level, OpenLevels, Reroot
from specctl.pipeline.live_tree import SpecTree
from specctl.pipeline.token_source import DraftLevels, TreeShape
from specctl.spec.params import SamplingParams


@dataclass(slots=True)
class LevelSession:
    levels: DraftLevels
    tree: SpecTree
    failed: str | None = None  # a re-rooting that did not fit the tree: the next level request says why
    # the request's rules, text and how much of it is output (DraftRules.generated), until the
    # first tree's root (the text's last token) comes to build the guide
    rules: tuple[SamplingParams, list[int], int] | None = None


class LevelTable:
    def __init__(self, draft: Decoder, pool: KVPool, vocab_size: int, max_position: int,
                 guide_of: Callable[[SamplingParams, list[int], list[int]], Any] | None = None) -> None:
        """``guide_of``: (request's rules, prompt, output) -> the logit rules a session's levels
        follow (spec.logit_rules.draft_guide), or None when they cannot."""
        self.draft, self.pool, self.vocab_size, self.max_position = draft, pool, vocab_size, max_position
        self.guide_of = guide_of
        self.sessions: dict[int, LevelSession] = {}
        self.levels_sent = 0
        self.grafts = 0  # predicted chains hung in a session's tree

    def open(self, tag: int, msg: OpenLevels) -> None:
        try:
            shape = TreeShape(msg.width, msg.topk, msg.spread)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        check_token_ids(msg.prompt, self.vocab_size)
        if not len(msg.prompt) < msg.capacity <= self.max_position:
            raise BadRequest(f"a level session needs a capacity above its text's length, at most "
                             f"{self.max_position}: got {len(msg.prompt)} tokens, capacity {msg.capacity}")
        rules = wire_rules(msg, msg.min_tokens) if self.guide_of is not None else None
        text = list(msg.prompt)
        self.sessions[tag] = LevelSession(DraftLevels(self.draft, shape, text, msg.capacity, self.pool), SpecTree(),
                                          rules=None if rules is None else (rules, list(text), msg.generated))

    def next_level(self, tag: int, frontier: list[int]) -> Level:
        session = self._session(tag)
        if session.failed is not None:
            raise BadRequest(session.failed)
        if not frontier or any(node not in session.tree.nodes for node in frontier):
            raise BadRequest(f"the frontier {frontier[:8]} names nodes the session's tree does not hold")
        ids = session.levels.next_level(session.tree, frontier)
        nodes = [session.tree.nodes[i] for i in ids]
        self.levels_sent += 1
        return Level(tag, ids, [n.token for n in nodes], [n.parent for n in nodes], [n.score for n in nodes])

    def graft(self, msg: Graft) -> None:
        """Hang a predicted chain in the session's tree as stage 1 did (the same ids, in the same
        order); the draft reads its nodes with the next level under them."""
        session = self._session(msg.tag)
        if session.failed is not None:
            return
        parent, capacity = session.tree.nodes.get(msg.parent), session.levels.cache.capacity
        if parent is None or not msg.tokens or any(not 0 <= t < self.vocab_size for t in msg.tokens) \
                or max(parent.pos, len(session.tree.nodes)) + len(msg.tokens) >= capacity:
            session.failed = (f"a chain of {len(msg.tokens)} tokens under node {msg.parent}: the tree does not hold "
                              "the node, a token is out of range, or it reaches past the session's capacity")
            return
        self.grafts += 1
        at = msg.parent
        for token in msg.tokens:
            at = session.tree.add(token, at, session.tree.nodes[at].pos + 1, parent.score)

    def reroot(self, msg: Reroot) -> None:
        session = self._session(msg.tag)
        tree = session.tree
        if session.failed is not None:
            return
        if msg.committed >= 0 and (msg.committed not in tree.nodes or msg.new_root >= 0 and msg.new_root not in tree.nodes):
            session.failed = f"re-rooting at {msg.committed} -> {msg.new_root}: nodes the tree does not hold"
            return
        if not 0 <= msg.token < self.vocab_size or not 0 <= msg.position < session.levels.cache.capacity:
            session.failed = f"token {msg.token} at position {msg.position} is out of range"
            return
        guide = session.levels.guide
        if msg.committed >= 0:
            session.levels.reroot(tree, msg.committed, None if msg.new_root < 0 else msg.new_root)
            if guide is not None:
                guide.record([msg.token])  # the verified token: output now
        elif session.rules is not None:  # the first root, the text's last token
            rules, text, generated = session.rules
            text, split = text + [msg.token], max(0, len(text) + 1 - generated)
            session.levels.guide, session.rules = self.guide_of(rules, text[:split], text[split:]), None
        if msg.new_root < 0 or msg.committed < 0:
            session.tree = SpecTree()
            session.tree.add(msg.token, None, msg.position)
        else:
            tree.reroot(msg.new_root)

    def close(self, tag: int) -> None:
        session = self.sessions.pop(tag, None)
        if session is not None:
            session.levels.close()

    def _session(self, tag: int) -> LevelSession:
        session = self.sessions.get(tag)
        if session is None:
            raise BadRequest(f"unknown level session {tag}")
        return session

    def snapshot(self) -> dict:
        return {"level_sessions": len(self.sessions), "levels_sent": self.levels_sent, "level_grafts": self.grafts}
