"""Automatic prefix caching (engine.prefix_cache): a new session whose prompt starts as a
finished one's text restores that text's KV and prefills only the rest — with the same
output as a prefill of the whole prompt, in every mode, and a store that keeps to its budget."""

import dataclasses

import numpy as np
import pytest
import torch

from specctl.engine.parts import decoder_part
from specctl.engine.prefix_cache import MIN_REUSE, PrefixCache, common_prefix
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.batch_drafting import prefill_step
from specctl.spec.decode import DecodeSession
from specctl.spec.draft_state import DraftState
from tests.conftest import mode_drafter
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture
def cached(tiny):
    """The tiny llama target and draft, each with a prefix cache for this test only (the
    decoders are the session's: the caches go when the test ends)."""
    target, draft = tiny["llama"], tiny["llama-draft"]
    target.use_prefix_cache(64 << 20)
    draft.use_prefix_cache(64 << 20)
    yield target, draft
    target.prefix_cache = draft.prefix_cache = None


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(target, prompt, params=GREEDY):
    """The target alone with no prefix cache: the reference."""
    prefixes, target.prefix_cache = target.prefix_cache, None
    try:
        return generate(target, prompt, params)[0]
    finally:
        target.prefix_cache = prefixes


def test_common_prefix():
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, np.array([1, 2])) == 2
    assert common_prefix(a, np.array([5])) == 0
    assert common_prefix(a, np.array([], dtype=np.int64)) == 0


@pytest.mark.parametrize("mode", ["ar", "chain", "tree", "ngram"])
def test_next_turn_restores_the_last_text_and_keeps_the_target_alone_output(cached, mode):
    target, draft = cached
    drafter = mode_drafter(mode, draft)
    first = _prompt(1, 40)
    output, stats, _ = generate(target, first, GREEDY, drafter)
    assert output == _alone(target, first) and stats.cached_prompt_tokens == 0
    # the next turn: the whole last text, then more
    second = first + output + _prompt(2, 9)
    output2, stats2, _ = generate(target, second, GREEDY, drafter)
    assert output2 == _alone(target, second)
    # the last text's KV: prompt + output, less the last token unless a verified path fed it
    assert stats2.cached_prompt_tokens in (len(first) + len(output) - 1, len(first) + len(output))
    assert target.prefix_cache.stats.hits == 1
    if mode in ("chain", "tree"):  # the draft's own cache was used for its prefill too
        assert draft.prefix_cache.stats.hits == 1


def test_a_shared_start_is_reused_and_the_rest_computed(cached):
    target, _ = cached
    system = _prompt(3, 30)
    generate(target, system + _prompt(4, 5), GREEDY)
    other = system + _prompt(5, 7)
    output, stats, _ = generate(target, other, GREEDY)
    assert stats.cached_prompt_tokens == 30
    assert output == _alone(target, other)


def test_a_session_that_starts_while_another_decodes_reuses_its_prompt(cached):
    """The prompt's KV is stored when its prefill runs: a session with the same system prompt
    that starts while the first is still decoding computes only its own part."""
    target, _ = cached
    system = _prompt(20, 30)
    first = DecodeSession(target, system + _prompt(21, 5), GREEDY)
    first_token = first.prefill()
    other = system + _prompt(22, 7)
    output, stats, _ = generate(target, other, GREEDY)
    assert stats.cached_prompt_tokens == len(system) and output == _alone(target, other)
    assert first_token == _alone(target, system + _prompt(21, 5))[:1]  # its own cache untouched
    first.close()


def test_a_draft_session_that_starts_while_another_drafts_reuses_its_prompt(cached):
    _, draft = cached
    system = _prompt(23, 30)
    drafter = ModelChainDrafter(draft, 4)
    first = drafter.open(128)
    first.propose(system + _prompt(24, 5), GREEDY, None)
    assert draft.prefix_cache.stats.stored == 1
    other = system + _prompt(25, 7)
    second = drafter.open(128)
    proposal = second.propose(other, GREEDY, None)
    assert draft.prefix_cache.stats.hit_tokens == len(system)
    prefixes, draft.prefix_cache = draft.prefix_cache, None
    try:  # the same proposal as a draft that prefills the whole prompt
        fresh = drafter.open(128)
        assert proposal.tree.tokens.tolist() == fresh.propose(other, GREEDY, None).tree.tokens.tolist()
        fresh.close()
    finally:
        draft.prefix_cache = prefixes
    first.close()
    second.close()


def test_sampled_output_with_a_restored_prefix_is_the_seeded_target_alone(cached):
    target, draft = cached
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    first = _prompt(6, 36)
    generate(target, first, params, ModelChainDrafter(draft, 3))
    again, stats, _ = generate(target, first, params, ModelChainDrafter(draft, 3))
    assert stats.cached_prompt_tokens == len(first) - 1  # the last prompt token is computed: its logits
    assert again == generate(target, first, params, ModelChainDrafter(draft, 3))[0]
    prefixes, target.prefix_cache = target.prefix_cache, None
    try:
        assert again == generate(target, first, params, ModelChainDrafter(draft, 3))[0]
    finally:
        target.prefix_cache = prefixes


def test_a_salted_session_reuses_only_its_own_salts_prefixes_target_and_draft(cached):
    """vLLM's cache_salt: a prompt stored under one salt is restored by sessions of that salt
    only (target and draft); an unsalted one shares the unsalted entries alone; the text is the
    target's own either way."""
    target, draft = cached
    prompt = _prompt(30, 40)

    def run(salt: str):
        params = dataclasses.replace(GREEDY, cache_salt=salt)
        hits = draft.prefix_cache.stats.hits
        output, stats, _ = generate(target, prompt, params, ModelChainDrafter(draft, 3))
        return output, stats.cached_prompt_tokens, draft.prefix_cache.stats.hits - hits

    first = run("tenant-a")
    assert first[1:] == (0, 0) and first[0] == _alone(target, prompt)
    assert run("tenant-b") == (first[0], 0, 0)  # another salt: nothing restored, target or draft
    assert run("") == (first[0], 0, 0)  # unsalted: nor here
    again = run("tenant-a")
    assert again[0] == first[0] and again[1] >= len(prompt) - 1 and again[2] == 1
    assert target.prefix_cache.held(prompt, "tenant-a") >= len(prompt) - 1
    assert target.prefix_cache.held(prompt, "tenant-c") == 0
    with pytest.raises(Exception, match="cache_salt must be a string of at most 1024 characters"):
        SamplingParams(cache_salt="x" * 1025)


def test_short_prefixes_and_other_texts_are_not_reused(cached):
    target, _ = cached
    generate(target, _prompt(7, 40), GREEDY)
    short = _prompt(7, 40)[: MIN_REUSE - 1] + _prompt(8, 20)
    assert generate(target, short, GREEDY)[1].cached_prompt_tokens == 0
    assert generate(target, _prompt(9, 40), GREEDY)[1].cached_prompt_tokens == 0
    assert target.prefix_cache.stats.queries == 3 and target.prefix_cache.stats.hits == 0


def test_a_failed_session_keeps_its_prompt_and_nothing_after_it(cached):
    target, _ = cached
    prompt = _prompt(10, 40)
    with pytest.raises(ValueError):
        generate(target, prompt, SamplingParams(max_tokens=8, ignore_eos=True),
                 drafter=_FailingDrafter())
    # the prompt's KV was stored when its prefill ran; what a failed session's cache holds after it is not
    assert len(target.prefix_cache) == 1
    longer = prompt + _prompt(11, 6)
    output, stats, _ = generate(target, longer, GREEDY)
    assert stats.cached_prompt_tokens == len(prompt) and output == _alone(target, longer)


def test_a_session_given_up_mid_prefill_keeps_its_chunks_for_its_retry(cached):
    """A client that gives up on a long prompt (and retries it) finds the chunks computed so
    far, target and draft: the retry prefills only the rest, with the same output."""
    target, draft = cached
    prompt = _prompt(12, 70)
    target.prefill_chunk = draft.prefill_chunk = 16
    try:
        given_up = DecodeSession(target, prompt, GREEDY)
        assert given_up.prefill_step() is None and given_up.prefill_step() is None  # 32 of 70 positions
        given_up.close()
        drafting = DraftState(ModelChainDrafter(draft, 4).open(128), GREEDY, torch.Generator(), list(prompt), 128, 5,
                              256)
        assert not prefill_step(drafting.session, drafting.seq)  # 16 of them, more than a chunk left
        drafting.close()
        assert [len(entry.tokens) for entry in target.prefix_cache._entries.values()] == [32]
        assert [len(entry.tokens) for entry in draft.prefix_cache._entries.values()] == [16]
        output, stats, _ = generate(target, prompt, GREEDY, ModelChainDrafter(draft, 4))
        assert stats.cached_prompt_tokens == 32 and output == _alone(target, prompt)
        assert draft.prefix_cache.stats.hit_tokens == 16
    finally:
        target.prefill_chunk = draft.prefill_chunk = 0


class _FailingDrafter(NgramDrafter):
    def __init__(self) -> None:
        super().__init__(3)

    def open(self, capacity, pool=None):
        raise ValueError("the draft could not open")


def _cache_of(decoder, tokens):
    cache = decoder.new_cache(len(tokens) + 8)
    decoder(torch.tensor(tokens), torch.arange(len(tokens)), cache)
    return cache


def test_store_keeps_to_the_budget_least_recently_used_first(tiny):
    target = tiny["llama"]
    one = target.kv_slot_bytes * 20 + 20 * 8  # an entry of 20 positions: keys and values, token ids
    store = PrefixCache(budget_bytes=2 * one + 1)
    texts = [_prompt(20 + i, 20) for i in range(3)]
    for text in texts[:2]:
        store.store(text, _cache_of(target, text))
    assert len(store) == 2 and store.used_bytes == 2 * one
    probe = target.new_cache(40)
    assert store.restore(texts[0] + [1], probe) == 20  # texts[0] is now the most recently used
    store.store(texts[2], _cache_of(target, texts[2]))
    assert len(store) == 2 and store.stats.evicted == 1
    assert store.restore(texts[1] + [1], target.new_cache(40)) == 0  # the one evicted
    assert store.restore(texts[0] + [1], target.new_cache(40)) == 20
    assert store.restore(texts[2] + [1], target.new_cache(40)) == 20
    assert store.snapshot() == {"queries": 4, "hits": 3, "query_tokens": 84, "hit_tokens": 60, "stored": 3,
                                "evicted": 1, "entries": 2, "bytes": 2 * one, "budget_bytes": 2 * one + 1}


def test_a_longer_text_replaces_its_prefix_and_a_held_text_is_not_kept_twice(tiny):
    target = tiny["llama"]
    store = PrefixCache(budget_bytes=64 << 20)
    turn = _prompt(30, 20)
    longer = turn + _prompt(31, 10)
    store.store(turn, _cache_of(target, turn))
    store.store(longer, _cache_of(target, longer))
    assert len(store) == 1 and store.used_bytes == target.kv_slot_bytes * 30 + 30 * 8
    store.store(turn, _cache_of(target, turn))  # held already, inside the longer one
    assert len(store) == 1 and store.stats.stored == 2


def test_restored_keys_and_values_are_the_ones_stored(tiny):
    target = tiny["llama"]
    store = PrefixCache(budget_bytes=64 << 20)
    text = _prompt(40, 24)
    source = _cache_of(target, text)
    store.store(text, source)
    probe = target.new_cache(40)
    assert store.restore(text + [5, 6], probe) == 24 and probe.length == 24
    assert torch.equal(probe.k[:, :, :, :24], source.k[:, :, :, :24])
    assert torch.equal(probe.v[:, :, :, :24], source.v[:, :, :, :24])
    # the whole prompt cached: all but its last token restored (its logits are the first token's)
    assert store.restore(text, target.new_cache(40)) == 23


def test_restore_needs_an_empty_cache_and_a_positive_budget(tiny):
    store = PrefixCache(budget_bytes=1 << 20)
    cache = _cache_of(tiny["llama"], _prompt(50, 4))
    with pytest.raises(ValueError, match="a prefix is restored into an empty cache, not one of length 4"):
        store.restore(_prompt(50, 30), cache)
    with pytest.raises(ValueError, match="a prefix cache needs a positive budget, not 0 bytes"):
        PrefixCache(0)


def test_a_pipeline_stage_has_no_prefix_cache(tiny):
    part = decoder_part(tiny["llama"], (0, 1), embed=True, head=False)
    with pytest.raises(ValueError, match="a prefix cache needs a full model"):
        part.use_prefix_cache(1 << 20)


@pytest.mark.parametrize("mode", ["ar", "chain", "tree"])
def test_logits_after_a_restored_prefix_are_a_whole_prefill_s(cached, mode):
    """Closer than the output: the next token's logits, with the prefix's KV as a finished session
    of each mode computed it (prefill, decode steps, verified trees), against one prefill."""
    target, draft = cached
    drafter = {"ar": None, "chain": ModelChainDrafter(draft, 4), "tree": ModelTreeDrafter(draft, 3, 2, 3)}[mode]
    first = _prompt(60, 30)
    output = generate(target, first, GREEDY, drafter)[0]
    prompt = first + output + _prompt(61, 6)
    restored = target.new_cache(len(prompt) + 1)
    start = target.prefix_cache.restore(prompt, restored)
    assert start >= len(first) + len(output) - 1
    after = target(torch.tensor(prompt[start:]), torch.arange(start, len(prompt)), restored,
                   logits_at=torch.tensor([len(prompt) - start - 1]))
    whole = target(torch.tensor(prompt), torch.arange(len(prompt)), target.new_cache(len(prompt) + 1),
                   logits_at=torch.tensor([len(prompt) - 1]))
    torch.testing.assert_close(after, whole, rtol=1e-5, atol=1e-5)


def test_a_prefix_restores_into_an_arena_range_and_the_output_stays_the_plain_caches(tiny, tiny_dir):
    """The arena's caches are views of one buffer (engine.kv_arena): the copy lands in the
    session's range, and the sessions give their ranges back."""
    from specctl.engine.loader import load_decoder

    target = load_decoder(tiny_dir["qwen2"]).use_kv_arena(1 << 20, attention="torch").use_prefix_cache(8 << 20)
    first = _prompt(70, 30)
    output = generate(target, first, GREEDY)[0]
    second = first + output + _prompt(71, 5)
    again, stats, _ = generate(target, second, GREEDY, ModelChainDrafter(tiny["qwen2-draft"], 4))
    assert stats.cached_prompt_tokens >= len(first) + len(output) - 1
    assert again == generate(tiny["qwen2"], second, GREEDY)[0]
    assert target.kv_arena.free_slots == target.kv_arena.slots


def test_auto_keeps_a_cache_for_drafts_and_fp32_targets_only():
    from specctl.config import build_config
    from specctl.errors import ConfigError
    from specctl.spec.factory import prefix_cache_mb

    assert [prefix_cache_mb(-1, dtype, True) for dtype in ("fp32", "bf16", "fp16")] == [1024, 0, 0]
    assert [prefix_cache_mb(-1, dtype, False) for dtype in ("fp32", "bf16", "fp16")] == [1024, 1024, 1024]
    assert prefix_cache_mb(64, "bf16", True) == 64 and prefix_cache_mb(0, "fp32", False) == 0  # as configured
    assert build_config(None).prefix_cache_mb == -1
    with pytest.raises(ConfigError, match=r"prefix_cache_mb must be an integer in \[-1, 16777216\], got -2"):
        build_config(None, prefix_cache_mb=-2)


def test_a_latent_cache_s_one_plane_is_stored_restored_and_held_in_an_arena(tiny, tiny_dir):
    """DeepSeek-V3's latent cache (engine.latent: keys and values one plane): a stored prefix
    keeps that plane once (half an expanded entry's bytes a slot), a restore into an arena range
    (static steps over it, a tree verified and pruned in place) gives the target alone's output,
    and the ranges and budget come back."""
    from specctl.engine.loader import load_decoder

    target = load_decoder(tiny_dir["deepseek_v3"]).use_kv_arena(1 << 20).use_static_steps(graphs=False)
    target.use_prefix_cache(8 << 20)
    assert target.kv_arena.buffer.shape[1] == 1 and target.kv_arena.slot_bytes == target.kv_slot_bytes
    first = _prompt(80, 30)
    output = generate(target, first, GREEDY)[0]
    assert output == generate(tiny["deepseek_v3"], first, GREEDY)[0]
    (entry,) = target.prefix_cache._entries.values()
    length = len(entry.tokens)
    assert entry.v is None and entry.nbytes == length * target.kv_slot_bytes + 8 * length
    second = first + output + _prompt(81, 5)
    again, stats, _ = generate(target, second, GREEDY, ModelTreeDrafter(tiny["deepseek_v3-draft"], 3, 2, 3))
    assert stats.cached_prompt_tokens >= len(first) + len(output) - 1
    assert again == generate(tiny["deepseek_v3"], second, GREEDY)[0]
    target.static.spares.drop_all()
    assert target.kv_arena.free_slots == target.kv_arena.slots
