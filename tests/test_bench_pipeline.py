"""bench pipeline's summaries: pure functions of hand-made runs."""

from rich.console import Console

from specctl.bench.pipeline import _add_predictions, _summarise, per_prompt_ratios
from specctl.bench.render import ratio_cell, render_pipeline_table
from specctl.bench.spread import spread


def _run(tbt_ms: float, **extra) -> dict:
    return {"tbt_ms": tbt_ms, "same": True, **extra}


def _specpipe_run(tbt_ms: float) -> dict:
    return _run(tbt_ms, hit_rate=0.5, step_ms=100.0, bubbles_per_token=0.0)


def test_each_prompt_keeps_its_median_over_the_repeats_and_the_ratios_spread_over_the_prompts():
    pp = _summarise(4, "pp", [[_run(400), _run(400)], [_run(400), _run(420)]])
    chain = _summarise(4, "pp+chain", [[_run(200), _run(100)], [_run(220), _run(100)]])
    specpipe = _summarise(4, "specpipe", [[_specpipe_run(100), _specpipe_run(100)],
                                          [_specpipe_run(100), _specpipe_run(150)]])
    assert pp["tbt_ms_per_prompt"] == [400, 410]
    assert chain["tbt_ms_per_prompt"] == [210, 100]
    assert specpipe["tbt_ms_per_prompt"] == [100, 125]
    rows = [pp, chain, specpipe]
    _add_predictions(rows)
    assert specpipe["vs_pp_per_prompt"] == {"min": 3.28, "median": 3.64, "max": 4.0}
    assert specpipe["vs_pp_chain_per_prompt"] == {"min": 0.8, "median": 1.45, "max": 2.1}
    assert chain["vs_pp_chain_per_prompt"] == {"min": 1.0, "median": 1.0, "max": 1.0}
    assert specpipe["predicted_tbt_ms"] == 100 * (1 + 0.5 * 4)


def test_batch_rows_have_no_per_prompt_times():
    batch = _summarise(2, "pp+chain x8", [[{"tbt_ms": 50.0, "same": True, "same_count": 8, "tokens_per_s": 80.0, "sessions": 8}]])
    assert "tbt_ms_per_prompt" not in batch and batch["runs"] == 8 and batch["same_as_target"] == 8


def test_ratio_helpers():
    assert per_prompt_ratios([300, 100], [100, 200]) == [3.0, 0.5]
    assert spread([3, 1, 2]) == {"min": 1, "median": 2, "max": 3}
    assert spread([1 / 3, 2 / 3], 2) == {"min": 0.33, "median": 0.5, "max": 0.67}
    assert ratio_cell(None, None) == "-"
    assert ratio_cell(1.234, None) == "1.23x"
    assert ratio_cell(1.234, {"min": 1.0, "median": 1.0, "max": 1.0}) == "1.23x"
    assert ratio_cell(1.234, {"min": 0.8, "median": 1.2, "max": 2.1}) == "1.23x\n0.80-2.10"


def _table_text(rows: list[dict]) -> str:
    report = {"settings": {"prompts": 2, "max_tokens": 8, "stage_delay_ms": 50.0, "repeats": 1}, "rows": rows}
    console = Console(width=240, record=True)
    console.print(render_pipeline_table(report))
    return console.export_text()


def test_the_table_shows_the_per_prompt_spread_under_the_ratio():
    rows = [_summarise(2, "pp", [[_run(200), _run(200)]]), _summarise(2, "pp+chain", [[_run(100), _run(50)]])]
    _add_predictions(rows)
    text = _table_text(rows)
    assert "2.00-4.00" in text and "0.25-0.50" in text and "per-prompt ratios'" in text


def test_prediction_rows_are_set_against_specpipe_at_their_stage_count():
    specpipe = _summarise(2, "specpipe", [[_specpipe_run(100), _specpipe_run(50)]])
    predicted = _summarise(2, "pp+chain+prediction", [[_run(25, prediction_accepted=30),
                                                       _run(50, prediction_accepted=4)]])
    grafted = _summarise(2, "specpipe+prediction", [[{**_specpipe_run(20), "prediction_accepted": 30},
                                                     {**_specpipe_run(50), "prediction_accepted": 5}]])
    rows = [_summarise(2, "pp", [[_run(200), _run(200)]]), _summarise(2, "pp+chain", [[_run(100), _run(100)]]),
            specpipe, predicted, grafted]
    _add_predictions(rows)
    assert predicted["prediction_accepted"] == 34 and "prediction_accepted" not in specpipe
    assert predicted["vs_specpipe_per_prompt"] == {"min": 1.0, "median": 2.5, "max": 4.0}
    assert predicted["vs_specpipe"] == round((1e3 / 37.5) / (1e3 / 75), 3) == 2.0 and "vs_specpipe" not in specpipe
    assert grafted["prediction_accepted"] == 35 and grafted["vs_specpipe_per_prompt"]["max"] == 5.0
    # SpecPipe's E(T) (eq. 2) knows no predicted chains: none beside that row
    assert "predicted_tbt_ms" in specpipe and "predicted_tbt_ms" not in grafted and grafted["hit_rate"] == 0.5
    text = _table_text(rows)
    assert "vs SpecPipe" in text and "1.00-4.00" in text and "1.00-5.00" in text
    assert "grafted onto SpecPipe's tree" in text


def test_modes_add_the_prediction_row_only_for_prompts_that_carry_one():
    from specctl.bench.pipeline import pipeline_modes
    from specctl.pipeline.token_source import TreeShape

    shape = TreeShape(4, 2, refill=0)
    assert pipeline_modes(1, shape) == ("pp", "pp+chain")
    assert pipeline_modes(1, shape, predicted=True) == ("pp", "pp+chain", "pp+chain+prediction")
    assert pipeline_modes(2, shape, predicted=True) == ("pp", "pp+chain", "specpipe", "pp+chain+prediction",
                                                         "specpipe+prediction")
