"""What a request changes in the target's logits before temperature, top-k, top-p and min-p,
in vLLM's order: vLLM's ``allowed_token_ids`` (every other token barred), its ``bad_words`` (a word's last token barred where the output ends with the
rest of it), ``logit_bias`` (added), ``min_tokens`` (the stop tokens barred until that
many tokens are out), then the penalties — transformers'/vLLM's ``repetition_penalty`` (over
prompt and output) and OpenAI's ``presence_penalty`` and ``frequency_penalty`` (over the
output); or, with ``penalty_last_n`` (llama.cpp's ``repeat_last_n``), all three over the text's
last n tokens, the prompt's included, as llama.cpp's penalties sampler counts them. Greedy
decoding takes the argmax of the result, as vLLM does. A grammar (structured output,
spec.structured) masks the row first; where it has ended, min_tokens bars nothing (the grammar
allows only the stop tokens there).

They are part of the target's distribution, so verification applies them: a proposal node's
row is adjusted for the text it follows (the committed text, then the node's own path), which
is what decoding with the target alone computes at that point. The draft applies them too
(``LogitRules.guide``: a copy of the session's state, or one the draft server builds from the
session's parameters), so it drafts what the target is likely to accept; a draft that could
not would cost acceptance, never exactness."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from specctl.engine.spec import check_token_ids
from specctl.spec.params import SamplingParams
from specctl.spec.structured import Structure
from specctl.spec.thinking_budget import ThinkingBudget

log = logging.getLogger("specctl.draft")


class LogitRules:
    """One session's rules and the state they need: which tokens the prompt holds, how often
    each token came in the output so far, how many tokens are out (on the target's device)."""

    def __init__(self, params: SamplingParams, prompt: list[int], stop_ids: set[int], vocab_size: int,
                 device: torch.device, structure: Structure | None = None) -> None:
        self.structure = structure
        self.presence, self.frequency, self.repetition = (params.presence_penalty, params.frequency_penalty,
                                                          params.repetition_penalty)
        self.min_tokens, self.produced = params.min_tokens, 0
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        self.bias = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            ids, values = zip(*params.logit_bias)
            self.bias[torch.tensor(ids, device=device)] = torch.tensor(values, device=device)
        self.bad_words = params.bad_words
        self.allowed = None  # vLLM's allowed_token_ids: True where a token may come
        if params.allowed_token_ids:
            self.allowed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.allowed[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=device)] = True
        # the output's last tokens a bad word's start may lie in (vLLM matches bad words over the output)
        self.bad_reach = max((len(word) - 1 for word in self.bad_words), default=0)
        self.tail: list[int] = []
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.in_prompt[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        self.window = params.penalty_last_n  # 0: vLLM's penalties; n: over the text's last n tokens
        self.recent = list(prompt[-self.window:]) if self.window else []
        self.thinking = None if params.thinking_budget is None else ThinkingBudget(params.thinking_budget,
                                                                                   *params.thinking_markers)
        self.thought = None if self.thinking is None else self.thinking.of_prompt(prompt)
        # whether they may leave a row without a token (the others only add finite values)
        self.can_bar = (self.allowed is not None or bool(self.bad_words) or structure is not None
                        or bool(self.min_tokens and stop_ids))
        self.barred: torch.Tensor | None = None  # [rows] of the last apply: True where no token was left
        self.ended: list[bool] = []  # of the last apply's rows: where the grammar had ended (only a stop token left)
        self.grammar_rows: torch.Tensor | None = None  # of the last apply's rows: the tokens the grammar allowed

    def guide(self, device: torch.device) -> "LogitRules":
        """A copy of this state for a draft on ``device`` (spec.batch_drafting adjusts its rows),
        kept up to date with each outcome by ``record``."""
        guide = copy.copy(self)  # every field as is; then the state it changes or keeps on a device, its own
        guide.stop_ids, guide.counts, guide.in_prompt = (self.stop_ids.to(device), self.counts.to(device, copy=True),
                                                         self.in_prompt.to(device))
        guide.tail, guide.recent = list(self.tail), list(self.recent)
        guide.bias = None if self.bias is None else self.bias.to(device)
        guide.allowed = None if self.allowed is None else self.allowed.to(device)
        guide.structure = None if self.structure is None else self.structure.guide(device)
        return guide

    def record(self, tokens: list[int]) -> None:
        """Output tokens committed."""
        self.produced += len(tokens)
        if self.bad_reach:
            self.tail = (self.tail + list(tokens))[-self.bad_reach:]
        if self.window:
            self.recent = (self.recent + list(tokens))[-self.window:]
        if self.structure is not None:
            self.structure.record(tokens)
        if self.thinking is not None:
            self.thought = self.thinking.after(self.thought, tokens)
        if tokens:
            self.counts.index_add_(0, torch.tensor(tokens, dtype=torch.long, device=self.counts.device),
                                   torch.ones(len(tokens), device=self.counts.device))

    def apply(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """``logits`` [rows, vocab] adjusted; row r follows the output so far, then ``paths[r]``
        (a proposal node's tokens past the committed text, its own included). A thought past its
        budget allows only its end's next token, whatever the other rules say (vLLM forces it last)."""
        logits = self._thought_ended(self._adjusted(logits, paths), paths)
        if not self.can_bar:
            self.barred = None
            return logits
        # a row left without a token (every logit -inf) takes token 0, as its argmax would: every
        # mode and the draft then take the same token rather than draw from NaNs, and the target's
        # session refuses to commit it (barred_at; found with the logits rather than read back now)
        self.barred = logits.amax(-1) == float("-inf")
        zeros = torch.zeros(len(paths), dtype=torch.long, device=logits.device)
        return logits.index_put((torch.arange(len(paths), device=logits.device), zeros),
                                torch.where(self.barred, 0.0, logits[:, 0]))

    def barred_at(self, rows: list[int]) -> list[bool]:
        """Whether each of ``rows`` of the last ``apply`` was left without a token (one read)."""
        if self.barred is None:
            return [False] * len(rows)
        return self.barred[torch.tensor(rows, device=self.barred.device)].tolist()

    def _thought_ended(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        if self.thinking is None:
            return logits
        forced = [(r, token) for r, path in enumerate(paths)
                  if (token := self.thinking.forced(self.thinking.after(self.thought, path))) is not None]
        if not forced:
            return logits
        rows = torch.tensor([r for r, _ in forced], device=logits.device)
        logits = logits.clone()
        logits[rows] = float("-inf")
        logits[rows, torch.tensor([token for _, token in forced], device=logits.device)] = 0.0
        if self.structure is not None:  # a grammar over the whole text refuses the end it refuses: no token then
            logits[rows] = logits[rows].masked_fill(~self.grammar_rows[rows], float("-inf"))
        return logits

    def _adjusted(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        logits = logits.float()
        ended = self.ended = [False] * len(paths)
        if self.structure is not None:
            allowed, ended = self.structure.allowed(paths)
            self.ended, self.grammar_rows = ended, allowed
            logits = logits.masked_fill(~allowed, float("-inf"))
        if self.allowed is not None:
            logits = logits.masked_fill(~self.allowed, float("-inf"))
        if self.bad_words:
            logits = self._bar_bad_words(logits, paths)
        if self.bias is not None:
            logits = logits + self.bias
        barred = [r for r, path in enumerate(paths) if self.produced + len(path) < self.min_tokens and not ended[r]]
        if barred and self.stop_ids.numel():
            logits = logits.clone()
            logits[torch.tensor(barred, device=logits.device).unsqueeze(1), self.stop_ids] = float("-inf")
        if self.repetition == 1.0 and not (self.frequency or self.presence):
            return logits
        counts = self._window_counts(logits, paths) if self.window else self._output_counts(logits, paths)
        if self.repetition != 1.0:
            seen = counts > 0 if self.window else self.in_prompt | (counts > 0)
            logits = torch.where(seen, torch.where(logits > 0, logits / self.repetition, logits * self.repetition),
                                 logits)
        if self.frequency or self.presence:
            logits = logits - self.frequency * counts - self.presence * (counts > 0).float()
        return logits

    def _output_counts(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """[rows, vocab]: each token's count in the output up to each row (its path included)."""
        counts = self.counts.expand(logits.shape[0], -1).clone()
        rows = [r for r, path in enumerate(paths) for _ in path]
        if rows:
            at = (torch.tensor(rows, device=counts.device), torch.tensor(sum(paths, []), device=counts.device))
            counts.index_put_(at, torch.ones(len(rows), device=counts.device), accumulate=True)
        return counts

    def _window_counts(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """[rows, vocab]: each token's count in the text's last ``window`` tokens up to each row."""
        windows = [(self.recent + path)[-self.window:] for path in paths]
        rows = torch.tensor([r for r, window in enumerate(windows) for _ in window], dtype=torch.long)
        ids = torch.tensor(sum(windows, []), dtype=torch.long)
        counts = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return counts.index_put_((rows.to(logits.device), ids.to(logits.device)),
                                 torch.ones(len(ids), device=logits.device), accumulate=True)

    def _bar_bad_words(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """vLLM's bad_words: a word's last token barred in each row whose text (the output so far,
        then the row's path) ends with the rest of the word; a one-token word everywhere."""
        rows, tokens = [], []
        for r, path in enumerate(paths):
            text = self.tail + path
            for word in self.bad_words:
                start = len(text) - (len(word) - 1)
                if start >= 0 and (len(word) == 1 or text[start:] == list(word[:-1])):
                    rows.append(r)
                    tokens.append(word[-1])
        if not rows:
            return logits
        return logits.index_put((torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device)),
                                torch.tensor(float("-inf"), device=logits.device))


def check_rule_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Refuse the rules' token ids past the vocabulary (BadRequest naming the field): logit_bias's,
    bad_words', allowed_token_ids' and a thinking budget's markers'."""
    check_token_ids([token for token, _ in params.logit_bias], vocab_size, "logit_bias token ids")
    check_token_ids([token for word in params.bad_words for token in word], vocab_size, "bad_words token ids")
    check_token_ids(list(params.allowed_token_ids), vocab_size, "allowed_token_ids")
    check_token_ids([token for marker in params.thinking_markers for token in marker], vocab_size,
                    "thinking_token_budget's markers")


def draft_guide(rules: SamplingParams, prompt: list[int], output: list[int], *, tokenizer: Any, vocab_size: int,
                stop_ids: set[int], device: torch.device) -> LogitRules | None:
    """The rules and grammar a draft server's session follows, built from the request's
    parameters (``output``: what the target committed before the session opened); None —
    drafting free, still lossless — when they cannot be (the target checks the request)."""
    try:
        structure = None if rules.structured is None else Structure(*rules.structured, tokenizer, vocab_size, stop_ids,
                                                                    device, strict=False)
        check_rule_token_ids(rules, vocab_size)
        guide = LogitRules(rules, prompt, stop_ids, vocab_size, device, structure)
        guide.record(output)
        return guide
    except Exception as exc:  # noqa: BLE001 - a guide, never a check
        log.warning("drafting without the request's logit rules: %s", exc)
        return None
