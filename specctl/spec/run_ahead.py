"""Running ahead (AR on CUDA graphs): a session launches the target's next step with its token
still on the device and reads the token back while that step runs. ``DecodeSession`` holds the
state (``ahead``: that step's logits, the next root's verification, already in the cache;
``_token_host`` and ``_token_read``: the pinned copy and its event); this mixin the steps."""

from __future__ import annotations

import torch

from specctl.engine.model import Decoder
from specctl.spec.drafters import Proposal
from specctl.spec.params import SamplingParams
from specctl.spec.sampling import checked_token, probs_from_logits, sample_tensor


def runs_ahead(params: SamplingParams, max_nodes: int, target: Decoder) -> bool:
    """Whether a session runs the target's next step before reading its token back: decoding
    with the target alone (every proposal the root: ``max_nodes`` 1) on CUDA graphs, greedy or
    sampled, where the host's part of a round (~0.4 ms beside a 2.4 ms 1.5B step on an H100)
    can overlap the device's. Elsewhere a step launched early only waits (the CPU computes as
    it launches) or is wasted (a proposal of several nodes re-verifies the root). Not when the
    request adjusts the logits (spec.logit_rules): the next token's rules need this one."""
    static = getattr(target, "static", None)  # a pipeline of stages has none
    return max_nodes == 1 and static is not None and static.graphs and not params.adjusts_logits


class RunningAhead:
    def take_ahead(self, proposal: Proposal) -> torch.Tensor | None:
        """The logits of the step run ahead, if this proposal is the root alone (they are its
        verification); for a larger proposal that step's KV is dropped and the tree verified."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        if len(proposal.tree) == 1 and proposal.tree.tokens[0] == self.seq[-1]:
            return ahead
        self.cache.truncate(len(self.seq) - 1)
        return None

    def _read_running_ahead(self, logits: torch.Tensor) -> int:
        """The token of the last row of ``logits`` (its argmax, or drawn as ``sample`` draws it:
        one uniform of the session's generator, the CDF inverted on the device): sent to the
        host, the next step launched with it on the device (unless the token ends the session by
        length), then read."""
        if self.params.greedy:
            token = logits[-1].argmax(-1, keepdim=True)  # [1], on the device
        else:
            # over a [1, vocab] row, as a verification of the root alone computes it: the same bits
            token = sample_tensor(probs_from_logits(logits[-1:], self.params)[0], self.generator).reshape(1)
        self._token_host.copy_(token, non_blocking=self._token_read is not None)
        if self._token_read is not None:
            self._token_read.record()  # before the next step in the stream: reading waits for the copy only
        if len(self.output) + 1 < self.params.max_tokens:
            position = torch.tensor([len(self.seq)])  # where the token will stand once committed
            # (-1, a distribution with no mass, fails below: the step must not index with it)
            fed = token if self.params.greedy else token.clamp(min=0)
            self.ahead = self.target(fed, position, self.cache)
            self.steps_ahead += 1
        if self._token_read is not None:
            self._token_read.synchronize()
        return checked_token(int(self._token_host[0]))

    def _settle_ahead(self, emitted: list[int]) -> list[int]:
        """A session that has finished (a stop token) drops the step run ahead and its KV."""
        if self.finished and self.ahead is not None:
            self.ahead = None
            self.cache.truncate(self.cache.length - 1)  # its KV is the last position
        return emitted
