"""Proposals from a draft server: the speculator a target instance plugs into the round
loop. It owns the session's draft-session lifecycle, in one place:

- open it while the target runs the prefill, from the text committed so far;
- a draft server that refused the session because it was full (capacity, StarSD
  admission) is asked again every REOPEN_AFTER_S, for any other refusal or no answer only
  after the link reconnects; meanwhile rounds run autoregressively;
- a Propose that fails (an error from the draft server, or no answer in time) leaves the
  draft session in an unknown state: it is closed at once and a new one opened next
  round (after three failures in a row, only after a reconnect);
- closed when the session ends, also while it is still being opened."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time

from specctl.engine.tree import PlainTree
from specctl.net.protocol import Proposal as ProposalMsg, ProtocolError
from specctl.spec.decode import DecodeSession
from specctl.spec.drafters import Proposal
from specctl.spec.rounds import Drafted
from specctl.spec.params import SamplingParams
from specctl.spec.stats import FALLBACK_BAD_PROPOSAL, FALLBACK_DRAFT_DOWN, FALLBACK_DRAFT_FAILED
from specctl.verify.draft_client import DraftClient, Handle, Refusal, may_ask_again, refusal

log = logging.getLogger("specctl.verify")
MAX_FAILURES_IN_A_ROW = 3
# A fresh draft session's first proposal also reads the prompt: its deadline grows by the
# client's timeout for every this many prompt tokens (a 5,000-token prompt once timed out
# on every round, and speculation stayed off for the whole request).
PREFILL_TOKENS_PER_TIMEOUT = 512


def draft_seed(seed: int | None) -> int:
    """The draft session's seed for a request seeded with ``seed``: derived from it (a seeded
    request stays reproducible) but never the seed itself. The target's acceptance tests draw
    from a generator seeded with the request's seed; a draft seeded alike drew the same
    numbers to pick its tokens, and the two correlated streams biased the output away from
    the target's distribution (Saguaro-reshaped chains of depth 2 failed a chi-square test)."""
    return random.Random(f"specctl-draft-{seed}").getrandbits(62) if seed is not None else random.getrandbits(62)


def reproducible_draft(params: SamplingParams) -> bool:
    """Ask the draft to compute as a cold start alone would (OpenSession.reproducible)? For a
    seeded sample, so that the seed repeats the text — one of several drafters' too (greedy
    drafts: a near-tie computed in another batch would turn a drafted token, and the fused tree
    with it, and so the draws that follow)."""
    return params.repeatable


def proposal_from_message(msg: ProposalMsg, vocab_size: int) -> Proposal:
    """The proposal a message carries, checked in plain Python and numpy: the event loop's
    thread reads it, and the compute thread builds its tensors (Proposal.built)."""
    try:
        tree = PlainTree.checked(msg.tokens, msg.parents, msg.unpacked_confidences())
    except ValueError as exc:
        raise ProtocolError(f"bad proposal tree: {exc}") from None
    if msg.draft_probs is None:
        return Proposal(tree)
    if (rows := msg.draft_probs.checked(vocab_size)) != len(tree) - 1:
        raise ProtocolError(f"draft_probs has {rows} rows for a chain of {len(tree) - 1} tokens")
    # made dense where it is used, on the compute thread: a vocabulary-wide op here, on the event
    # loop's thread, would leave an OpenMP pool alive beside the compute thread's, and with more
    # pool threads than cores every later step's small ops wait on sleeping workers (measured: a
    # 0.5B decode step 69 -> 104 ms for the rest of the process, after one such op)
    return Proposal(tree, functools.partial(msg.draft_probs.to_dense, vocab_size))


class RemoteSpeculator:
    def __init__(self, client: DraftClient | None, max_nodes: int, seed: int | None = None,
                 greedy_drafts: bool = False) -> None:
        self.client, self.max_nodes = client, max_nodes
        self.greedy_drafts = greedy_drafts  # draft argmax chains even when the request samples (fusion)
        self.seed = draft_seed(seed)
        self.handle: Handle | None = None
        self._opening: asyncio.Future | None = None
        self._opened_at = 0  # committed tokens the draft session was opened with
        self._fresh = True  # no proposal yet from this draft session
        self._refused: Refusal | None = None  # after a refusal: when to ask again
        self._failures = 0
        self._failures_epoch: int | None = None
        self.session: DecodeSession | None = None
        self._told = 0  # committed tokens the draft session has been told of (its text after the last Propose)

    def _linked(self) -> bool:
        return self.client is not None and self.client.connected.is_set()

    def begin(self, session: DecodeSession) -> None:
        self.session = session  # its last round reaches the draft at the close
        if self._linked():
            # A copy, taken now: the prefill appends to session.seq before the task may run.
            self._opening = asyncio.ensure_future(self._open(session, list(session.seq)))

    def _open(self, session: DecodeSession, text: list[int]):
        """Start opening a draft session from ``text`` (the draft's first proposal then
        reads what the target committed after it)."""
        self._opened_at, self._fresh = len(text), True
        return self._opened(session.params, text, len(text) - session.prompt_len + session.resumed)

    async def _opened(self, params, text: list[int], generated: int) -> Handle | None:
        epoch = self.client.epoch
        temperature = 0.0 if self.greedy_drafts else params.temperature
        reply = await self.client.open(text, temperature=temperature, top_p=params.top_p,
                                       top_k=params.top_k, seed=self.seed, max_tokens=params.max_tokens - generated,
                                       rules=params, generated=generated,
                                       reproducible=reproducible_draft(params))
        self._refused = None
        if not isinstance(reply, tuple) and self.client.epoch == epoch:  # refused on a live link
            self._refused = refusal(reply, epoch)
        return reply if isinstance(reply, tuple) else None

    def _may_reopen(self) -> bool:
        return (self._linked() and may_ask_again(self._refused, self.client.epoch)
                and (self._failures < MAX_FAILURES_IN_A_ROW or self._failures_epoch != self.client.epoch))

    @property
    def fresh(self) -> bool:
        """No proposal yet from this draft session (it reads the text it was opened with first)."""
        return self.handle is None or self._fresh

    async def propose(self, session: DecodeSession, outcome: tuple[list[int], list[int]] | None = None,
                      timeout_s: float | None = None, max_depth: int = 0) -> Drafted:
        """``outcome``: what to tell the draft about the rounds since its last proposal,
        instead of the last round's path and tokens (a draft that other drafters were fused
        with, or that sat rounds out); ``timeout_s``: a deadline shorter than the client's;
        ``max_depth``: a chain or tree at most that deep (0: the draft's own depth)."""
        if self.client is None:  # no draft server configured: autoregressive by choice, not a fallback
            return Drafted(None, 0.0)
        started = time.perf_counter()
        if self._opening is not None:
            # Shielded and left in _opening until it is ours: a round cancelled in the step
            # the opening completes would otherwise drop the handle, and close() could not
            # close a draft session it never saw.
            self.handle = await asyncio.shield(self._opening)
            self._opening = None
        elif self.handle is None and self._may_reopen():
            # The root stays out of the draft's text: it is the first outcome's token.
            self.handle = await self._open(session, session.seq[:-1])
        if self.handle is None:
            return Drafted(None, time.perf_counter() - started, FALLBACK_DRAFT_DOWN)
        timeout = timeout_s
        if self._fresh:  # the draft first reads the whole text it was opened with: a long prompt takes long
            path, tokens = [], session.seq[self._opened_at:]
            timeout = self.client.timeout_s * (1 + self._opened_at / PREFILL_TOKENS_PER_TIMEOUT)
        elif outcome is not None:
            path, tokens = outcome
        else:
            path, tokens = session.last_path, session.last_committed
        # the draft reads this Propose whatever comes back (a session ended while it is out closes
        # after it): its text is the session's now (a fused round may go on while it is out)
        self._fresh, self._told = False, len(session.seq)
        reply = await self.client.propose(self.handle, path, tokens, timeout, max_depth)
        waited = time.perf_counter() - started
        if reply is None:
            self.client.close(self.handle)
            self.handle = None
            self._failures += 1
            self._failures_epoch = self.client.epoch
            if self._failures == MAX_FAILURES_IN_A_ROW:
                log.warning("a session's draft failed %d rounds in a row; it decodes autoregressively until the "
                            "draft server reconnects", MAX_FAILURES_IN_A_ROW)
            return Drafted(None, waited, FALLBACK_DRAFT_FAILED)
        self._failures = 0
        proposal = self._checked(reply, session)
        return Drafted(proposal, waited, None if proposal is not None else FALLBACK_BAD_PROPOSAL)

    def _checked(self, reply: ProposalMsg, session: DecodeSession) -> Proposal | None:
        """A proposal that does not fit this session is dropped: the round runs autoregressively
        (and the draft learns it as an outcome with nothing accepted)."""
        vocab = session.target.spec.vocab_size
        try:
            proposal = proposal_from_message(reply, vocab)
        except ProtocolError as exc:
            log.warning("ignoring a bad proposal: %s", exc)
            return None
        tokens = proposal.tree.tokens
        if len(tokens) > session.max_nodes or tokens[0] != session.seq[-1] or max(tokens) >= vocab or min(tokens) < 0:
            log.warning("ignoring a proposal that does not fit the session")
            return None
        return proposal

    def close(self) -> None:
        if self.client is None:
            return
        if self._opening is not None:
            # Still opening (the session ended during its prefill): close what it opens.
            self._opening.add_done_callback(self._close_opened)
            self._opening = None
        if self.handle is not None:
            told, seq = self._told, self.session.seq if self.session is not None else []
            # the rounds after its last proposal (a fresh session has read nothing: it learns nothing)
            self.client.close(self.handle, seq[told:] if not self._fresh and told else None)
            self.handle = None

    def _close_opened(self, opening: asyncio.Future) -> None:
        if not opening.cancelled() and opening.exception() is None:
            self.client.close(opening.result())
