"""bench net's overhead comparison runs end to end (it once crashed unnoticed) and compares
the same pair: the separate processes reproduce the one-process outputs."""

import pytest

from specctl.bench.net import overhead
from specctl.config import build_config
from specctl.spec.factory import load_named


@pytest.mark.slow
def test_overhead_runs_the_same_pair_in_one_process_and_in_two(tiny_dir):
    config = build_config(None, target=str(tiny_dir["llama"]), draft=f"{tiny_dir['llama']}@2", dtype="fp32")
    target, draft = load_named(config.target, config), load_named(config.draft, config)
    report = overhead(target, draft, config.target, config.draft, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41]], 8, 3, "fp32",
                      repeats=2)
    assert report["outputs_identical"] is True
    assert report["one_process_tokens_per_s"] > 0 and report["separate_processes_tokens_per_s"] > 0
    assert report["draft_compute_ms_per_round"] > 0
    assert report["repeats"] == 2 == len(report["ratio_per_turn"]) == len(report["one_process_tokens_per_s_per_turn"]) \
        == len(report["separate_processes_tokens_per_s_per_turn"])
    assert (report["prompts"], report["max_tokens"], report["depth"], report["dtype"]) == (2, 8, 3, "fp32")
