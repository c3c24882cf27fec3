"""The target side of one session: verify a proposal, accept, commit.

The target's KV cache always holds the committed sequence minus its last token (the
root of the next proposal). Each round the whole proposal tree is verified in one target
forward with the tree mask; the accepted path's KV is kept (gather), the rest dropped."""

from __future__ import annotations

import time
from typing import Any

import torch

from specctl.engine.kv_cache import KVPool
from specctl.engine.model import Decoder
from specctl.engine.prefill_jobs import next_job_end
from specctl.engine.tree import TokenTree
from specctl.errors import BadRequest, NoTokenAllowed, PromptTooLong
from specctl.spec.drafters import Proposal
from specctl.spec.logprobs import PromptLogprob, TokenLogprob, score_prompt, token_logprobs
from specctl.spec.logit_rules import LogitRules
from specctl.spec.params import SamplingParams
from specctl.spec.run_ahead import RunningAhead, runs_ahead
from specctl.spec.sampling import probs_from_logits, sample
from specctl.spec.stats import GenerationStats
from specctl.spec.structured import Structure
from specctl.spec.verify import accept_proposal


class DecodeSession(RunningAhead):
    """The target side of one session: its KV cache, committed text and output. Rounds are
    driven by ``spec.rounds.run_session``; this class verifies and accepts."""

    def __init__(
        self,
        target: Decoder,
        prompt: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        max_context: int | None = None,
        pool: KVPool | None = None,
        max_nodes: int = 1,
        run_ahead: bool | None = None,
        tokenizer: Any = None,
        resumed: list[int] | tuple[int, ...] = (),
    ) -> None:
        """``resumed``: output another instance already sent for this generation (one lost
        mid-stream, taken over here): prefilled after the prompt and counted as output by
        max_tokens and the logit rules, never emitted again."""
        if not prompt:
            raise PromptTooLong("the prompt is empty: give at least one token")
        limit = max_context or target.spec.max_position
        if len(prompt) + params.max_tokens > limit:
            raise PromptTooLong(
                f"prompt of {len(prompt)} tokens plus max_tokens {params.max_tokens} exceeds the context "
                f"of {limit} tokens; shorten the prompt or lower max_tokens"
            )
        if len(resumed) >= params.max_tokens:
            raise BadRequest(f"a resumed generation's {len(resumed)} tokens leave none of max_tokens "
                             f"{params.max_tokens} to generate")
        self.target, self.params = target, params
        # the text before the first round, prefilled: the prompt and a resumed generation's output
        self.prompt_len = len(prompt) + len(resumed)
        self.resumed = len(resumed)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.max_nodes = max_nodes  # the largest tree a round may verify (root included)
        self.capacity = len(prompt) + params.max_tokens + max_nodes + 1
        # of the prompt's tokens after the first, when params.prompt_logprobs asks: a pass of its own,
        # its scratch KV freed before the session's is taken
        self.prompt_logprobs: list[PromptLogprob] | None = (
            None if params.prompt_logprobs is None else score_prompt(target, prompt, params.prompt_logprobs, pool))
        self.cache = target.new_cache(self.capacity, pool)
        self.cache.salt = params.cache_salt  # its prefix cache's namespace (vLLM's cache_salt)
        self.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else int(time.time_ns()))
        self.seq = [*prompt, *resumed]
        self.output: list[int] = list(resumed)
        self.stop_token: int | None = None  # the EOS or stop token that ended the output (left out of it)
        self.finish_reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.logprobs: list[TokenLogprob] = []  # of each output token, when params.logprobs asks for them
        self.last_path: list[int] = []  # the last round's accepted nodes (root excluded)
        self.last_committed: list[int] = []  # ... and the tokens it committed (accepted + bonus)
        self.prefilled: int | None = None  # prompt positions in the cache (None: the prefill has not begun)
        if params.structured is not None and tokenizer is None:
            raise BadRequest("structured output needs the target's tokenizer, which this caller did not give")
        structure = (None if params.structured is None else
                     Structure(*params.structured, tokenizer, target.spec.vocab_size, self.stop_ids, target.device))
        self.rules = (LogitRules(params, prompt, self.stop_ids, target.spec.vocab_size, target.device, structure)
                      if params.adjusts_logits else None)  # None: nothing to compute
        if self.rules is not None and resumed:
            self.rules.record(list(resumed))  # penalties, min_tokens, the grammar, a thought: where they stood
        # Run ahead (AR): the next step is launched with its token still on the device,
        # and the token read back while that step runs. ``ahead`` holds that step's logits: the
        # next root's verification, already in the cache. None (auto): see runs_ahead.
        self.run_ahead = runs_ahead(params, max_nodes, target) if run_ahead is None else run_ahead
        if self.rules is not None:
            self.run_ahead = False  # see runs_ahead
        self.ahead: torch.Tensor | None = None
        self.steps_ahead = 0  # steps run ahead (used + dropped), for the tests
        on_cuda = self.run_ahead and target.device.type == "cuda"
        self._token_host = torch.zeros(1, dtype=torch.long, pin_memory=on_cuda)
        self._token_read = torch.cuda.Event() if on_cuda else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, tokens: list[int], rows: torch.Tensor | None = None, at: list[int] | None = None) -> list[int]:
        """Append verified tokens (up to a stop token or max_tokens); returns those emitted.
        ``rows``, ``at``: as ``_emit``'s."""
        return self._emit(tokens, rows, at)

    def scored_next(self, logits: torch.Tensor) -> torch.Tensor:
        """One row of the target's logits after the committed text, as the acceptance rule
        reads it: adjusted by the request's logit rules when it has some."""
        return self._scored(logits, None)

    def _emit(self, tokens: list[int], rows: torch.Tensor | None = None, at: list[int] | None = None) -> list[int]:
        """Commit ``tokens`` up to a stop token or max_tokens; ``rows``: the target's logits each
        token was chosen from (their log-probabilities are kept when the request asks); ``at``:
        the rows of the last rules' ``apply`` each was chosen at. A token taken where the rules
        left none (the target alone would take it there too) ends the session: NoTokenAllowed."""
        emitted = []
        barred = self.rules.barred_at(at) if self.rules is not None and self.rules.can_bar and at else []
        ended = [self.rules.ended[r] for r in at] if self.rules is not None and self.rules.structure and at else []
        for i, token in enumerate(tokens):
            if i < len(ended) and ended[i]:  # the grammar ended before this token: the target alone ends there
                self._grammar_ended()
                break
            if i < len(barred) and barred[i]:
                raise NoTokenAllowed(f"no token is left to write after {len(self.output)} of output: the request's "
                                     "allowed_token_ids, bad_words, min_tokens, grammar and thinking budget together "
                                     "bar every one; loosen them")
            if token in self.stop_ids:
                self.finish_reason, self.stop_token = "stop", token
                break
            self.seq.append(token)
            self.output.append(token)
            emitted.append(token)
            if len(self.output) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        self.stats.new_tokens = len(self.output) - self.resumed
        if self.rules is not None:
            self.rules.record(emitted)
            structure = self.rules.structure
            if structure is not None and structure.finished and self.finish_reason is None:
                self._grammar_ended()
        if rows is not None and emitted and self.params.logprobs is not None:
            self.logprobs += token_logprobs(rows[: len(emitted)], emitted, self.params.logprobs)
        return emitted

    def _grammar_ended(self) -> None:
        """Only a stop token is left: the output ends as with the model's end token, which the
        target would write next (vLLM's token_ids hold it) — in every mode, whether the round
        that ended the grammar computed that row or not."""
        end = self.rules.structure.end_token
        self.finish_reason, self.stop_token = "stop", end if end in self.stop_ids else None

    def prefill(self) -> list[int]:
        """The whole prompt's prefill (its chunks one after the other); the first tokens emitted."""
        while (first := self.prefill_step()) is None:
            pass
        return first

    def prefill_step(self) -> list[int] | None:
        """The prompt's next job of positions (engine.prefill_jobs: ``target.prefill_chunk`` at the
        start, fewer deeper in a long prompt; 0: all of them) into the cache: the first tokens
        emitted once the prompt is in, None while some are left. Run as jobs of
        their own, other sessions' rounds run between them (vLLM's chunked prefill); the chunks
        depend on the prompt only, so every session of the target, every mode, computes alike."""
        prefixes = getattr(self.target, "prefix_cache", None)  # a pipeline's target has none
        if self.prefilled is None:  # the first chunk: a cached start of the prompt is restored
            self.prefilled = prefixes.restore(self.seq, self.cache) if prefixes is not None else 0
            # of the prompt's (a resumed output restored too is no prompt token of the request's)
            self.stats.cached_prompt_tokens = min(self.prefilled, self.prompt_len - self.resumed)
        start = self.prefilled
        end = next_job_end(self.target, start, len(self.seq))
        logits = self.target(torch.tensor(self.seq[start:end], dtype=torch.long), torch.arange(start, end), self.cache,
                             logits_at=torch.tensor([end - start - 1]))
        self.prefilled = end
        if end < len(self.seq):
            return None
        if prefixes is not None:
            # the prompt's KV now, not only at the end: a session that starts the same way while
            # this one decodes (a shared system prompt, a request's next choice) reuses it
            prefixes.store(self.seq, self.cache)
        if self.run_ahead:
            first = self._read_running_ahead(logits)
        else:
            scored = self._scored(logits, None)
            first = (int(scored[0].argmax()) if self.params.greedy
                     else sample(probs_from_logits(scored, self.params)[0], self.generator))  # [1, vocab], as a round's
        self.last_committed = [first]
        return self._settle_ahead(self._emit([first], logits[-1:], None if self.run_ahead else [0]))

    def apply(self, proposal: Proposal) -> list[int]:
        """Verify a proposal and commit what is accepted. ``last_path`` and
        ``last_committed`` then describe the outcome for the drafter."""
        proposal = proposal.built()
        ahead = self.take_ahead(proposal)
        if ahead is not None:
            return self.accept(proposal, ahead)
        tokens, positions, mask = self.verify_inputs(proposal)
        return self.accept(proposal, self.target(tokens, positions, self.cache, mask=mask))

    def verify_inputs(self, proposal: Proposal) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The target forward that verifies a proposal: tree tokens, their positions
        (prefix length + depth) and the tree mask over prefix + tree (None = one token)."""
        if proposal.tree.tokens[0] != self.seq[-1]:
            raise ValueError("proposal root is not the last committed token")
        if len(proposal.tree) > self.max_nodes:
            raise ValueError(f"proposal of {len(proposal.tree)} nodes exceeds the session's {self.max_nodes}")
        tree, prefix = proposal.tree, len(self.seq) - 1
        mask = None if len(tree) == 1 else torch.cat([torch.ones(len(tree), prefix, dtype=torch.bool), tree.mask], 1)
        return tree.tokens, prefix + tree.depth, mask

    def accept(self, proposal: Proposal, logits: torch.Tensor) -> list[int]:
        """Apply the acceptance rule to the target's logits over the tree, keep the accepted
        path's KV, commit accepted tokens + bonus."""
        tree, prefix = proposal.tree, len(self.seq) - 1
        if len(tree) == 1:  # the root alone: its KV is where it belongs, nothing to gather
            if self.run_ahead:
                bonus = self._read_running_ahead(logits)
            else:
                bonus = accept_proposal(self._scored(logits, tree), proposal, self.params, self.generator)[1]
            self.last_path, self.last_committed = [], [bonus]
            return self._settle_ahead(self._emit(self.last_committed, logits[:1], None if self.run_ahead else [0]))
        path, bonus = accept_proposal(self._scored(logits, tree), proposal, self.params, self.generator)
        self.cache.gather(torch.cat([torch.arange(prefix), prefix + torch.tensor([0, *path], dtype=torch.long)]))
        self.last_path = path
        self.last_committed = [int(t) for t in tree.tokens[path].tolist()] + [bonus]
        # token i of the path was chosen at its parent's row (the root's, then the path's), the bonus at the last one's
        rows = logits[torch.tensor([0, *path], device=logits.device)] if self.params.logprobs is not None else None
        return self._emit(self.last_committed, rows, [0, *path])

    def _scored(self, logits: torch.Tensor, tree: TokenTree | None) -> torch.Tensor:
        """The logits the acceptance rule reads: the target's, adjusted when the request asks
        (row j for the text up to ``tree``'s node j; None: one row after the committed text)."""
        if self.rules is None:
            return logits
        paths = [[]] if tree is None else [tree.tokens[tree.path_to(j)[1:]].tolist() for j in range(len(tree))]
        return self.rules.apply(logits, paths)

    def close(self) -> None:
        prefixes = getattr(self.target, "prefix_cache", None)
        if prefixes is not None and not self.cache.released:
            if self.finished:
                # the committed text's KV (a failed or cancelled session's cache may hold a forward's leftovers)
                prefixes.store(self.seq, self.cache)
            elif self.prefilled:
                # cancelled mid-prefill (a client that gave up on a long prompt): its chunks so far,
                # so that its retry goes on from them rather than from the start
                prefixes.store(self.seq[: self.prefilled], self.cache)
        self.cache.release()
