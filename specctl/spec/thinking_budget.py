"""vLLM's ``thinking_token_budget`` (Anthropic's ``thinking.budget_tokens``): a reasoning
model's thinking is cut at a number of tokens by forcing its end (``</think>``, the token or
tokens that end a thought) — the target's logits at that point allow only the next token of the
end, as vLLM's thinking-budget state forces them.

Tokens count from the thought's start: a prompt that ends inside one (a template that opened
``<think>``, as DeepSeek-R1's does) starts the output in thought, the tokens after its
``<think>`` counted (FastDeploy's rule, vLLM's in effect); a ``<think>`` the model writes opens
one (Qwen3's hybrid models write their own; one inside a thought starts its count again).
A thought that ends by itself within its budget is untouched; a later one counts afresh.
Budget 0 ends a thought at once.

It is part of the target's distribution (spec.logit_rules applies it to every row, a proposal
node's after its own path), so every mode — AR, chains, trees, predictions — gives the same
tokens: the budget is exact, and lossless as every rule is."""

from __future__ import annotations

from dataclasses import dataclass

MAX_MARKER_TOKENS = 8  # the most tokens <think> or </think> may take (a tokenizer without them as tokens)


@dataclass(frozen=True, slots=True)
class Thought:
    """Where a text stands: in a thought or not, the thought's tokens so far, its last tokens
    (enough to see a marker end)."""

    thinking: bool = False
    used: int = 0
    tail: tuple[int, ...] = ()


class ThinkingBudget:
    """The rule for one request: ``budget`` tokens a thought, ``start`` and ``end`` its markers' token ids."""

    def __init__(self, budget: int, start: tuple[int, ...], end: tuple[int, ...]) -> None:
        if budget < 0 or not 1 <= len(start) <= MAX_MARKER_TOKENS or not 1 <= len(end) <= MAX_MARKER_TOKENS:
            raise ValueError(f"a thinking budget is >= 0 tokens, with start and end markers of 1 to "
                             f"{MAX_MARKER_TOKENS} tokens")
        self.budget, self.start, self.end = budget, tuple(start), tuple(end)
        self.reach = max(len(self.start), len(self.end))

    def after(self, state: Thought, tokens) -> Thought:
        """The state after ``tokens`` follow a text in ``state``."""
        thinking, used, tail = state.thinking, state.used, state.tail
        for token in tokens:
            tail = (*tail, token)[-self.reach:]
            if thinking and tail[-len(self.end):] == self.end:
                thinking, used = False, 0
            elif tail[-len(self.start):] == self.start:
                thinking, used = True, 0
            elif thinking:
                used += 1
        return Thought(thinking, used, tail)

    def of_prompt(self, prompt: list[int]) -> Thought:
        """The state at the output's start: the prompt's last marker says whether it is in a
        thought, and the tokens after an open one count (a template's ``<think>\\n``)."""
        ends = {self.start[-1], self.end[-1]}

        def marker_ends_at(i: int) -> bool:  # a whole marker: a text marker's last token (">") comes alone too
            return prompt[i] in ends and any(i + 1 >= len(m) and tuple(prompt[i + 1 - len(m):i + 1]) == m
                                             for m in (self.start, self.end))

        last = next((i for i in range(len(prompt) - 1, -1, -1) if marker_ends_at(i)), None)
        begin = len(prompt) - self.reach if last is None else last - self.reach + 1
        return self.after(Thought(), prompt[max(begin, 0):])

    def forced(self, state: Thought) -> int | None:
        """The token the next one must be — the end marker's next, once the thought has used its
        budget — or None."""
        if not state.thinking or state.used < self.budget:
            return None
        # the end's tokens the text already ends with (a forced end of several tokens under way)
        done = next((k for k in range(len(self.end) - 1, 0, -1) if state.tail[-k:] == self.end[:k]), 0)
        return self.end[done]
