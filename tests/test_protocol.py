"""The wire protocol: every message round-trips; garbage only ever yields ProtocolError."""

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specctl.net import protocol as p
from specctl.net.framing import read_message, sign, verify_signature

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)

EXAMPLES = [
    p.Challenge(1, "draft", b"\x00" * 32),
    p.Hello(1, "target", "abc", "model", b"sig"),
    p.Welcome(1, "draft", "m", "fp", 64),
    p.OpenSession(3, [1, 2, 3], 0.7, 0.9, 5, 42, 64),
    p.OpenSession(4, [1, 2, 3], 0.0, 1.0, 0, 0, 64, structured_kind="regex", structured_spec="[ab]+", generated=2),
    p.OpenLevels(4, [1, 2, 3], 4, 2, 200, repetition_penalty=1.3, bad_words=[[5, 6]], thinking_budget=3,
                 thinking_start=[7], thinking_end=[8]),
    p.SessionOpened(3, 17),
    p.Propose(17, [1, 2], [5, 6, 7]),
    p.Proposal(17, [5, 6, 7], [-1, 0, 1], p.SparseProbs.from_dense(torch.tensor([[0.0, 0.25, 0.75], [1.0, 0.0, 0.0]]))),
    p.Proposal(17, [5], [-1]),
    p.CloseSession(17),
    p.Generate(1, [1, 2], 32, 0.0, 1.0, 0, None, [2]),
    p.Generate(2, [1], 8, 0.7, 0.9, 5, 3, [], True, 2, 1, 0.5, 0.25, 1.2, 0.05, 4, {7: -100.0, 9: 2.5}, "json",
               '{"type": "object"}'),
    p.Tokens(2, [], prompt_logprobs=[-1.5], prompt_top_ids=[[3]], prompt_top_logprobs=[[-0.5]], prompt_ranks=[4]),
    p.Tokens(1, [4, 5]),
    p.PromptProgress(1, 40, 16, 24, 812.5),
    p.Done(1, "length", {"rounds": 3}),
    p.Cancel(1),
    p.StatsRequest(),
    p.Stats("draft", {"load": 0.5}),
    p.FlushCache(),
    p.CacheFlushed("target", 3, 1 << 20),
    p.Error("unknown_tag", "unknown session tag 9", tag=9),
    p.Proposal(17, [5, 6], [-1, 0], confidences=b"\x80"),
    p.OpenLevels(4, [1, 2, 3], 4, 2, 200),
    p.OpenLevels(4, [1, 2, 3], 4, 2, 200, "every-node"),
    p.NextLevel(17, [0, 3]),
    p.Level(17, [4, 5], [9, 8], [3, 3], [0.5, 0.25]),
    p.Reroot(17, 0, -1, 9, 12),
    p.StageOpen(3, 128),
    p.StageForward(5, [3], [2], p.Tensor.from_torch(torch.tensor([7, 8])), [None], [[0, 1]],
                   p.Tensor.from_torch(torch.zeros(2, 4)), "argmax", [6]),
    p.StageForward(5, [3], [2], p.Tensor.from_torch(torch.tensor([7, 8])), [None], [[0, 1]],
                   p.Tensor.from_torch(torch.empty(0, dtype=torch.long)), "argmax", [6], dropped=True),
    p.StageKeep(3, 9, [11, 12]),
    p.StageDrop(3, [6, 7]),
    p.StageDrop(3, [6, 7], [[0, 2], []]),
    p.StageClose(3),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    frame = p.encode(message)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert p.decode(frame[4:]) == message


def test_tensor_round_trip_and_validation():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(p.Tensor.from_torch(t).to_torch(), t)
    with pytest.raises(p.ProtocolError, match="needs 24 bytes, got 4"):
        p.Tensor("float32", [2, 3], b"\x00" * 4).to_torch()
    with pytest.raises(p.ProtocolError, match="unsupported tensor dtype 'complex64'"):
        p.Tensor("complex64", [1], b"\x00" * 8).to_torch()


def test_unknown_message_and_wrong_fields_are_protocol_errors():
    import msgspec

    with pytest.raises(p.ProtocolError, match="invalid message"):
        p.decode(msgspec.msgpack.encode({"type": "Teleport", "x": 1}))
    with pytest.raises(p.ProtocolError, match="invalid message"):
        p.decode(msgspec.msgpack.encode({"type": "Propose", "tag": "seventeen", "path": [], "tokens": []}))
    with pytest.raises(p.ProtocolError, match="malformed frame"):
        p.decode(b"\xc1")


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_decoder_fuzz_never_raises_anything_but_protocol_error(data):
    try:
        p.decode(data)
    except p.ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "tag", "req", "tokens", "path", "prompt", "x"]),
                       st.one_of(INT64, st.text(max_size=8), st.lists(INT64, max_size=4), st.none())))
def test_well_formed_msgpack_with_wrong_fields(obj):
    import msgspec

    try:
        p.decode(msgspec.msgpack.encode(obj))
    except p.ProtocolError:
        pass


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_huge_length_prefix_is_refused_before_reading():
    with pytest.raises(p.ProtocolError, match="exceeds the limit"):
        await read_message(_reader((2**31).to_bytes(4, "big")))


async def test_cut_frame_is_an_incomplete_read():
    frame = p.encode(p.Tokens(1, [1, 2, 3]))
    with pytest.raises(asyncio.IncompleteReadError):
        await read_message(_reader(frame[:-2]))


def test_hmac_signature():
    nonce = b"n" * 32
    assert verify_signature("secret", nonce, sign("secret", nonce))
    assert not verify_signature("secret", nonce, sign("other", nonce))


def test_a_sampled_chain_proposal_frame_stays_small_and_exact_at_qwen_vocabulary():
    from specctl.spec.sampling import DRAFT_SUPPORT, keep_top

    vocab, depth = 151936, 8
    q = keep_top(torch.randn(depth, vocab, generator=torch.Generator().manual_seed(0)).softmax(-1), DRAFT_SUPPORT)
    frame = p.encode(p.Proposal(3, list(range(depth + 1)), list(range(-1, depth)), p.SparseProbs.from_dense(q)))
    assert len(frame) < depth * DRAFT_SUPPORT * 12 + 512  # 8 + 4 bytes per kept entry, not 4 per vocabulary entry
    decoded = p.decode(frame[4:])
    assert torch.equal(decoded.draft_probs.to_dense(vocab), q)
    with pytest.raises(p.ProtocolError, match=r"^sparse probability ids must be in \[0, 1000\)$"):
        decoded.draft_probs.to_dense(1000)


def test_a_proposal_carries_the_drafts_confidence_in_a_byte_per_node():
    from specctl.verify.speculator import proposal_from_message

    Proposal = p.Proposal
    message = Proposal(3, [7, 1, 2, 4], [-1, 0, 0, 1], confidences=Proposal.pack_confidences([0.9, 0.05, 1.0]))
    again = p.decode(p.encode(message)[4:])
    assert again.confidences == bytes([230, 13, 255])
    proposal = proposal_from_message(again, 16)
    assert proposal.tree.probs == pytest.approx([1.0, 230 / 255, 13 / 255, 1.0])  # plain: the event loop's
    assert proposal.built().tree.probs.tolist() == pytest.approx(proposal.tree.probs)  # the compute thread's tensors
    assert proposal_from_message(Proposal(3, [7, 1], [-1, 0]), 16).tree.probs == [1.0, 1.0]  # none given
    with pytest.raises(p.ProtocolError, match="2 confidences for 1 drafted tokens"):
        proposal_from_message(Proposal(3, [7, 1], [-1, 0], confidences=b"\x01\x02"), 16)


def test_sampling_params_travel_whole_in_generate():
    """Every SamplingParams field reaches the target instance as the client set it."""
    from specctl.spec.params import SamplingParams
    from specctl.verify.wire_params import generate_message, sampling_params_of

    every = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=9, seed=3, stop_token_ids=(4, 2),
                           ignore_eos=True, logprobs=2, prompt_logprobs=0, presence_penalty=0.5, frequency_penalty=-0.25,
                           repetition_penalty=1.2, min_p=0.05, min_tokens=4, logit_bias=((7, -100.0), (9, 2.5)),
                           structured=("regex", "[ab]+"), bad_words=((3,), (8, 9)), penalty_last_n=64,
                           allowed_token_ids=(3, 9, 4), sampler_order=("top_k", "top_p", "min_p", "temperature"),
                           cache_salt="tenant-7", prediction=(9, 8, 9), thinking_budget=12,
                           thinking_markers=((6,), (7, 1)), prompt_progress=True)
    defaults = [name for name in SamplingParams.__slots__ if getattr(every, name) == getattr(SamplingParams(), name)]
    assert defaults == []  # the example sets every field: a new one must be added here
    for params in (every, SamplingParams()):
        sent = p.decode(p.encode(generate_message(1, [5, 6], params))[4:])
        assert sampling_params_of(sent) == params
    assert p.decode(p.encode(generate_message(1, [5], every, "trace-7-1"))[4:]).request_id == "trace-7-1"
    assert sent.request_id == ""  # none given: the target's log names the session by its number


def test_a_request_id_that_would_break_a_log_line_is_an_invalid_message():
    from specctl.verify.wire_params import generate_message
    from specctl.spec.params import SamplingParams

    for bad in ("two\nlines", "x" * 321, "caf\u00e9"):
        frame = p.encode(generate_message(1, [5], SamplingParams(), bad))
        with pytest.raises(p.ProtocolError, match=r"^invalid message: .*request_id"):
            p.decode(frame[4:])
    longest = "x" * 256 + "-127"  # the gateway's longest id, a request's last choice
    assert p.decode(p.encode(generate_message(1, [5], SamplingParams(), longest))[4:]).request_id == longest
