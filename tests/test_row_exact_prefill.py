"""Row-exact prefills (specctl_kernels.row_exact with ``prefill``): a row-exact target with a
prefix cache prefills row by row, so every position's keys and values are the bits AR decoding
computes however they were computed, and a restored prefix (a chat's next turn, a shared system
prompt) gives exactly the output a cold start of the same target gives — in bf16 too."""

import pytest
import torch

from specctl.spec.factory import prefix_cache_mb
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate
from specctl_kernels import row_exact, tree_attention
from tests.conftest import mode_drafter
from tests.test_row_exact import _qkv, _row_exact_target

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kv_after(target, tokens: list[int], plan: list[int]):
    """The cache and last logits after feeding ``tokens`` in forwards of ``plan``'s sizes."""
    cache, at = target.new_cache(128), 0
    for size in plan:
        logits = target(torch.tensor(tokens[at : at + size]), torch.arange(at, at + size), cache,
                        logits_at=torch.tensor([size - 1]))
        at += size
    return cache, logits


def _same_bits(target, tokens: list[int]) -> bool:
    """Whether one prefill of ``tokens``, chunks of 16, and a prefill of half then decode
    steps leave the same keys, values and last logits."""
    n = len(tokens)
    whole, logits = _kv_after(target, tokens, [n])
    same = True
    for plan in ([16] * (n // 16) + [n % 16], [n // 2] + [1] * (n - n // 2)):
        cache, other = _kv_after(target, tokens, [size for size in plan if size])
        same &= torch.equal(whole.kv[..., :n, :], cache.kv[..., :n, :]) and torch.equal(logits, other)
        cache.release()
    whole.release()
    return same


def test_a_prefill_s_rows_each_are_the_one_token_call_over_the_keys_before_them():
    q, k, v = _qkv(5, 12)
    out = row_exact(tree_attention, prefill=True)(q, k, v, None)
    for i in range(5):
        assert torch.equal(out[:, :, i : i + 1], tree_attention(q[:, :, i : i + 1], k[:, :, : 8 + i], v[:, :, : 8 + i], None))
    # without ``prefill`` an unmasked call is the attention as it is
    assert torch.equal(row_exact(tree_attention)(q, k, v, None), tree_attention(q, k, v, None))


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_prefill_leaves_the_bits_decode_steps_leave(tiny_dir, kind):
    target = _row_exact_target(tiny_dir, kind)
    tokens = _prompt(3, 70)
    assert _same_bits(target, tokens)
    for layer in target.layers:  # verification rows only, as before: a prefill's rows attended together
        layer.self_attn.attend = row_exact(layer.self_attn.attend.__wrapped__)
    assert not _same_bits(target, tokens)


def _target_with_cache(tiny_dir, kind: str = "bf16"):
    target = _row_exact_target(tiny_dir, kind)
    target.use_prefix_cache(8 << 20)
    return target


def _cold(target, prompt, params, drafter=None):
    """The same target with its prefix cache emptied: a cold start."""
    target.prefix_cache.clear()
    return generate(target, prompt, params, drafter)[0]


@pytest.mark.parametrize("mode", ["ar", "chain", "tree", "ngram"])
def test_a_bf16_target_s_next_turn_restores_its_last_text_and_answers_as_a_cold_start(tiny_dir, tiny, mode):
    target = _target_with_cache(tiny_dir)
    drafter = mode_drafter(mode, tiny["llama-draft"])
    first = _prompt(1, 40)
    output, _, _ = generate(target, first, GREEDY, drafter)
    second = first + output + _prompt(2, 9)
    again, stats, _ = generate(target, second, GREEDY, drafter)
    assert stats.cached_prompt_tokens >= len(first) + len(output) - 1
    assert again == _cold(target, second, GREEDY)


def test_a_bf16_target_s_sampled_outputs_are_a_cold_start_s(tiny_dir, tiny):
    target = _target_with_cache(tiny_dir)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=11)
    drafter = mode_drafter("chain", tiny["llama-draft"])
    first = _prompt(4, 33)
    output = generate(target, first, params, drafter)[0]
    second = first + output + _prompt(5, 7)
    again, stats, _ = generate(target, second, params, drafter)
    assert stats.cached_prompt_tokens >= len(first) + len(output) - 1
    assert again == _cold(target, second, params, drafter)


def test_auto_keeps_a_cache_for_a_row_exact_target_in_any_dtype():
    assert [prefix_cache_mb(-1, dtype, True, row_exact=True) for dtype in ("fp32", "bf16", "fp16")] == [1024] * 3
    assert [prefix_cache_mb(-1, dtype, True, row_exact=False) for dtype in ("bf16", "fp16")] == [0, 0]  # a CUDA target
    assert prefix_cache_mb(0, "bf16", True, row_exact=True) == 0  # as configured
