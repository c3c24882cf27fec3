"""Log-probabilities under the target (OpenAI's and vLLM's ``logprobs``): of the tokens a
session emits, from the rows they were chosen at, and of a prompt's own tokens (an echoed
prompt's, as lm-eval's loglikelihood tasks ask for them)."""

from __future__ import annotations

import torch

from specctl.engine.kv_cache import KVPool

# the token's log-probability; its alternatives' ids, theirs; its rank in its row (1: the likeliest; vLLM's:
# how many tokens are at least as likely, itself included)
TokenLogprob = tuple[float, list[int], list[float], int]
PromptLogprob = TokenLogprob
PROMPT_CHUNK = 512  # prompt rows scored per forward: bounds the logits held at once (rows x vocabulary)


def token_logprobs(rows: torch.Tensor, tokens: list[int], alternatives: int) -> list[TokenLogprob]:
    """Each token's log-probability under the target's raw distribution at its row (before
    temperature, top-k and top-p, as vLLM reports them), with the ``alternatives`` likeliest."""
    return _scored(rows.float().log_softmax(-1), tokens, alternatives)


def emitted_logprobs(session, count: int) -> list[TokenLogprob]:
    """The entries of a DecodeSession's last ``count`` emitted tokens (none when its request did
    not ask for log-probabilities)."""
    return session.logprobs[len(session.logprobs) - count:] if session.params.logprobs is not None else []


def _scored(logprobs: torch.Tensor, tokens: list[int], alternatives: int) -> list[TokenLogprob]:
    """Each token's entry from its row's log-probabilities."""
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).view(-1, 1))
    ranks = (logprobs >= chosen).sum(-1).tolist()
    if not alternatives:
        return [(lp, [], [], rank) for lp, rank in zip(chosen[:, 0].tolist(), ranks)]
    values, ids = logprobs.topk(alternatives, dim=-1)
    return list(zip(chosen[:, 0].tolist(), ids.tolist(), values.tolist(), ranks))


def score_prompt(target, prompt: list[int], alternatives: int, pool: KVPool | None = None) -> list[PromptLogprob]:
    """The log-probability of each prompt token after the first, given those before it, and its
    rank in that row (vLLM's: how many tokens are at least as likely, itself included).

    A pass of its own over a scratch cache (freed at once), in chunks of PROMPT_CHUNK rows:
    the session's prefill stays the one forward that decoding with the target alone runs, so
    asking for the prompt's log-probabilities never changes a bit of the output. It costs
    that second pass over the prompt."""
    cache = target.new_cache(len(prompt), pool)
    scored: list[PromptLogprob] = []
    try:
        for lo in range(0, len(prompt) - 1, PROMPT_CHUNK):  # the last row predicts the output, not the prompt
            hi = min(lo + PROMPT_CHUNK, len(prompt) - 1)
            logits = target(torch.tensor(prompt[lo:hi], dtype=torch.long), torch.arange(lo, hi), cache,
                            logits_at=torch.arange(hi - lo))
            scored += _scored(logits.float().log_softmax(-1), prompt[lo + 1:hi + 1], alternatives)
    finally:
        cache.release()
    return scored
