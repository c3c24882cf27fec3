"""Model drafters' sessions drafted together: a chain or tree proposal for several sessions
at once, every draft step one forward over all of them (the weights are read once a step
instead of once a session). One session's ``propose`` is the batch of one."""

from __future__ import annotations

import torch

from specctl.engine.prefill_jobs import next_job_end
from specctl.engine.tree import TokenTree
from specctl.spec.drafters import (
    DraftSession, Proposal, _ChainSession, _ModelDraftSession, _TreeSession, ranked_candidates, tree_score_params,
)
from specctl.spec.params import SamplingParams
from specctl.spec.sampling import DRAFT_SUPPORT, checked_token, keep_top, probs_from_logits, sample_tensor


def catch_up_many(sessions: list[_ModelDraftSession], seqs: list[list[int]]) -> list[torch.Tensor]:
    """Feed each session the committed tokens its cache lacks, all in one forward; the
    logits after each one's last token."""
    inputs, positions, at, new = [], [], [], []
    prefixes = sessions[0].decoder.prefix_cache
    for session, seq in zip(sessions, seqs):
        if prefixes is not None and not session.looked_up:  # a new session: its prompt's start may be cached
            session.looked_up = True
            prefixes.restore(seq, session.cache)
        if prefixes is not None and not session.committed:  # its first catch-up: the prompt is in after it
            new.append((session, seq))
        session.committed, start = len(seq), session.cache.length
        inputs.append(torch.tensor(seq[start:], dtype=torch.long))
        positions.append(torch.arange(start, len(seq)))
        at.append(torch.tensor([len(seq) - start - 1]))
    logits = sessions[0].decoder.forward_many(inputs, positions, [s.cache for s in sessions], [None] * len(sessions), at)
    for session, seq in new:  # its prompt's KV for the sessions that start the same way while it drafts
        prefixes.store(seq, session.cache)
    return logits


def prefill_step(session: _ModelDraftSession, seq: list[int]) -> bool:
    """Feed a new session's cache the text's next job of tokens (engine.prefill_jobs), before its
    first proposal, as a job of its own, until at most a job is left: the first proposal's catch-up,
    batched with other sessions' proposals, then feeds no more than that (a long prompt does
    not hold up their drafting). True once that is so (at once when chunk is 0 or the text short)."""
    chunk = session.decoder.prefill_chunk
    if chunk <= 0 or len(seq) <= chunk:
        return True
    prefixes = session.decoder.prefix_cache
    if prefixes is not None and not session.looked_up:
        session.looked_up = True
        prefixes.restore(seq, session.cache)
    start = session.cache.length
    end = next_job_end(session.decoder, start, len(seq))
    if end == len(seq):  # at most a job left: the first proposal's catch-up feeds it
        return True
    session.decoder(torch.tensor(seq[start:end], dtype=torch.long), torch.arange(start, end), session.cache,
                    logits_at=torch.tensor([end - start - 1]))
    if next_job_end(session.decoder, end, len(seq)) < len(seq):
        return False
    if prefixes is not None:  # what is fed so far, for sessions waiting to start the same way (engine.prefill_gate)
        prefixes.store(seq, session.cache)
    return True


def propose_chains(sessions: list[_ChainSession], seqs: list[list[int]], params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> list[Proposal]:
    """Draft a chain for several sessions at once: every step is one forward over all of
    them (the weights are read once per step instead of once per session). Adaptive depth:
    a session stops drafting once the draft's own probability of its chain so far falls
    below ``stop`` (greedy chains are scored by the draft's softmax at T = 1); the
    proposal's length never affects what is accepted, only what drafting costs."""
    decoder, depth, stop = sessions[0].decoder, sessions[0].depth, sessions[0].stop
    caps = [min(s.depth_cap or depth, depth) for s in sessions]  # the target's load may ask for shorter chains
    caches = [s.cache for s in sessions]
    logits = catch_up_many(sessions, seqs)
    # Greedy chains with no adaptive depth decide nothing on the host between steps: each
    # step's token goes to the next forward on the device and the chain is read back once.
    # On a GPU the host then prepares step i + 1 while the device runs step i (issue 11: a
    # read-back per step left the device idle for the host's part of every step).
    guides = [s.guide for s in sessions]  # the request's rules need each step's token on the host
    read_once = not stop and all(p.greedy for p in params) and not any(guides) and len(set(caps)) == 1
    picks: list[list[torch.Tensor]] = [[] for _ in sessions]  # per step: [token, its probability], on the device
    last: list[torch.Tensor] = [torch.empty(0)] * len(sessions)  # each session's last token [1], on the device
    dists: list[list[torch.Tensor | None]] = [[] for _ in sessions]
    ranked: list[list[torch.Tensor]] = [[] for _ in sessions]
    drafted: list[list[tuple[int, float]]] = [[] for _ in sessions]  # (token, probability) read back per step
    reach = [1.0] * len(sessions)
    live = list(range(len(sessions)))
    for i in range(max(caps)):
        for rows, b in zip(logits, live):
            if guides[b] is not None:
                rows = guides[b].apply(rows[:1], [[x for x, _ in drafted[b]]])
            ranked[b].append(ranked_candidates(rows[0]))
            # How likely the draft finds its token (greedy: its softmax at T = 1; sampled: q) is
            # read back with the token. It is the node's probability in the tree: adaptive depth
            # and routing among drafters use it. (gather, not [chosen]: indexing by a 0-d tensor
            # reads it back to the host, a device sync.)
            if params[b].greedy:
                # no q: the proposal carries none (a one-hot q cost two vocabulary-sized kernels a step)
                q, logit_row = None, rows[0].float()
                chosen = logit_row.argmax()
                likely = logit_row.softmax(-1).gather(0, chosen.view(1))[0]
            else:
                q = keep_top(probs_from_logits(rows[0], params[b]), DRAFT_SUPPORT)
                if sessions[b].reshape is not None:
                    q = sessions[b].reshape(i, q)
                chosen = sample_tensor(q, generators[b])
                likely = q.gather(0, chosen.view(1))[0]
            picks[b].append(torch.stack([chosen.double(), likely.double()]))
            last[b] = chosen.view(1)
            dists[b].append(q)
            if not read_once:
                x, p_x = picks[b][-1].tolist()
                drafted[b].append((checked_token(int(x)), p_x))
                reach[b] *= p_x
        live = [b for b in live if reach[b] >= stop and i + 1 < caps[b]]
        if not live:
            break
        if i + 1 < depth:
            one = torch.tensor([0])
            logits = decoder.forward_many([last[b] for b in live], [torch.tensor([len(seqs[b]) + i]) for b in live],
                                          [caches[b] for b in live], [None] * len(live), [one] * len(live))
    if read_once:  # every session drafted all its steps, as many as the others: one read-back of all chains
        read = torch.stack([torch.stack(steps) for steps in picks]).tolist()
        drafted = [[(checked_token(int(x)), p_x) for x, p_x in steps] for steps in read]
    proposals = []
    for b, (seq, p) in enumerate(zip(seqs, params)):
        tokens, probs = [x for x, _ in drafted[b]], [p_x for _, p_x in drafted[b]]
        proposals.append(Proposal(TokenTree.chain(seq[-1], tokens, probs), None if p.greedy else torch.stack(dists[b]),
                                  torch.stack(ranked[b])))
    return proposals


def propose_trees(sessions: list[_TreeSession], seqs: list[list[int]], params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> list[Proposal]:
    """Draft a tree for several sessions at once: the catch-up and then every level are one
    ragged forward over all of them (each its own frontier, positions and tree mask).
    Greedy drafting scores candidates by the draft's softmax (T = 1); sampling by the
    request's own processed distribution."""
    decoder, shape = sessions[0].decoder, sessions[0].shape
    caps = [min(s.depth_cap or shape.depth, shape.depth) for s in sessions]  # the target's load may ask for shallower trees
    score = [tree_score_params(p) for p in params]
    for session in sessions:
        session.fed = 0
    logits = [rows if s.guide is None else s.guide.apply(rows, [[]]) for s, rows in zip(sessions, catch_up_many(
        sessions, seqs))]
    ranked = [[ranked_candidates(rows)] for rows in logits]
    trees = [TokenTree.root(seq[-1]).grow(torch.tensor([0]), probs_from_logits(rows[0], sp).unsqueeze(0),
                                          shape.topk, shape.width)
             for seq, rows, sp in zip(seqs, logits, score)]
    # Adaptive depth: a session's tree stops growing once its likeliest node of the last
    # level has a cumulative draft probability below ``stop``.
    reached = lambda tree, level: float(tree.score[tree.level(level)].max().exp()) if tree.level(level).numel() else 0.0  # noqa: E731
    stopped = {b for b, tree in enumerate(trees) if shape.stop and reached(tree, 1) < shape.stop}
    for level in range(2, shape.depth + 1):
        live = [b for b, tree in enumerate(trees)
                if b not in stopped and level <= caps[b] and tree.level(level - 1).numel()]
        if not live:
            break
        frontiers = {b: trees[b].level(level - 1) for b in live}
        masks = [torch.cat([torch.ones(frontiers[b].numel(), sessions[b].committed, dtype=torch.bool),
                            trees[b].mask[frontiers[b]][:, 1 : int(frontiers[b][-1]) + 1]], dim=1) for b in live]
        out = decoder.forward_many(
            [trees[b].tokens[frontiers[b]] for b in live],
            [sessions[b].committed - 1 + trees[b].depth[frontiers[b]] for b in live],
            [sessions[b].cache for b in live], masks, [torch.arange(frontiers[b].numel()) for b in live])
        for b, rows in zip(live, out):
            if sessions[b].guide is not None:  # each frontier node's row after its own path
                paths = [trees[b].tokens[trees[b].path_to(int(j))[1:]].tolist() for j in frontiers[b]]
                rows = sessions[b].guide.apply(rows, paths)
            sessions[b].fed = int(frontiers[b][-1])
            ranked[b].append(ranked_candidates(rows))
            trees[b] = trees[b].grow(frontiers[b], probs_from_logits(rows, score[b]), shape.topk, shape.width)
            if shape.stop and reached(trees[b], level) < shape.stop:
                stopped.add(b)
    return [Proposal(tree, None, torch.cat(ranks)) for tree, ranks in zip(trees, ranked)]


def batch_kind(session: DraftSession):
    """The function that drafts sessions like this one together, or None."""
    if isinstance(session, _ChainSession):
        return propose_chains
    if isinstance(session, _TreeSession):
        return propose_trees
    return None
