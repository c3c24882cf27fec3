"""Every mode on CUDA (skipped without a GPU): greedy output equal to the target alone, sampled
runs on device tensors, CUDA graphs on == off, bf16 speculative == bf16 AR, the star with a
CUDA draft and target, several drafters fused, a pre-speculating draft server, and PP, PP + chain
and SpecPipe through CUDA stages."""

import asyncio
import warnings

import pytest
import torch

from specctl.draft.server import DraftServer, DraftServerConfig
from specctl.engine.fusion import fuse_projections
from specctl.engine.loader import load_decoder, load_model
from specctl.engine.tiny import make_tiny_model
from specctl.engine.tree import TokenTree
from specctl.spec.decode import DecodeSession
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate
from specctl.spec.sampling import sample
from specctl.verify.client import remote_generate
from specctl.verify.draft_client import DraftClient
from specctl.verify.server import TargetServer, TargetServerConfig
from specctl_kernels import flashinfer_available

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 13, 2], [7, 8, 9, 10, 7, 8, 9] * 3, [100], list(range(30, 100))]


def _cuda(path, dtype=torch.float32, graphs=True, layers=None, backend="torch"):
    decoder = load_decoder(path, dtype, layer_range=layers, device="cuda", backend=backend)
    fuse_projections(decoder)
    return decoder.use_static_steps(graphs) if graphs else decoder


def _loader(device: str):
    """A decoder loader for the device: static steps on CUDA graphs there, plain fp32 elsewhere."""
    return _cuda if device == "cuda" else (lambda path: load_decoder(path, torch.float32, device=device))


def _drafters(draft):
    return {"chain": ModelChainDrafter(draft, 4), "tree": ModelTreeDrafter(draft, 3, 2, 3), "ngram": NgramDrafter(4)}


@pytest.fixture(scope="module")
def cuda_pair(tiny_dir):
    return _cuda(tiny_dir["qwen2"]), _cuda(tiny_dir["qwen2-draft"])


@pytest.mark.parametrize("mode", ["ar", "chain", "tree"])
def test_logprobs_on_cuda_are_the_same_in_every_mode_and_running_ahead(cuda_pair, mode):
    """Each token's log-probability and alternatives, read from device logits (graphs, run-ahead in ar)."""
    from specctl.spec.drafters import NoDrafter
    from specctl.spec.rounds import InlineLane, LocalSpeculator, run_inline, run_session

    target, draft = cuda_pair
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)

    def logprobs(drafter):
        lane = InlineLane()
        speculator = LocalSpeculator(drafter, lane, None)
        session = DecodeSession(target, PROMPTS[1], params, (), None, None, speculator.max_nodes)
        run_inline(run_session(session, speculator, lane, lambda tokens, result: None))
        return session.output, session.logprobs

    reference = logprobs(NoDrafter())  # runs ahead: one node a round on graphs
    output, got = logprobs(_drafters(draft)[mode] if mode != "ar" else NoDrafter())
    assert output == reference[0] and len(got) == 24
    for (lp, ids, values, rank), (ref_lp, ref_ids, ref_values, ref_rank) in zip(got, reference[1], strict=True):
        assert (ids, rank) == (ref_ids, ref_rank) and lp == pytest.approx(ref_lp, abs=1e-4)
        assert values == pytest.approx(ref_values, abs=1e-4)


def test_prompt_logprobs_on_cuda_match_a_whole_prompt_forward_and_leave_the_output_alone(cuda_pair):
    """The echoed prompt's log-probabilities: a chunked scoring pass on the device (graphs on)."""
    import specctl.spec.logprobs as logprobs_module

    target, _ = cuda_pair
    prompt = PROMPTS[1] * 8
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    reference, _, _ = generate(target, prompt, params)
    chunk, logprobs_module.PROMPT_CHUNK = logprobs_module.PROMPT_CHUNK, 16
    try:
        session = DecodeSession(target, prompt, SamplingParams(max_tokens=16, ignore_eos=True, prompt_logprobs=1))
    finally:
        logprobs_module.PROMPT_CHUNK = chunk
    scored = session.prompt_logprobs
    session.close()
    assert generate(target, prompt, SamplingParams(max_tokens=16, ignore_eos=True, prompt_logprobs=1))[0] == reference
    whole = target(torch.tensor(prompt), torch.arange(len(prompt)), target.new_cache(len(prompt)))[:-1].log_softmax(-1)
    assert len(scored) == len(prompt) - 1
    for row, token, (lp, ids, _, _) in zip(whole, prompt[1:], scored):
        assert lp == pytest.approx(float(row[token]), abs=1e-3)  # chunked vs one forward: the last bits may differ


@pytest.mark.parametrize("mode, window", [("chain", 0), ("tree", 0), ("chain", 4), ("tree", 4)])
def test_logit_rules_on_cuda_every_mode_equals_ar_and_ar_does_not_run_ahead(cuda_pair, mode, window):
    """The rules' state (counts, bias, stop ids) lives on the device; AR with them reads each step
    (no run-ahead). ``window``: llama.cpp's penalties over the last 4 tokens (their counts built
    on the device, row by row)."""
    target, draft = cuda_pair
    params = SamplingParams(max_tokens=32, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.4,
                            repetition_penalty=1.6, min_tokens=8, stop_token_ids=(11,),
                            logit_bias=((5, -100.0), (7, 2.0)), penalty_last_n=window)
    for prompt in PROMPTS:
        reference, _, _ = generate(target, prompt, params)
        assert generate(target, prompt, params, _drafters(draft)[mode])[0] == reference, f"{mode} diverged on {prompt}"
        assert reference != generate(target, prompt, SamplingParams(max_tokens=32, ignore_eos=True))[0]
    session = DecodeSession(target, PROMPTS[0], params)
    assert not session.run_ahead and session.rules.counts.device.type == "cuda" == session.rules.bias.device.type
    session.close()


@pytest.mark.parametrize("mode", ["chain", "tree", "ngram"])
def test_structured_output_on_cuda_every_mode_equals_ar_and_sampling_keeps_to_the_grammar(cuda_pair, mode):
    """The grammar's masks are computed on the host and applied to device logits (every row)."""
    import json
    import re

    from specctl.engine.tiny import make_byte_tokenizer

    target, draft = cuda_pair
    tokenizer, choices = make_byte_tokenizer(), ["north", "south", "east"]
    regex = SamplingParams(max_tokens=40, structured=("regex", r"[a-c]{2,5}-\d{3}"))
    for prompt in PROMPTS:
        reference, _, reason = generate(target, prompt, regex, eos_token_ids=(256,), tokenizer=tokenizer)
        assert reason == "stop" and re.fullmatch(r"[a-c]{2,5}-\d{3}", tokenizer.decode(reference))
        output, _, _ = generate(target, prompt, regex, _drafters(draft)[mode], eos_token_ids=(256,),
                                tokenizer=tokenizer)
        assert output == reference, f"{mode} diverged on {prompt}"
        sampled = SamplingParams(max_tokens=40, temperature=0.8, seed=4, structured=("choice", json.dumps(choices)))
        output, _, reason = generate(target, prompt, sampled, _drafters(draft)[mode], eos_token_ids=(256,),
                                     tokenizer=tokenizer)
        assert reason == "stop" and tokenizer.decode(output) in choices


@pytest.mark.parametrize("mode", ["chain", "tree", "ngram"])
def test_greedy_every_mode_equals_ar_on_cuda(cuda_pair, mode):
    target, draft = cuda_pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        reference, _, _ = generate(target, prompt, params)
        output, stats, _ = generate(target, prompt, params, _drafters(draft)[mode])
        assert output == reference, f"{mode} diverged on {prompt}"
    assert target.static.replays > 0 and target.static.captures > 0


@pytest.mark.parametrize("mode", ["ar", "chain", "tree"])
def test_a_restored_prefix_on_cuda_graphs_keeps_the_target_alone_output(tiny_dir, mode):
    """The prefix cache on CUDA (engine.prefix_cache): the next turn's prompt restores the last
    text's KV into a cache whose steps are CUDA graphs, and prefills the rest; fp32 output equal
    to the target alone's without a cache."""
    target, draft = _cuda(tiny_dir["qwen2"]).use_prefix_cache(64 << 20), _cuda(tiny_dir["qwen2-draft"])
    drafter = {"ar": None, **_drafters(draft)}[mode]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    first = list(range(30, 70))
    output = generate(target, first, params, drafter)[0]
    second = first + output + [5, 9, 13]
    again, stats, _ = generate(target, second, params, drafter)
    assert stats.cached_prompt_tokens >= len(first) + len(output) - 1
    target.prefix_cache = None
    assert again == generate(target, second, params)[0]


@pytest.mark.parametrize("mode", ["ar", "chain", "tree"])
def test_a_resumed_generation_on_cuda_graphs_goes_on_as_the_uninterrupted_one(cuda_pair, mode):
    """A generation taken over from another instance (DecodeSession's ``resumed``): its output
    so far prefilled after the prompt into a CUDA-graph cache, the rules' device state advanced
    through it; fp32 output equal to the uninterrupted run's."""
    target, draft = cuda_pair
    drafter = {"ar": None, **_drafters(draft)}[mode]
    params = SamplingParams(max_tokens=32, ignore_eos=True, presence_penalty=0.5, repetition_penalty=1.3)
    whole = generate(target, PROMPTS[1], params)[0]
    for cut in (1, 13):
        output, stats, _ = generate(target, PROMPTS[1], params, drafter, resumed=tuple(whole[:cut]))
        assert output == whole and stats.new_tokens == len(whole) - cut


@pytest.mark.parametrize("mode", ["ar", "chain", "tree"])
@pytest.mark.parametrize("chunk, key_cost", [(16, 0.0), (32, 0.05)], ids=["even-jobs", "shrinking-jobs"])
def test_a_chunked_prefill_on_cuda_graphs_keeps_the_whole_prefill_s_output(cuda_pair, mode, chunk, key_cost):
    """Chunked prefill on CUDA (spec.decode.prefill_step): a 70-token prompt prefilled 16 tokens
    a job, or 32 then 16 (engine.prefill_jobs), into a cache whose steps are CUDA graphs; fp32
    output equal to a whole prefill's (AR)."""
    target, draft = cuda_pair
    drafter = {"ar": None, **_drafters(draft)}[mode]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    whole = generate(target, PROMPTS[3], params)[0]
    target.prefill_chunk, target.prefill_key_cost = chunk, key_cost
    try:
        assert generate(target, PROMPTS[3], params, drafter)[0] == whole
    finally:
        target.prefill_chunk, target.prefill_key_cost = 0, 0.0


def test_ar_runs_ahead_on_cuda_graphs_and_equals_reading_each_step(cuda_pair):
    target, _ = cuda_pair
    sampled = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=40, seed=3)
    for params in (SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=40), sampled):
        for prompt in PROMPTS:
            each, _, each_finish = generate(target, prompt, params, run_ahead=False)
            ahead, stats, ahead_finish = generate(target, prompt, params)  # auto: on, AR on graphs
            assert (ahead, ahead_finish) == (each, each_finish), f"running ahead diverged on {prompt}"
            assert stats.rounds == len(each) - 1 if ahead_finish == "length" else stats.rounds == len(each)
    session = DecodeSession(target, PROMPTS[0], SamplingParams(max_tokens=4))
    assert session.run_ahead and session._token_host.is_pinned()
    session.close()


@pytest.mark.parametrize("mode", ["ar", "chain", "tree", "ngram"])
def test_sampled_every_mode_runs_on_cuda_and_is_seeded(cuda_pair, mode):
    target, draft = cuda_pair
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=40, ignore_eos=True, seed=5)
    drafter = None if mode == "ar" else _drafters(draft)[mode]
    first, _, reason = generate(target, PROMPTS[0], params, drafter)
    again, _, _ = generate(target, PROMPTS[0], params, None if mode == "ar" else _drafters(draft)[mode])
    assert len(first) == 40 and reason == "length" and first == again


def test_graphs_on_equal_graphs_off_fp32(tiny_dir):
    on, eager = _cuda(tiny_dir["llama"]), _cuda(tiny_dir["llama"], graphs=False)
    draft_on, draft_off = _cuda(tiny_dir["llama-draft"]), _cuda(tiny_dir["llama-draft"], graphs=False)
    for params in (SamplingParams(max_tokens=32, ignore_eos=True),
                   SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=3)):
        for prompt in PROMPTS:
            assert generate(on, prompt, params)[0] == generate(eager, prompt, params)[0]
            assert (generate(on, prompt, params, ModelChainDrafter(draft_on, 4))[0]
                    == generate(eager, prompt, params, ModelChainDrafter(draft_off, 4))[0])
    assert on.static.captures > 0 and eager.static is None


def test_a_later_session_replays_the_graphs_captured_over_its_reused_buffer(tiny_dir):
    """Sessions of one KV size share their buffers' captured graphs: the second session of a
    size captures nothing, and every output still equals the eager decoder's."""
    on, eager = _cuda(tiny_dir["llama"]), _cuda(tiny_dir["llama"], graphs=False)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    assert generate(on, PROMPTS[3], params)[0] == generate(eager, PROMPTS[3], params)[0]
    captured = on.static.captures
    for prompt in (PROMPTS[3], PROMPTS[1][:14], PROMPTS[0]):  # the first's prefill bucket, then smaller ones
        assert generate(on, prompt, params)[0] == generate(eager, prompt, params)[0]
    assert on.static.reused == 3 and on.static.captures == captured + 2  # the prefills of 14 and 4 tokens only


def test_a_greedy_chain_syncs_the_host_once_a_proposal_on_cuda(cuda_pair):
    """A greedy chain's tokens go from step to step on the device: depth 4 reads back once a
    proposal, where reading each step's token (a stop too small to end the chain) syncs 4
    times. Counted by torch's sync debug mode (a warning per synchronising operation)."""
    _, draft = cuda_pair
    seq = PROMPTS[1]
    syncs, tokens = {}, {}
    for stop in (0.0, 1e-30):
        session = ModelChainDrafter(draft, 4, stop=stop).open(64)
        session.propose(seq, SamplingParams(), None)  # captures the graphs this session's steps use
        session.on_verified([])
        # Switched on outside the count: the switch itself once raised a warning (seen on an H100).
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                proposal = session.propose(seq + [11], SamplingParams(), None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs[stop] = sum("synchronizing" in str(w.message) for w in caught)
        tokens[stop] = proposal.tree.tokens.tolist()
        session.close()
    assert tokens[0.0] == tokens[1e-30]
    assert (syncs[0.0], syncs[1e-30]) == (1, 4), syncs


def test_a_batch_of_sessions_on_cuda_graphs_replays_one_step_each_and_equals_each_alone(tiny_dir):
    """Batched drafting and verification on CUDA graphs: each session's step is a replay, and its
    bf16 logits are exactly its forward alone (an eager batch computed them through other kernels)."""
    decoder = _cuda(tiny_dir["qwen2"], torch.bfloat16)
    assert decoder.static.per_session
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]

    def fresh():
        caches = [decoder.new_cache(128) for _ in prompts]
        for prompt, cache in zip(prompts, caches):
            decoder(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        return caches

    steps = [(torch.tensor([11]), torch.tensor([len(p)])) for p in prompts]
    at = [torch.tensor([0])] * 3
    caches = fresh()
    replays = decoder.static.replays
    together = decoder.forward_many([s[0] for s in steps], [s[1] for s in steps], caches, [None] * 3, at)
    assert decoder.static.replays == replays + 3  # one replay a session
    alone = [decoder(tokens, positions, cache, logits_at=torch.tensor([0]))
             for (tokens, positions), cache in zip(steps, fresh())]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


def test_cuda_fp32_equals_cpu_fp32(tiny_dir, tiny):
    target = _cuda(tiny_dir["llama"])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    same = sum(generate(target, p, params)[0] == generate(tiny["llama"], p, params)[0] for p in PROMPTS)
    assert same == len(PROMPTS)


# bf16 bit-equality with AR is not claimed on CUDA (README): kernels are chosen by shape. The tiny
# families keep it but these, which an H100 found departing; examples/gpu_moe_departure.py looks for why.
BF16_DEPARTS_ON_CUDA = {"gpt_oss": "its bf16 chain left AR at token 8 of [5, 9, 13, 2] on an H100, 2026-12-06, "
                                   "compiled or not (fp32 equal to the CPU's)"}


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe", "mixtral", "olmo3",
                                  "starcoder2", "smollm3", "glm4", "exaone4", "cohere2", "gpt_oss",
                                  "gpt_neox", "glm4_moe", "deepseek_v3", "llama4", "phi"])
def test_families_on_cuda_graphs_equal_cpu_fp32_and_bf16_speculative_equals_bf16_ar(tiny_dir, tiny, arch, compile):
    """Qwen3's per-head q/k norms and Phi-3's partial rotary in the captured (and compiled) step;
    Gemma 2's own layers (its modules, captured) with the static attention's scale and cap; Gemma 3's
    two RoPEs and window masks (its windows are passed by the longer prompts); mixtures of experts
    on padded steps that are not captured."""
    def cuda(name, dtype):
        decoder = fuse_projections(load_decoder(tiny_dir[name], dtype, device="cuda"))
        return decoder.use_static_steps(graphs=True, compile=compile)

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    target = cuda(arch, torch.float32)
    assert all(generate(target, p, params)[0] == generate(tiny[arch], p, params)[0] for p in PROMPTS)
    target, draft = cuda(arch, torch.bfloat16), cuda(f"{arch}-draft", torch.bfloat16)
    for prompt in PROMPTS:
        reference, _, _ = generate(target, prompt, params)
        for mode, drafter in _drafters(draft).items():
            output = generate(target, prompt, params, drafter)[0]
            if output != reference and arch in BF16_DEPARTS_ON_CUDA:
                pytest.xfail(f"{arch} bf16 {mode} diverged on {prompt}: {BF16_DEPARTS_ON_CUDA[arch]}")
            assert output == reference, f"{arch} bf16 {mode} diverged on {prompt}"


def test_bf16_speculative_equals_bf16_ar(tiny_dir):
    target, draft = _cuda(tiny_dir["qwen2"], torch.bfloat16), _cuda(tiny_dir["qwen2-draft"], torch.bfloat16)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        reference, _, _ = generate(target, prompt, params)
        for mode, drafter in _drafters(draft).items():
            assert generate(target, prompt, params, drafter)[0] == reference, f"bf16 {mode} diverged on {prompt}"


@pytest.mark.skipif(not flashinfer_available(), reason="flashinfer not installed")
def test_bf16_speculative_equals_bf16_ar_with_flashinfer_attention(tmp_path):
    """Issue 11: with flashinfer, decode and verification must go through the same kernel, or
    bf16 speculative output drifts from bf16 AR. Eager forwards (no static steps), so every
    attention is flashinfer's; head dim 64, which it has kernels for."""
    target = _cuda(make_tiny_model(tmp_path / "t", "qwen2", seed=1, hidden=256), torch.bfloat16, graphs=False,
                   backend="flashinfer")
    draft = _cuda(make_tiny_model(tmp_path / "d", "qwen2", seed=8, layers=2, hidden=256), torch.bfloat16,
                  graphs=False, backend="flashinfer")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        reference, _, _ = generate(target, prompt, params)
        for mode, drafter in _drafters(draft).items():
            assert generate(target, prompt, params, drafter)[0] == reference, f"flashinfer {mode} diverged on {prompt}"


@pytest.mark.skipif(not flashinfer_available(), reason="flashinfer not installed")
def test_flashinfer_paged_attention_equals_the_torch_page_table():
    """Issue 11 must-do 3: sessions at scattered ranges of one arena, causal and tree masks, in one
    BatchPrefillWithPagedKVCacheWrapper call reading the arena's pages in place."""
    from specctl.engine.kv_arena import KVArena
    from specctl_kernels.paged import PagedAttention, paged_reference

    torch.manual_seed(0)
    arena = KVArena(2, 2, 64, 1024, torch.bfloat16, "cuda")
    arena.buffer.normal_()
    tree = torch.ones(3, 43, dtype=torch.bool, device="cuda")
    tree[1, 41] = tree[2, 40] = False
    sessions = [(0, 17, 1, None), (160, 43, 3, tree), (320, 300, 5, None), (48, 2, 2, None)]
    paged = PagedAttention("flashinfer", arena)
    planned = paged.plan([s[0] for s in sessions], [s[1] for s in sessions], [s[2] for s in sessions],
                         [s[3] for s in sessions], 8)
    q = torch.randn(1, 8, sum(s[2] for s in sessions), 64, dtype=torch.bfloat16, device="cuda")
    for layer in (0, 1):
        expected = paged_reference(q[0].transpose(0, 1), *arena.pages(layer), planned.plan)
        torch.testing.assert_close(planned.attend(layer, q)[0].transpose(0, 1), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not flashinfer_available(), reason="flashinfer not installed")
def test_bf16_over_a_flashinfer_paged_arena_speculative_equals_ar_and_a_batch_each_alone(tmp_path):
    """Every eager forward of caches on the arena is one paged flashinfer call a layer: bf16
    speculative == bf16 AR, and a batch of sessions' logits == each session's alone (split-KV
    off: a session's result must not depend on its batch)."""
    target = _cuda(make_tiny_model(tmp_path / "t", "qwen2", seed=1, hidden=256), torch.bfloat16, graphs=False,
                   backend="flashinfer").use_kv_arena(64 << 20, attention="flashinfer")
    draft = _cuda(make_tiny_model(tmp_path / "d", "qwen2", seed=8, layers=2, hidden=256), torch.bfloat16,
                  graphs=False, backend="flashinfer").use_kv_arena(64 << 20, attention="flashinfer")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        reference, _, _ = generate(target, prompt, params)
        for mode, drafter in _drafters(draft).items():
            assert generate(target, prompt, params, drafter)[0] == reference, f"paged {mode} diverged on {prompt}"
    assert target.paged.plans > 0 and target.kv_arena.free_slots == target.kv_arena.slots

    def fresh():
        caches = [target.new_cache(128) for _ in PROMPTS]
        for prompt, cache in zip(PROMPTS, caches):
            target(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        return caches

    steps = [(torch.tensor([11, 12]), torch.tensor([len(p), len(p) + 1])) for p in PROMPTS]
    at = [torch.tensor([0, 1])] * len(PROMPTS)
    together = target.forward_many([s[0] for s in steps], [s[1] for s in steps], fresh(), [None] * len(PROMPTS), at)
    alone = [target(tokens, positions, cache) for (tokens, positions), cache in zip(steps, fresh())]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


def test_tree_growth_and_sampling_take_cuda_probabilities():
    probs = torch.tensor([[0.1, 0.6, 0.3, 0.0]], device="cuda")
    tree = TokenTree.root(3).grow(torch.tensor([0]), probs, topk=2, width=2)
    assert tree.tokens.tolist() == [3, 1, 2] and tree.tokens.device.type == "cpu"
    generator = torch.Generator().manual_seed(0)
    draws = [sample(probs[0], generator) for _ in range(200)]
    assert 3 not in draws and set(draws) <= {0, 1, 2}


async def star_run(tiny_dir, device: str, tree: bool, prespec=None, rules: dict | None = None,
                   **target_options) -> None:
    """A draft server and a target instance over TCP on the device (static steps on CUDA),
    pre-speculating with ``prespec``, the target configured with ``target_options`` too, every
    request with the sampling ``rules`` (penalties, a bias ...) too: greedy equal to the target
    alone, a sampled session completes."""
    target = load_model("tiny-llama", tiny_dir["llama"], "fp32", device=device)
    draft = load_model("tiny-llama@2", tiny_dir["llama"], "fp32", num_layers=2, device=device)
    if device == "cuda":
        target.decoder.use_static_steps()
        draft.decoder.use_static_steps()
    drafter = ModelTreeDrafter(draft.decoder, 3, 2, 3) if tree else ModelChainDrafter(draft.decoder, 3)
    draft_server = DraftServer(draft, drafter, DraftServerConfig(port=0, prespec=prespec))
    draft_port = await draft_server.start()
    client = DraftClient("127.0.0.1", draft_port, model=target.name, fingerprint=target.vocab_fingerprint)
    first = asyncio.get_running_loop().create_future()
    link = asyncio.create_task(client.run(first))
    assert await first
    # A verification a little slower than drafting leaves the draft time to pre-speculate.
    target_server = TargetServer(target, TargetServerConfig(port=0, verify_delay_s=0.02 if prespec else 0.0,
                                                            **target_options), client)
    port = await target_server.start()
    try:
        greedy = SamplingParams(max_tokens=24, ignore_eos=True, **(rules or {}))
        sampled = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=3, **(rules or {}))
        results = await asyncio.gather(*(remote_generate("127.0.0.1", port, p, greedy) for p in PROMPTS),
                                       remote_generate("127.0.0.1", port, PROMPTS[0], sampled))
        for prompt, (tokens, _, _) in zip(PROMPTS, results):
            assert tokens == generate(target.decoder, prompt, greedy)[0], prompt
        assert len(results[-1][0]) == 24
        if prespec:
            assert draft_server.snapshot()["prespec"]["steps"] > 0
    finally:
        link.cancel()
        await target_server.close()
        await draft_server.close()


@pytest.mark.parametrize("kind", ["chain", "tree"])
async def test_star_on_cuda_equals_target_greedy(tiny_dir, kind):
    await star_run(tiny_dir, "cuda", kind == "tree")


async def test_specpipe_through_stages_on_cuda_equals_the_target_with_dead_rows_skipped(tiny_dir):
    """SpecPipe over 3 CUDA stages (threads of this process, TCP between them), levels of width
    3 so verifications leave levels in flight partly dead: the stages skip those rows on the
    device (KV placed, zeros sent) and the tokens equal the whole target's, greedy."""
    from specctl.pipeline.local import LocalPipeline
    from specctl.pipeline.specpipe import specpipe_generate
    from specctl.pipeline.token_source import TreeShape

    target = load_model("t", tiny_dir["llama"], "fp32", device="cuda")
    draft = load_model("d", tiny_dir["llama"], "fp32", num_layers=2, device="cuda")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    async with LocalPipeline(target, 3, delay_s=0.03) as pipeline:
        for prompt in PROMPTS:
            tokens, _, _, pipe = await asyncio.to_thread(specpipe_generate, pipeline.staged.decoder, draft.decoder,
                                                         prompt, params, TreeShape(3, 2))
            assert tokens == generate(target.decoder, prompt, params)[0], prompt
        assert all(server.stats.forwards > 0 for server in pipeline.servers)


# --- the features that came after the last GPU run: each helper takes the device, so the same
# code can be tried on the CPU (python -c "...helper(..., 'cpu')") when no GPU is lent ---------

def several_drafters_run(tiny_dir, device: str) -> None:
    """CoSine routing + fusion of a chain, a tree and the n-gram lookup: greedy equal to the
    target alone, a sampled run completes (routing follows measured times, so a seed fixes
    the distribution there, not the text)."""
    from specctl.spec.multi import MultiDrafter

    load = _loader(device)
    target, draft = load(tiny_dir["qwen2"]), load(tiny_dir["qwen2-draft"])

    def multi() -> MultiDrafter:
        return MultiDrafter({"chain": ModelChainDrafter(draft, 4), "tree": ModelTreeDrafter(draft, 3, 2, 3),
                             "ngram": NgramDrafter(4)})

    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    drafter = multi()
    for prompt in PROMPTS:
        assert generate(target, prompt, greedy, drafter)[0] == generate(target, prompt, greedy)[0], prompt
    assert sum(s["chosen_rounds"] for s in drafter.snapshot().values()) > 0
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, ignore_eos=True, seed=4)
    tokens, _, reason = generate(target, PROMPTS[1], sampled, multi())
    assert len(tokens) == 40 and reason == "length"


async def pipeline_chain_run(tiny_dir, device: str, params: SamplingParams | None = None) -> None:
    """Plain PP and PP + chain speculation through 3 stages on the device: the target's tokens."""
    from specctl.pipeline.local import LocalPipeline

    target = load_model("t", tiny_dir["llama"], "fp32", device=device)
    draft = load_model("d", tiny_dir["llama-draft"], "fp32", device=device)
    params = params or SamplingParams(max_tokens=24, ignore_eos=True)
    async with LocalPipeline(target, 3, delay_s=0.0) as pipeline:
        for prompt in PROMPTS:
            reference = generate(target.decoder, prompt, params)[0]
            for drafter in (None, ModelChainDrafter(draft.decoder, 4)):
                tokens = (await asyncio.to_thread(generate, pipeline.staged.decoder, prompt, params, drafter))[0]
                assert tokens == reference, (prompt, drafter)


def test_several_drafters_fused_on_cuda_equal_the_target(tiny_dir):
    several_drafters_run(tiny_dir, "cuda")


@pytest.mark.parametrize("tree", [False, True])
async def test_prespec_draft_server_on_cuda_equals_the_target(tiny_dir, tree):
    """Branches batched with the tree mask, cache hits' KV made the session's, Saguaro C < 1."""
    from specctl.draft.prespec_config import PrespecConfig

    await star_run(tiny_dir, "cuda", tree, PrespecConfig(budget=6, saguaro_c=0.5, fallback="jit", adaptive=False))


async def test_pp_and_pp_chain_through_cuda_stages_equal_the_target(tiny_dir):
    await pipeline_chain_run(tiny_dir, "cuda")


@pytest.mark.parametrize("compile", [False, True])
def test_sliding_windows_on_cuda_graphs_equal_cpu_fp32_and_bf16_speculative_equals_bf16_ar(tmp_path, compile):
    """The window's second mask (engine.window) in captured steps past a 24-token window: a
    Mistral through the fused (compiled) pieces, a Gemma 2 through its modules."""
    from tests.test_window import _sliding

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for arch in ("mistral", "gemma2"):
        path = _sliding(tmp_path / arch, arch, seed=3)
        draft_path = _sliding(tmp_path / f"{arch}-d", arch, seed=4, layers=2)

        def cuda(where, dtype):
            return fuse_projections(load_decoder(where, dtype, device="cuda")).use_static_steps(graphs=True,
                                                                                               compile=compile)

        cpu, target = load_decoder(path), cuda(path, torch.float32)
        assert all(generate(target, p, params)[0] == generate(cpu, p, params)[0] for p in PROMPTS)
        target, draft = cuda(path, torch.bfloat16), cuda(draft_path, torch.bfloat16)
        for prompt in PROMPTS:
            reference, _, _ = generate(target, prompt, params)
            for mode, drafter in _drafters(draft).items():
                assert generate(target, prompt, params, drafter)[0] == reference, f"{arch} {mode} diverged on {prompt}"


# --- sessions 58-61, untried on a GPU so far: each helper takes the device (tried on "cpu" here) ---

def predicted_outputs_run(tiny_dir, device: str) -> None:
    """Predicted Outputs: chains of 15, 31 and 63 predicted tokens (with the root each a static
    step's size bucket on CUDA graphs) from the prediction's n-gram index, with the target alone
    and beside a draft chain; an edit in the prediction rejects part of a chain. Greedy: the
    target alone's tokens."""
    load = _loader(device)
    target, draft = load(tiny_dir["qwen2"]), load(tiny_dir["qwen2-draft"])
    plain = SamplingParams(max_tokens=120, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        alone = generate(target, prompt, plain)[0]
        for prediction in (alone, alone[:30] + [3, 3, 3] + alone[33:]):
            params = SamplingParams(max_tokens=120, ignore_eos=True, prediction=tuple(prediction))
            for drafter in (None, ModelChainDrafter(draft, 4)):
                sizes: list[int] = []
                output = generate(target, prompt, params, drafter, on_tokens=lambda tokens, result: sizes.append(
                    result.nodes) if result is not None and result.predicted else None)[0]
                assert output == alone, (prompt, drafter)
                assert 63 in sizes or prediction != alone, sizes  # the longest chain was verified
    if device == "cuda":
        assert target.static.replays > 0


def thinking_budget_run(tiny_dir, device: str) -> None:
    """A thought cut at its budget (the forced row built on the logits' device): every mode
    gives the target alone's tokens, the end marker right after the budget; sampled too."""
    load = _loader(device)
    target, draft = load(tiny_dir["qwen2"]), load(tiny_dir["qwen2-draft"])
    start, end = 20, 21
    prompt = [1, 5, 9, 2, 7, start]
    free = generate(target, prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    params = SamplingParams(max_tokens=24, ignore_eos=True, thinking_budget=3, thinking_markers=((start,), (end,)))
    alone = generate(target, prompt, params)[0]
    assert end in alone[:4] and (alone != free or end in free[:4])
    for mode, drafter in _drafters(draft).items():
        assert generate(target, prompt, params, drafter)[0] == alone, mode
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=5, thinking_budget=2,
                             thinking_markers=((start,), (end,)))
    for drafter in (None, ModelChainDrafter(draft, 4)):
        output = generate(target, [1, 5, start], sampled, drafter)[0]
        assert end in output[:3]


async def specpipe_rules_run(tiny_dir, device: str) -> None:
    """SpecPipe deciding from the root's logits row (not the last stage's argmax): penalties,
    a logit bias and logprobs through 2 stages equal the whole target's."""
    from specctl.pipeline.local import LocalPipeline
    from specctl.pipeline.specpipe import SpecPipeRun
    from specctl.pipeline.token_source import DraftLevels, TreeShape, max_tree_nodes
    from specctl.spec.rounds import run_to_end

    target = load_model("t", tiny_dir["llama"], "fp32", device=device)
    draft = load_model("d", tiny_dir["llama"], "fp32", num_layers=2, device=device)
    params = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.6, logit_bias=((7, 4.0),), logprobs=2)
    shape = TreeShape(3, 2)
    async with LocalPipeline(target, 2, delay_s=0.0) as pipeline:
        for prompt in PROMPTS:
            reference = run_to_end(target.decoder, prompt, params)
            session = DecodeSession(pipeline.staged.decoder, prompt, params, (), None, None, max_tree_nodes(2, shape))
            levels = DraftLevels.for_session(draft.decoder, shape, session)
            try:
                await asyncio.to_thread(SpecPipeRun(pipeline.staged.decoder, session, levels).run)
                assert session.output == reference.output, prompt
                assert [e[0] for e in session.logprobs] == pytest.approx([e[0] for e in reference.logprobs], abs=1e-4)
            finally:
                session.close()
                levels.close()


def test_predicted_outputs_on_cuda_graphs_equal_the_target(tiny_dir):
    predicted_outputs_run(tiny_dir, "cuda")


def test_thinking_budgets_on_cuda_every_mode_equal_the_target(tiny_dir):
    thinking_budget_run(tiny_dir, "cuda")


async def test_specpipe_with_logit_rules_through_cuda_stages_equals_the_target(tiny_dir):
    await specpipe_rules_run(tiny_dir, "cuda")


# --- session 64, untried on a GPU so far (tried on "cpu" here) ---

async def specpipe_target_prediction_run(tiny_dir, device: str) -> None:
    """A SpecPipe target (stage 1 of 2, its draft in this process) given a request with a
    Predicted Output: its chains grafted onto the tree (session 65; the round loop in session
    64) equal the whole target's tokens; so does the next request without one."""
    from dataclasses import replace

    from specctl.pipeline.local import LocalPipeline
    from specctl.pipeline.serve import SpecPipeDraft
    from specctl.pipeline.token_source import TreeShape
    from specctl.verify.client import remote_stats

    target = load_model("t", tiny_dir["llama"], "fp32", device=device)
    draft = load_model("d", tiny_dir["llama"], "fp32", num_layers=2, device=device)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = generate(target.decoder, PROMPTS[1], params)[0]
    async with LocalPipeline(target, 2, delay_s=0.0) as pipeline:
        server = TargetServer(pipeline.staged, TargetServerConfig(port=0), None, pipeline=pipeline.client,
                              specpipe=SpecPipeDraft.local(draft.decoder, TreeShape(3, 2), "d"))
        port = await server.start()
        try:
            tokens, _, stats = await remote_generate("127.0.0.1", port, PROMPTS[1],
                                                     replace(params, prediction=tuple(alone[:16]) + (3, 3)))
            assert tokens == alone and stats["prediction_accepted"] >= 12
            tokens, _, _ = await remote_generate("127.0.0.1", port, PROMPTS[1], params)
            assert tokens == alone and (await remote_stats("127.0.0.1", port))["specpipe_steps"] == 80
        finally:
            await server.close()


async def test_a_specpipe_target_on_cuda_serves_a_predicted_output_exactly(tiny_dir):
    await specpipe_target_prediction_run(tiny_dir, "cuda")
