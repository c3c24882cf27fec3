"""Sampling penalties: OpenAI's ``presence_penalty`` and ``frequency_penalty`` (over the
output's tokens) and transformers'/vLLM's ``repetition_penalty`` (over prompt and output),
applied to the target's logits before temperature, top-k and top-p, greedy included — vLLM's
order and semantics. They are part of the target's distribution, so verification applies
them: a proposal node's row is penalized with the text it follows (the committed text, then
the node's own path), which is what decoding with the target alone computes at that point.
The draft does not apply them: a penalty it did not foresee costs acceptance, never exactness."""

from __future__ import annotations

import torch

from specctl.spec.sampling import SamplingParams


class Penalties:
    """One session's penalty state: which tokens the prompt holds, how often each token came
    in the output so far (on the target's device)."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab_size: int, device: torch.device) -> None:
        self.presence, self.frequency, self.repetition = (params.presence_penalty, params.frequency_penalty,
                                                          params.repetition_penalty)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.in_prompt[torch.tensor(prompt, dtype=torch.long, device=device)] = True

    def record(self, tokens: list[int]) -> None:
        """Output tokens committed."""
        if tokens:
            self.counts.index_add_(0, torch.tensor(tokens, dtype=torch.long, device=self.counts.device),
                                   torch.ones(len(tokens), device=self.counts.device))

    def apply(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """``logits`` [rows, vocab] penalized; row r follows the output so far, then ``paths[r]``
        (a proposal node's tokens past the committed text, its own included)."""
        counts = self.counts.expand(logits.shape[0], -1).clone()
        rows = [r for r, path in enumerate(paths) for _ in path]
        if rows:
            at = (torch.tensor(rows, device=counts.device), torch.tensor(sum(paths, []), device=counts.device))
            counts.index_put_(at, torch.ones(len(rows), device=counts.device), accumulate=True)
        logits = logits.float()
        if self.repetition != 1.0:
            seen = self.in_prompt | (counts > 0)
            logits = torch.where(seen, torch.where(logits > 0, logits / self.repetition, logits * self.repetition),
                                 logits)
        if self.frequency or self.presence:
            logits = logits - self.frequency * counts - self.presence * (counts > 0).float()
        return logits
