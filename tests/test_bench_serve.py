"""bench serve's summary: one row per variant and concurrency over the repeats, its ratios
against the baselines of the same run (the totals' and each repeat's), and its texts
against the target alone's in the same repeat."""

import pytest

from specctl.bench.serve import ServeBenchSettings, summarize


def _level(variant, clients, repeat, tokens, wall_s, texts, ttfts=(0.1,), latencies=(1.0,)):
    return {"variant": variant, "repeat": repeat, "clients": clients, "requests": len(texts), "tokens": tokens,
            "wall_s": wall_s, "tokens_per_s": tokens / wall_s, "texts": dict(enumerate(texts)),
            "ttfts_s": list(ttfts), "latencies_s": list(latencies)}


def test_repeats_merge_into_one_row_with_the_ratios_spread_over_them():
    settings = ServeBenchSettings((1,), 8, 1, 4, ("ar", "spec"), repeats=2)
    rows = [_level("ar", 1, 0, 40, 10.0, ["a"], ttfts=(0.2,)), _level("spec", 1, 0, 40, 5.0, ["a"], ttfts=(0.1,)),
            _level("spec", 1, 1, 40, 2.0, ["b"], ttfts=(0.3,)), _level("ar", 1, 1, 40, 8.0, ["b"], ttfts=(0.4,))]
    ar, spec = summarize(rows, settings)["rows"]
    assert (ar["variant"], ar["tokens"], ar["wall_s"], ar["tokens_per_s"]) == ("ar", 80, 18.0, pytest.approx(4.444, abs=1e-3))
    assert spec["tokens_per_s"] == pytest.approx(80 / 7.0, abs=1e-3) and spec["tokens_per_s_per_repeat"] == [8.0, 20.0]
    assert spec["vs ar"] == round((80 / 7.0) / (80 / 18.0), 3)  # the totals' ratio
    assert spec["vs ar per repeat"] == {"min": 2.0, "median": 3.0, "max": 4.0}  # 8/4 and 20/5, each repeat's own
    assert ar["vs ar per repeat"] == {"min": 1.0, "median": 1.0, "max": 1.0} and spec["vs ar batched"] is None
    assert spec["ttft_p50_ms"] == 200.0 and spec["same_as_ar"] == 1.0  # each repeat against its own ar texts


def test_one_repeat_has_no_spread_and_a_differing_text_counts_against_the_variant():
    settings = ServeBenchSettings((1, 2), 8, 1, 4, ("ar", "ar batched", "spec"))
    rows = [_level("ar", 1, 0, 8, 2.0, ["a"]), _level("ar", 2, 0, 16, 2.0, ["a", "b"]),
            _level("ar batched", 1, 0, 8, 1.0, ["a"]), _level("ar batched", 2, 0, 16, 1.0, ["a", "b"]),
            _level("spec", 1, 0, 8, 1.0, ["a"]), _level("spec", 2, 0, 16, 0.5, ["a", "c"])]
    report = summarize(rows, settings)
    assert [(r["variant"], r["clients"]) for r in report["rows"]] == [
        ("ar", 1), ("ar", 2), ("ar batched", 1), ("ar batched", 2), ("spec", 1), ("spec", 2)]
    spec2 = report["rows"][-1]
    assert (spec2["vs ar"], spec2["vs ar batched"], spec2["same_as_ar"]) == (4.0, 2.0, 0.5)
    assert "vs ar per repeat" not in spec2 and "tokens_per_s_per_repeat" not in spec2 and "texts" not in spec2
    assert report["settings"]["repeats"] == 1


def test_without_ar_the_texts_are_checked_against_batched_ar_and_the_table_says_so():
    from specctl.bench.render import render_serve_table

    settings = ServeBenchSettings((2,), 8, 1, 4, ("ar batched", "spec auto"))
    rows = [_level("ar batched", 2, 0, 16, 1.0, ["a", "b"]), _level("spec auto", 2, 0, 16, 0.8, ["a", "x"])]
    report = summarize(rows, settings)
    batched, auto = report["rows"]
    assert (auto["same_as_ar"], auto["same_as_ar_of"], auto["vs ar"], auto["vs ar batched"]) == \
        (0.5, "ar batched", None, 1.25)
    assert render_serve_table(report, "t").caption == "same as ar: the texts of ar batched (ar not run)"
    learnt = {"2": {"own": {"epochs": 2, "rate": 3.1}, "plain": {"epochs": 1, "rate": 2.0}}}
    epochs = [{"load": 2, "arm": "own", "round_ms": 310.0, "drafted": 5.5, "ended_s": 2.1}]
    tuned = summarize([_level("ar batched", 2, 0, 16, 1.0, ["a", "b"]),
                       {**_level("spec auto", 2, 0, 16, 0.8, ["a", "b"]), "depth_tuner": learnt,
                        "depth_tuner_epochs": epochs}], settings)
    assert tuned["rows"][1]["depth_tuner_per_repeat"] == [learnt] and "depth_tuner_per_repeat" not in tuned["rows"][0]
    assert tuned["rows"][1]["depth_tuner_epochs_per_repeat"] == [epochs]
    alone = summarize([_level("spec", 2, 0, 16, 0.8, ["a", "x"])], ServeBenchSettings((2,), 8, 1, 4, ("spec",)))
    assert "same_as_ar" not in alone["rows"][0]  # no baseline run: nothing to compare with
