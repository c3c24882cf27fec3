"""bench kernels: the bytes a step reads, the bandwidth limit, the report and table, the CLI."""

import json

import pytest
import torch

from specctl.bench.kernel_report import kernels_report
from specctl.bench.kernels import (
    ONE_EAGER, REPLAY_EACH, BatchTiming, StepTiming, bandwidth_limit_ms, time_batches, time_steps, weight_bytes_per_step,
)
from specctl.bench.shapes import random_decoder, shape_config
from specctl.bench.kernel_decode import READS_EACH, RUNS_AHEAD, DecodeTiming, decode_rows, time_decode
from specctl.bench.kernel_profile import profile_steps, summarize_kernels
from specctl.bench.render import render_kernel_batches_table, render_kernel_decode, render_kernel_profile, \
    render_kernels_table
from specctl.engine import packed
from specctl.engine.tiny import tiny_config
from tests.conftest import run_here
from tests.test_cli import _assert_one_line_error, run


def test_weight_bytes_count_a_tied_embedding_once_and_skip_an_untied_one():
    tied = random_decoder(tiny_config("qwen2", tie_word_embeddings=True), torch.float32, "cpu")
    untied = random_decoder(tiny_config("qwen2", tie_word_embeddings=False), torch.float32, "cpu")
    embedding = 320 * 64 * 4
    layers = sum(p.numel() for p in tied.layers.parameters()) * 4 + 64 * 4  # + the final norm
    assert weight_bytes_per_step(tied) == layers + embedding  # the LM head reads the shared table
    assert weight_bytes_per_step(untied) == layers + embedding  # the untied head; the table is looked up, not read
    if packed.candidate("cpu", "bf16", "none"):  # a packed head is a copy of the table: counted once, as the head
        packed_tied = random_decoder(tiny_config("qwen2", tie_word_embeddings=True), torch.bfloat16, "cpu")
        packed.pack_linears(packed_tied)
        assert weight_bytes_per_step(packed_tied) == (layers + embedding) // 2
    moe = random_decoder(tiny_config("qwen3_moe"), torch.float32, "cpu")
    experts = sum(p.numel() * 4 for name, p in moe.named_parameters() if ".experts." in name)
    rest = sum(p.numel() * 4 for name, p in moe.named_parameters() if ".experts." not in name and "embed" not in name)
    assert weight_bytes_per_step(moe) == rest + experts // 2  # a token reads 2 of its 4 experts


def test_known_shapes_and_the_limit():
    config = shape_config("1.5b")
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (1536, 28, 2)
    assert shape_config("qwen2.5-0.5b").intermediate_size == 4864
    with pytest.raises(ValueError, match="unknown model shape '3b'"):
        shape_config("3b")
    from specctl.engine.spec import ModelSpec

    for name, billions in (("0.6b", 0.596), ("1.7b", 1.72), ("qwen3-8b", 8.19)):  # the model cards' counts
        spec = ModelSpec.from_hf(shape_config(name))
        assert spec.arch == "qwen3" and spec.qk_norm and spec.head_dim == 128 and not spec.attention_bias
        hidden, inner, heads, kv = spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads
        layer = hidden * spec.head_dim * (2 * heads + 2 * kv) + 3 * hidden * inner
        params = spec.num_layers * layer + spec.vocab_size * hidden * (1 if spec.tie_embeddings else 2)
        assert params / 1e9 == pytest.approx(billions, abs=0.01), name
    for name, arch, billions, heads, head_dim in (("phi3-mini", "phi3", 3.82, 32, 96), ("phi4-mini", "phi3", 3.84, 24, 128),
                                                  ("gemma2-2b", "gemma2", 2.61, 8, 256),
                                                  ("gemma2-9b", "gemma2", 9.24, 16, 256),
                                                  ("gemma3-270m", "gemma3_text", 0.268, 4, 256),
                                                  ("gemma3-1b", "gemma3_text", 1.0, 4, 256),
                                                  ("qwen1.5-moe-a2.7b", "qwen2_moe", 14.32, 16, 128),
                                                  ("starcoder2-3b", "starcoder2", 3.03, 24, 128),
                                                  ("starcoder2-7b", "starcoder2", 7.17, 36, 128),
                                                  ("pythia-160m", "gpt_neox", 0.162, 12, 64),  # the paper's counts
                                                  ("pythia-1.4b", "gpt_neox", 1.415, 16, 128),
                                                  ("pythia-6.9b", "gpt_neox", 6.857, 32, 128),
                                                  ("deepseek-v2-lite", "deepseek_v2", 15.71, 16, 576),  # card: 15.7B; the latent cache's 512 + 64
                                                  ("phi-2", "phi", 2.78, 32, 80),  # 2,779,683,840: the Hub's
                                                  ("phi-1.5", "phi", 1.42, 32, 64),  # 1,418,270,720
                                                  # the card's 109B counts its vision encoder (~0.8B)
                                                  ("llama-4-scout", "llama4_text", 107.77, 40, 128),
                                                  ("gpt-oss-20b", "gpt_oss", 20.91, 64, 64)):
        _assert_shape(name, arch, billions, heads, head_dim)
    active = weight_bytes_per_step(random_decoder(shape_config("qwen1.5-moe-a2.7b"), torch.bfloat16, "meta")) / 2
    assert (active + 151936 * 2048) / 1e9 == pytest.approx(2.69, abs=0.01)  # the card's 2.7B: the shared expert whole
    # Llama 4 Scout: 16.14B read a token, and the embedding table's 1.03B make the card's 17B active
    active = weight_bytes_per_step(random_decoder(shape_config("llama-4-scout"), torch.bfloat16, "meta")) / 2
    assert (active + 202048 * 5120) / 1e9 == pytest.approx(17.17, abs=0.01)
    active = weight_bytes_per_step(random_decoder(shape_config("gpt-oss-20b"), torch.bfloat16, "meta")) / 2
    assert active / 1e9 == pytest.approx(3.61, abs=0.01)  # OpenAI's card: the head, not the table
    assert ModelSpec.from_hf(shape_config("phi4-mini")).inv_freq()[0].numel() == 48  # RoPE on 96 of 128 dims
    assert bandwidth_limit_ms(2_000_000_000, 1000.0) == pytest.approx(2.0)


@pytest.mark.slow  # 44 s of building meta models of 30-117B on 2 cores; the default run keeps the smaller shapes
def test_the_largest_shapes_match_their_cards():
    for name, arch, billions, heads, head_dim in (("qwen3-30b-a3b", "qwen3_moe", 30.53, 32, 128),
                                                  ("glm-4.5-air", "glm4_moe", 106.85, 96, 128),  # the card: 106B
                                                  ("gpt-oss-120b", "gpt_oss", 116.83, 64, 64)):
        _assert_shape(name, arch, billions, heads, head_dim)
    active = weight_bytes_per_step(random_decoder(shape_config("qwen3-30b-a3b"), torch.bfloat16, "meta")) / 2
    assert (active + 151936 * 2048) / 1e9 == pytest.approx(3.3, abs=0.06)  # the card's 3.3B active count the table
    active = weight_bytes_per_step(random_decoder(shape_config("gpt-oss-120b"), torch.bfloat16, "meta")) / 2
    assert active / 1e9 == pytest.approx(5.13, abs=0.01)  # OpenAI's card: the head, not the table


def _assert_shape(name: str, arch: str, billions: float, heads: int, head_dim: int) -> None:
    """The shape's family, heads and parameter count (a tied head shares the table: counted once)."""
    from specctl.engine.spec import ModelSpec

    spec = ModelSpec.from_hf(shape_config(name))
    params = sum(p.numel() for p in random_decoder(shape_config(name), torch.bfloat16, "meta").parameters())
    assert spec.arch == arch and (spec.num_heads, spec.head_dim) == (heads, head_dim)
    assert params / 1e9 == pytest.approx(billions, abs=0.01), name


def test_report_and_table_take_the_fastest_variant():
    decoder = random_decoder(tiny_config("llama"), torch.float32, "cpu")
    timings = {"eager": [StepTiming(1, 2.0, 4.0, 5.0), StepTiming(8, 3.0, 5.0, 6.0)],
               "graphs": [StepTiming(1, 1.0, 2.0, 3.0), StepTiming(8, 2.0, 2.5, 4.0)]}
    report = kernels_report("tiny", decoder, timings, 1.0, 16, {"dtype": "fp32", "context": 16})
    limit = report["bandwidth_limit_ms"]
    assert report["bytes_per_step"] == weight_bytes_per_step(decoder) + decoder.spec.kv_bytes_per_token(torch.float32) * 16
    assert limit == pytest.approx(report["bytes_per_step"] / 1e6)
    first, second = report["steps"]
    assert first["tokens_per_s"] == pytest.approx(500.0) and second["tokens_per_s"] == pytest.approx(8 / 2.5e-3)
    assert first["fraction_of_bandwidth_limit"] == pytest.approx(limit / 2.0)
    assert first["ms_min_median_max"]["eager"] == [2.0, 4.0, 5.0]
    table = render_kernels_table(report)
    assert [c.header for c in table.columns] == ["tokens", "eager ms (min/med/max)", "graphs ms (min/med/max)",
                                                 "tokens/s (best)", "of limit"]


def test_kernel_profile_sums_per_step_and_ranks_by_time():
    rows = [("gemv", 8, 600.0), ("norm", 12, 120.0), ("rope", 4, 40.0), ("add", 12, 40.0)]
    report = summarize_kernels(rows, steps=4, wall_us=1000.0, top=2)
    assert report["kernels_per_step"] == 9.0 and report["busy_us_per_step"] == 200.0
    assert report["wall_us_per_step"] == 250.0 and report["busy_share_of_wall"] == 0.8
    assert report["top"] == [{"name": "gemv", "calls_per_step": 2.0, "us_per_step": 150.0, "share": 0.75},
                             {"name": "norm", "calls_per_step": 3.0, "us_per_step": 30.0, "share": 0.15}]
    assert report["rest"] == {"names": 2, "calls_per_step": 4.0, "us_per_step": 20.0}  # ties ranked by name
    with pytest.raises(ValueError, match="need steps >= 1 and a wall time > 0, got 0 and 1.0"):
        summarize_kernels(rows, steps=0, wall_us=1.0)


def test_kernel_profile_of_cpu_steps_names_the_matrix_products():
    decoder = random_decoder(tiny_config("llama"), torch.float32, "cpu")
    report = profile_steps(decoder, context=8, steps=3, top=40)
    names = [row["name"] for row in report["top"]]
    assert report["steps"] == 3 and report["unit"] == "aten ops" and report["kernels_per_step"] > 0
    assert any(name in names for name in ("aten::mm", "aten::addmm", "aten::bmm"))
    # the wall time is taken unprofiled, so only the profiled one bounds the ops' self time
    assert 0 < report["busy_us_per_step"] <= report["profiled_wall_us_per_step"] and report["wall_us_per_step"] > 0
    top_us = sum(row["us_per_step"] for row in report["top"])
    assert top_us + report["rest"]["us_per_step"] == pytest.approx(report["busy_us_per_step"])
    table = render_kernel_profile({"variant": "eager", **report})
    assert [c.header for c in table.columns] == ["kernel", "calls a step", "us a step", "of busy"]
    assert f"{report['profiled_wall_us_per_step']:.0f} us a step under the profiler" in table.caption


def test_decode_rows_rate_each_way_against_the_limit():
    rows = decode_rows([DecodeTiming(READS_EACH, 64, 2.5, 2.8, 3.0), DecodeTiming(RUNS_AHEAD, 64, 2.1, 2.24, 2.4)], 1.12)
    assert rows == [
        {"how": READS_EACH, "tokens": 64, "ms_min_median_max": [2.5, 2.8, 3.0], "tokens_per_s": pytest.approx(1e3 / 2.8),
         "fraction_of_bandwidth_limit": pytest.approx(0.4)},
        {"how": RUNS_AHEAD, "tokens": 64, "ms_min_median_max": [2.1, 2.24, 2.4], "tokens_per_s": pytest.approx(1e3 / 2.24),
         "fraction_of_bandwidth_limit": pytest.approx(0.5)},
    ]
    table = render_kernel_decode({"decode": {"variant": "graphs+compile", "rows": rows}, "settings": {"repeats": 20}})
    assert table.title == "AR generation: 64 tokens after the context, graphs+compile, 20 generations"
    assert [c.header for c in table.columns] == ["how", "ms a token (min/med/max)", "tokens/s", "of limit"]


def test_decode_times_the_rounds_of_cpu_generations_one_way():
    decoder = random_decoder(tiny_config("llama"), torch.float32, "cpu")
    timings = time_decode(decoder, context=8, tokens=5, repeats=2)
    assert [(t.how, t.tokens) for t in timings] == [(READS_EACH, 5)]  # no graphs: nothing runs ahead
    assert 0 < timings[0].ms_min <= timings[0].ms_median <= timings[0].ms_max
    with pytest.raises(ValueError, match="a generation needs at least 2 tokens to time its rounds, got 1"):
        time_decode(decoder, 8, 1, 2)


def test_time_steps_leaves_the_context_and_times_every_size():
    decoder = random_decoder(tiny_config("llama"), torch.float32, "cpu")
    timings = time_steps(decoder, 12, (1, 4), repeats=2)
    assert [t.tokens for t in timings] == [1, 4] and all(0 < t.ms_min <= t.ms_median <= t.ms_max for t in timings)


@pytest.mark.slow
def test_cli_times_a_checkpoint_shape_on_cpu(tiny_dir, tmp_path):
    out = tmp_path / "k.json"
    proc = run("bench", "kernels", "--model", str(tiny_dir["llama"]), "--device", "cpu", "--dtype", "fp32",
               "--sizes", "1,2", "--context", "8", "--repeats", "2", "--sessions", "2,3", "--batch-tokens", "1",
               "--profile", "2", "--decode", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["variants"] == ["eager"] and [s["tokens"] for s in report["steps"]] == [1, 2]
    assert report["profile"]["variant"] == "eager" and report["profile"]["steps"] == 2
    assert "where an AR step goes: eager, 2 steps profiled" in proc.stdout
    assert report["decode"]["variant"] == "eager" and [r["how"] for r in report["decode"]["rows"]] == [READS_EACH]
    assert "AR generation: 3 tokens after the context, eager, 2 generations" in proc.stdout
    assert [(b["sessions"], b["tokens_each"], b["how"]) for b in report["batches"]] == [(2, 1, ONE_EAGER), (3, 1, ONE_EAGER)]
    assert "bench kernels" in proc.stdout and "batched steps" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--sizes", "1,128", "--device", "cpu"], "--sizes must be between 1 and 64"),
    (["--dtype", "int4", "--device", "cpu"], "--dtype must be one of fp32, bf16, fp16"),
    (["--model", "3b", "--device", "cpu"], "unknown model shape '3b'"),
    (["--sessions", "1,4", "--device", "cpu"], "--sessions must be between 2 and 64"),
    (["--sessions", "4", "--batch-tokens", "0", "--device", "cpu"], "--batch-tokens must be between 1 and 64"),
    (["--attention", "sdpa", "--device", "cpu"], "--attention must be torch or flashinfer, got 'sdpa'"),
    (["--profile", "-1", "--device", "cpu"], "--profile must be >= 0 (steps to profile; 0: off), got -1"),
    (["--decode", "1", "--device", "cpu"], "--decode must be 0 (off) or at least 2 tokens, got 1"),
    (["--attention", "flashinfer", "--device", "cpu"],
     "attention backend 'flashinfer' needs a CUDA device and `pip install flashinfer-python`"),
    (["--attention", "flashinfer", "--dtype", "fp32", "--device", "cpu"],
     "attention backend 'flashinfer' needs a CUDA device"),
])
def test_cli_rejects_bad_flags(args, message):
    _assert_one_line_error(run_here("bench", "kernels", *args), message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cli_without_cuda_says_to_use_the_cpu():
    _assert_one_line_error(run_here("bench", "kernels"), "--device cuda: no CUDA device here; use --device cpu")


def test_time_batches_times_both_ways_where_steps_replay_and_restores_the_choice():
    """Static steps on the CPU with per-session batches switched on by hand (as on CUDA graphs):
    up to REPLAY_PER_SESSION_UP_TO sessions are timed both ways, more as one eager forward only;
    every cache is left at its context and the decoder's choice is as it was."""
    from specctl.engine.static import REPLAY_PER_SESSION_UP_TO

    decoder = random_decoder(tiny_config("llama"), torch.float32, "cpu").use_static_steps(graphs=False)
    decoder.static.per_session = True
    over = REPLAY_PER_SESSION_UP_TO + 1
    timings = time_batches(decoder, 12, (2, over), (1, 3), repeats=2)
    assert [(t.sessions, t.tokens, t.how) for t in timings] == [
        (2, 1, REPLAY_EACH), (2, 1, ONE_EAGER), (2, 3, REPLAY_EACH), (2, 3, ONE_EAGER),
        (over, 1, ONE_EAGER), (over, 3, ONE_EAGER)]
    assert all(0 < t.ms_min <= t.ms_median <= t.ms_max for t in timings)
    assert decoder.static.per_session is True
    plain = random_decoder(tiny_config("llama"), torch.float32, "cpu")
    assert [t.how for t in time_batches(plain, 12, (2,), (1,), repeats=1)] == [ONE_EAGER]


def test_report_rates_a_batch_against_its_sessions_one_at_a_time():
    decoder = random_decoder(tiny_config("llama"), torch.float32, "cpu")
    timings = {"eager": [StepTiming(1, 1.0, 2.0, 3.0), StepTiming(8, 2.0, 2.5, 4.0)]}
    batches = {"eager": [BatchTiming(4, 1, ONE_EAGER, 5.0, 6.0, 7.0), BatchTiming(4, 5, ONE_EAGER, 5.0, 6.0, 7.0)]}
    report = kernels_report("tiny", decoder, timings, 1.0, 16, {"dtype": "fp32", "context": 16}, batches)
    first, second = report["batches"]
    assert first == {"variant": "eager", "sessions": 4, "tokens_each": 1, "how": ONE_EAGER,
                     "ms_min_median_max": [5.0, 6.0, 7.0], "vs_sessions_times_one_step": pytest.approx(6.0 / 8.0)}
    assert second["vs_sessions_times_one_step"] is None  # 5 tokens alone were not timed
    table = render_kernel_batches_table(report)
    assert [c.header for c in table.columns] == ["variant", "sessions", "tokens each", "how", "ms (min/med/max)",
                                                 "x sessions x one step"]
    assert table.row_count == 2


@pytest.mark.slow  # 61 layers of 256 experts built on "meta": ~20 s
def test_deepseek_v3_s_shape_has_the_card_s_671b_and_37b_a_token():
    """DeepSeek-V3's latent attention and experts, built at the real shape (no weights): 671.03B
    (the card's 671B, its multi-token-prediction layer apart); a token reads 36.63B of them plus
    its embedding row (the card's 37B activated)."""
    decoder = random_decoder(shape_config("deepseek-v3"), torch.bfloat16, "meta")
    assert sum(p.numel() for p in decoder.parameters()) / 1e9 == pytest.approx(671.03, abs=0.01)
    assert weight_bytes_per_step(decoder) / 2 / 1e9 == pytest.approx(36.63, abs=0.01)
    assert decoder.spec.head_dim == 576 and decoder.spec.num_kv_heads == 1  # one latent + rotated key a token
    assert decoder.spec.kv_bytes_per_token(torch.bfloat16) == 70_272


@pytest.mark.slow  # 24 layers of 128 experts built on "meta": ~8 s
def test_llama4_maverick_s_shape_has_the_card_s_400b_and_17b_a_token():
    """Llama 4 Maverick: mixtures of 128 experts on every other layer, 400.71B as text (the card's
    400B with its vision encoder); a token reads 16.15B, 17.18B with its embedding row's table."""
    decoder = random_decoder(shape_config("llama-4-maverick"), torch.bfloat16, "meta")
    assert sum(p.numel() for p in decoder.parameters()) / 1e9 == pytest.approx(400.71, abs=0.01)
    assert (weight_bytes_per_step(decoder) / 2 + 202048 * 5120) / 1e9 == pytest.approx(17.18, abs=0.01)
    assert decoder.spec.sparse_layers[:4] == (False, True, False, True) and not decoder.spec.qk_l2_norm
