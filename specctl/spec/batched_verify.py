"""Several sessions of one target verified in one ragged forward (the weights read once for
all of them), each then accepting on its own: the verify lane's batched job (spec.rounds)."""

from __future__ import annotations

import torch

from specctl.spec.decode import DecodeSession
from specctl.spec.drafters import Proposal


def apply_many(items: list[tuple[DecodeSession, Proposal]]) -> list[list[int] | BaseException]:
    """Verify the proposals of several sessions of one target in a single ragged forward
    (the weights are read once for all of them); each session then accepts on its own,
    exactly as ``DecodeSession.apply`` would. A session whose proposal does not fit gets
    its exception back; the others go on."""
    if len(items) == 1:
        try:
            return [items[0][0].apply(items[0][1])]
        except Exception as exc:  # noqa: BLE001 - handed back to that session's caller
            return [exc]
    results: list[list[int] | BaseException | None] = [None] * len(items)
    ready = []
    for i, (session, proposal) in enumerate(items):
        try:
            proposal = proposal.built()
            ahead = session.take_ahead(proposal)
            if ahead is not None:  # verified already, by the step it ran ahead
                results[i] = session.accept(proposal, ahead)
                continue
            ready.append((i, session, proposal, session.verify_inputs(proposal)))
        except Exception as exc:  # noqa: BLE001
            results[i] = exc
    if ready:
        target = ready[0][1].target
        logits = target.forward_many(
            [inputs[0] for *_, inputs in ready], [inputs[1] for *_, inputs in ready],
            [session.cache for _, session, _, _ in ready], [inputs[2] for *_, inputs in ready],
            [torch.arange(inputs[0].shape[0]) for *_, inputs in ready])
        for (i, session, proposal, _), rows in zip(ready, logits):
            try:
                results[i] = session.accept(proposal, rows)
            except Exception as exc:  # noqa: BLE001
                results[i] = exc
    return results
