"""``generate --logprobs N`` and ``--prompt-logprobs N``: the target's log-probabilities of the
tokens it wrote (and of the prompt's), the way vLLM's offline ``SamplingParams(logprobs=,
prompt_logprobs=)`` hands them back — per token a dict {token id: {logprob, rank,
decoded_token}} of the token and its N likeliest alternatives, None for the prompt's first
token — in ``--json``, and as a table after the text otherwise. Pure functions of what the
session (local) or the target instance's TOKENS frames (``--remote``) gave."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from rich.table import Table

from specctl.gateway.responses import TokenLogprob, prompt_logprobs_body

if TYPE_CHECKING:  # the wire protocol imports torch: `specctl --help` should not wait for it
    from specctl.net.protocol import Tokens


class Scores:
    """What a generation's TOKENS carried: each output token's entry and, when asked, the
    prompt's (its first token's None: nothing precedes it)."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.output: list[TokenLogprob] = []
        self.prompt_entries: list[TokenLogprob] | None = None

    def add(self, event: Tokens) -> None:
        if event.prompt_logprobs and self.prompt_entries is None:
            self.prompt_entries = [TokenLogprob(self.prompt[0], None, [], []), *map(
                TokenLogprob, self.prompt[1:], event.prompt_logprobs, event.prompt_top_ids,
                event.prompt_top_logprobs, event.prompt_ranks)]
        self.output += [output_entry(*entry) for entry in
                        zip(event.tokens, event.logprobs, event.top_ids, event.top_logprobs, event.output_ranks())]


def output_entry(token: int, logprob: float, ids: list[int], values: list[float], rank: int | None) -> TokenLogprob:
    """An output token's entry; a rank not given is known where the token is among its
    alternatives (a peer before ranks were sent), else None."""
    if rank is None and token in ids:
        rank = ids.index(token) + 1
    return TokenLogprob(token, logprob, ids, values, rank)


def local_scores(prompt: list[int], output: list[int], logprobs: list[tuple], prompt_logprobs: list[tuple] | None,
                 ) -> Scores:
    """The entries of a session run in this process (spec.decode.DecodeSession's lists)."""
    scores = Scores(prompt)
    scores.output = [output_entry(token, *entry) for token, entry in zip(output, logprobs)]
    if prompt_logprobs is not None:
        scores.prompt_entries = [TokenLogprob(prompt[0], None, [], []),
                                 *(TokenLogprob(token, *entry) for token, entry in zip(prompt[1:], prompt_logprobs))]
    return scores


def as_json(scores: Scores, alternatives: int | None, prompt_alternatives: int | None,
            token_text: Callable[[int], str]) -> dict:
    """The ``logprobs`` / ``prompt_logprobs`` keys of ``generate --json`` (only those asked for)."""
    body = {}
    if alternatives is not None:
        body["logprobs"] = prompt_logprobs_body(scores.output, alternatives, token_text)
    if prompt_alternatives is not None and scores.prompt_entries is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(scores.prompt_entries, prompt_alternatives, token_text)
    return body


def table(title: str, entries: list[TokenLogprob], token_text: Callable[[int], str]) -> Table:
    """One row a token: its text, log-probability, probability, rank and alternatives."""
    grid = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for name, justify in (("#", "right"), ("token", "left"), ("logprob", "right"), ("p", "right"),
                          ("rank", "right"), ("alternatives", "left")):
        grid.add_column(name, justify=justify, no_wrap=name != "alternatives")
    for index, entry in enumerate(entries):
        if entry.logprob is None:
            grid.add_row(str(index), repr(token_text(entry.token)), "-", "-", "-", "")
            continue
        grid.add_row(str(index), repr(token_text(entry.token)), f"{entry.logprob:.4f}",
                     f"{math.exp(entry.logprob):.1%}", "-" if entry.rank is None else str(entry.rank),
                     "  ".join(f"{token_text(t)!r} {lp:.2f}" for t, lp in zip(entry.top_ids, entry.top_logprobs)))
    return grid
