"""One tagged union of typed messages, one encoder, one decoder (msgspec msgpack).

Frames are a 4-byte big-endian length followed by one msgpack message. Every message
carries its type in a ``type`` field; anything that does not decode into a known message
with valid fields becomes a ProtocolError. Tensors travel as {dtype, shape, data}
(net.tensor); the pipeline stages' messages are net.stage_messages and a client's and a
target's net.generate_messages, members of the union."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import msgspec

from specctl.errors import ProtocolError
from specctl.net.generate_messages import Cancel, Done, Generate, PromptProgress, Tokens
from specctl.net.stage_messages import StageClose, StageDrop, StageForward, StageKeep, StageOpen, StageOutput
from specctl.net.tensor import Tensor

if TYPE_CHECKING:  # imported where used (net.tensor says why)
    import torch

PROTOCOL_VERSION = 5  # 2: sparse q in Proposal, no per-node probs; 3: pipeline stage messages, bf16 tensors;
# 4: SpecPipe tree levels from a draft server; 5: GENERATE's resumed output (an older target would
# ignore it and repeat that output)
MAX_FRAME_BYTES = 16 << 20


# --- handshake -------------------------------------------------------------------------

class Challenge(msgspec.Struct, tag=True, frozen=True):
    """Server -> client, first frame: the nonce an auth token must sign."""
    version: int
    role: str
    nonce: bytes


class Hello(msgspec.Struct, tag=True, frozen=True):
    """Client -> server: who I am; ``auth`` = HMAC-SHA256(token, nonce) when a token is set."""
    version: int
    role: str
    fingerprint: str = ""
    model: str = ""
    auth: bytes = b""
    layers: list[int] = []  # a pipeline stage: the layer range [a, b) it holds (the next must start at b)


class Welcome(msgspec.Struct, tag=True, frozen=True):
    version: int
    role: str
    model: str
    fingerprint: str
    max_sessions: int


# --- target <-> draft ------------------------------------------------------------------

class DraftRules(msgspec.Struct, frozen=True, kw_only=True):
    """A request's logit rules and grammar (spec.logit_rules), which the draft follows; both
    opening messages carry them (keyword-only: each message's own fields come first)."""
    structured_kind: str = ""  # "" = none
    structured_spec: str = ""
    generated: int = 0  # the prompt's last tokens that are output already (the rules count them as output)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # of the whole output, ``generated`` included
    logit_bias: dict[int, float] = {}
    bad_words: list[list[int]] = []
    penalty_last_n: int = 0  # the penalties' window (SamplingParams.penalty_last_n)
    allowed_token_ids: list[int] = []  # vLLM's: only these may come (empty: any)
    thinking_budget: int = -1  # SamplingParams.thinking_budget (-1: none) and its markers
    thinking_start: list[int] = []
    thinking_end: list[int] = []


class OpenSession(DraftRules, tag=True, frozen=True):
    req: int
    prompt: list[int]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 128
    min_p: float = 0.0
    # a seeded sampled request: drafted as a cold start alone would (DraftState.reproducible)
    reproducible: bool = False
    sampler_order: list[str] = []  # SamplingParams.sampler_order (empty: temperature first)
    cache_salt: str = ""  # the session's prefix-cache namespace (SamplingParams.cache_salt)


class SessionOpened(msgspec.Struct, tag=True, frozen=True):
    req: int
    tag: int


class Propose(msgspec.Struct, tag=True, frozen=True):
    """The outcome of the last round (accepted node indices) and the tokens it committed
    (accepted + bonus); the draft answers with the next proposal, a chain or tree at most
    ``max_depth`` tokens deep (0: the draft's own depth; the target's load, spec.turns)."""
    tag: int
    path: list[int]
    tokens: list[int]
    max_depth: int = 0


class SparseProbs(msgspec.Struct, frozen=True):
    """Rows of probabilities that are zero outside a small support (a sampled draft's q, cut
    to its top tokens before sampling): [rows, k] token ids and their probabilities. The
    receiver rebuilds the exact dense rows; a round's frame stays kilobytes at any vocabulary."""
    ids: Tensor  # int64 [rows, k]
    probs: Tensor  # float32 [rows, k]

    @classmethod
    def from_dense(cls, rows: torch.Tensor) -> "SparseProbs":
        support = int((rows > 0).sum(-1).max()) if rows.numel() else 0
        values, ids = rows.float().topk(max(support, 1), dim=-1)
        return cls(Tensor.from_torch(ids), Tensor.from_torch(values))

    def checked(self, vocab_size: int) -> int:
        """The rows, once the ids and probabilities are found to be rows of one vocabulary
        (ProtocolError if not). Small [rows, k] work in numpy: fine on the event loop's thread."""
        if (self.ids.dtype, self.probs.dtype) != ("int64", "float32") or len(self.ids.shape) != 2 \
                or self.ids.shape != self.probs.shape:
            raise ProtocolError("sparse probabilities need int64 ids and float32 probs of the same [rows, k] shape")
        ids = self.ids.to_numpy()
        self.probs.to_numpy()  # its bytes add up
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ProtocolError(f"sparse probability ids must be in [0, {vocab_size})")
        return ids.shape[0]

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        """The dense [rows, vocab] rows: vocabulary-wide work, for the compute thread."""
        import torch

        self.checked(vocab_size)
        return torch.zeros(self.ids.shape[0], vocab_size).scatter_(1, self.ids.to_torch(), self.probs.to_torch())


class Proposal(msgspec.Struct, tag=True, frozen=True):
    tag: int
    tokens: list[int]  # BFS order, root first
    parents: list[int]  # -1 for the root
    draft_probs: SparseProbs | None = None  # q of a sampled chain, one row per drafted token
    # The draft's confidence in each node after the root (its probability given the parent),
    # a byte each, round(255 c): what fusion orders siblings by. Empty: not given.
    confidences: bytes = b""

    @staticmethod
    def pack_confidences(probs: list[float]) -> bytes:
        return bytes(min(255, max(0, round(255 * p))) for p in probs)

    def unpacked_confidences(self) -> list[float] | None:
        if not self.confidences:
            return None
        if len(self.confidences) != len(self.tokens) - 1:
            raise ProtocolError(f"{len(self.confidences)} confidences for {len(self.tokens) - 1} drafted tokens")
        return [1.0] + [c / 255 for c in self.confidences]


class CloseSession(msgspec.Struct, tag=True, frozen=True):
    """Free a draft session. ``tokens``: the text committed after the last Propose (the last
    round's accepted tokens and bonus), which no proposal followed: a drafter that learns from
    outputs (suffix decoding) remembers them; empty from older peers, which is only a loss of
    what it could learn."""
    tag: int
    tokens: list[int] = []


# --- SpecPipe's stage 1 <-> draft: a tree grown one level per pipeline step ------------------
# The draft server keeps the session's tree; stage 1 mirrors it (the same node ids, as both
# add the same nodes in the same order and re-root the same way).

class OpenLevels(DraftRules, tag=True, frozen=True):
    """Open a tree-level session on ``prompt``, the text before the first tree's root (stage 1
    sends the prompt but its last token, the root); answered by SessionOpened. The levels
    follow the request's rules, counting each re-rooting's token as output."""
    req: int
    prompt: list[int]
    width: int  # nodes per level
    topk: int  # children considered per node
    capacity: int  # KV positions the session may need: text + new tokens + tree nodes
    spread: str = "likeliest"  # how a level's nodes are chosen (pipeline.token_source.TreeShape)


class NextLevel(msgspec.Struct, tag=True, frozen=True):
    """Read the ``frontier`` nodes (the last level) and answer the next level (Level)."""
    tag: int
    frontier: list[int]


class Level(msgspec.Struct, tag=True, frozen=True):
    tag: int
    nodes: list[int]  # the new nodes' ids
    tokens: list[int]
    parents: list[int]
    scores: list[float]  # the draft's probability of each node's path


class Reroot(msgspec.Struct, tag=True, frozen=True):
    """The target verified ``committed``'s next token: keep ``new_root``'s subtree, or (new_root
    = -1) start a fresh tree whose root is ``token`` at ``position``. committed = -1: the first tree."""
    tag: int
    committed: int
    new_root: int
    token: int
    position: int


class Graft(msgspec.Struct, tag=True, frozen=True):
    """Hang ``tokens`` (a request's prediction, pipeline.predicted) as a chain under node
    ``parent``; the draft reads them with its next level under them."""
    tag: int
    parent: int
    tokens: list[int]


# --- any role ----------------------------------------------------------------------------

class StatsRequest(msgspec.Struct, tag=True, frozen=True):
    pass


class Stats(msgspec.Struct, tag=True, frozen=True):
    role: str
    stats: dict


class FlushCache(msgspec.Struct, tag=True, frozen=True):
    """Drop every entry of the role's prefix cache (vLLM's /reset_prefix_cache, SGLang's
    /flush_cache); sessions running go on, and prompts after it prefill from scratch."""


class CacheFlushed(msgspec.Struct, tag=True, frozen=True):
    role: str
    entries: int  # the texts dropped (0 for a role without a prefix cache)
    freed_bytes: int


class Error(msgspec.Struct, tag=True, frozen=True):
    code: str
    message: str
    req: int | None = None
    tag: int | None = None


Message = Union[
    Challenge, Hello, Welcome, OpenSession, SessionOpened, Propose, Proposal, CloseSession,
    Generate, Tokens, PromptProgress, Done, Cancel, StatsRequest, Stats, FlushCache, CacheFlushed, Error,
    StageOpen, StageForward, StageKeep, StageClose, StageDrop, StageOutput,
    OpenLevels, NextLevel, Level, Reroot, Graft,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """One frame: 4-byte big-endian length + msgpack body."""
    body = _encoder.encode(message)
    return len(body).to_bytes(4, "big") + body


def decode(body: bytes) -> Message:
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed frame: {exc}") from None
