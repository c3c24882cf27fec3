"""``specctl bench local``: every mode on the same prompts in one process, greedy, with the
target alone (ar) and transformers' assisted generation (hf-assisted) as baselines.

The modes take turns prompt by prompt (the order rotates with the prompt and the repeat),
so a slow minute of the machine falls on every mode alike; each repeat gives one ratio
per mode, reported as min / median / max beside the ratio of the totals.

``MODE+prediction`` (ar, chain, tree, ngram, suffix) runs MODE with each prompt's prediction
(OpenAI's Predicted Outputs, spec.prediction; the "edits" prompts carry one), beside MODE
without it."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from rich.progress import Progress

from specctl.bench.prompts import BenchPrompt
from specctl.config import Config
from specctl.engine.loader import DTYPES, LoadedModel
from specctl.engine.fim import encode_infill, infill_stops
from specctl.engine.text import encode_user_text
from specctl.spec.factory import make_drafter
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams

MODES = ("ar", "chain", "tree", "ngram", "suffix", "hf-assisted")
PREDICTED = "+prediction"  # MODE+prediction: MODE with each prompt's prediction
ENGINE_MODES = ("ar", "chain", "tree", "ngram", "suffix")


def known_mode(mode: str) -> bool:
    return mode in MODES or (mode.endswith(PREDICTED) and mode.removesuffix(PREDICTED) in ENGINE_MODES)
Runner = Callable[[list[int]], tuple[list[int], object]]  # prompt ids -> (new tokens, GenerationStats or None)


@dataclass(slots=True)
class Tally:
    tokens: int = 0
    wall_s: float = 0.0

    def add(self, tokens: int, wall_s: float) -> None:
        self.tokens += tokens
        self.wall_s += wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


@dataclass(slots=True)
class ModeResult:
    mode: str
    total: Tally = field(default_factory=Tally)
    per_repeat: dict[int, Tally] = field(default_factory=dict)
    per_kind: dict[str, Tally] = field(default_factory=dict)
    drafts: int = 0
    accepted: int = 0
    drafted: int = 0
    outputs: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (repeat, prompt) -> tokens

    def record(self, repeat: int, index: int, kind: str, out: list[int], stats, wall_s: float) -> None:
        for tally in (self.total, self.per_repeat.setdefault(repeat, Tally()), self.per_kind.setdefault(kind, Tally())):
            tally.add(len(out), wall_s)
        self.outputs[(repeat, index)] = out
        if stats is not None:
            self.drafts += stats.drafts
            self.accepted += stats.accepted
            self.drafted += stats.drafted

    def summary(self, ar: "ModeResult | None", kinds: dict[int, str]) -> dict:
        spec = self.mode not in ("ar", "hf-assisted")
        ratio = lambda mine, base: round(mine.tokens_per_s / base.tokens_per_s, 3) if base and base.tokens_per_s else None  # noqa: E731
        same = lambda keys: (sum(self.outputs[k] == ar.outputs[(0, k[1])] for k in keys) / len(keys)  # noqa: E731
                             if ar is not None and keys else None)
        spread = [ratio(t, ar.per_repeat[r]) for r, t in sorted(self.per_repeat.items())] if ar else []
        return {
            "tokens_per_s": round(self.total.tokens_per_s, 3),
            "speedup_vs_ar": ratio(self.total, ar.total if ar else None),
            "speedup_per_repeat": spread,
            "speedup_min_median_max": [min(spread), statistics.median(spread), max(spread)] if spread else None,
            "mean_accepted_length": round(1 + self.accepted / self.drafts, 3) if spec and self.drafts else None,
            "acceptance_rate": round(self.accepted / self.drafted, 3) if spec and self.drafted else None,
            "new_tokens": self.total.tokens,
            "wall_s": round(self.total.wall_s, 3),
            "outputs_equal_to_ar": same(list(self.outputs)),
            "per_kind": {
                kind: {"tokens_per_s": round(t.tokens_per_s, 3), "new_tokens": t.tokens,
                       "speedup_vs_ar": ratio(t, ar.per_kind.get(kind) if ar else None),
                       "outputs_equal_to_ar": same([k for k in self.outputs if kinds[k[1]] == kind])}
                for kind, t in sorted(self.per_kind.items())
            },
        }


def engine_runner(mode: str, config: Config, target: LoadedModel, draft: LoadedModel | None, max_tokens: int,
                  warm_up: list[int], ends: tuple[int, ...] | None = None,
                  predictions: dict[tuple[int, ...], tuple[int, ...]] | None = None) -> Runner:
    """``predictions``: prompt ids -> the prediction's ids, for a MODE+prediction mode."""
    base = mode.removesuffix(PREDICTED)
    drafter = make_drafter(config.replace(mode=base), draft)
    run = drafter_runner(drafter, target, max_tokens, warm_up, ends,
                         predictions if mode.endswith(PREDICTED) else None)
    return run if base != "suffix" else fresh_per_repeat(run, drafter)


def fresh_per_repeat(run: Runner, drafter) -> Runner:
    """Suffix decoding remembers every output it saw: within a repeat a prompt may draw on the
    outputs of the prompts before it (as a server's later requests would), never on its own
    output of an earlier repeat or the warm-up's — the memory is emptied when a prompt comes back."""
    seen: set[tuple[int, ...]] = set()
    drafter.forget()

    def fresh(ids: list[int]):
        if tuple(ids) in seen:
            seen.clear()
            drafter.forget()
        seen.add(tuple(ids))
        return run(ids)

    return fresh


def drafter_runner(drafter, target: LoadedModel, max_tokens: int, warm_up: list[int],
                   ends: tuple[int, ...] | None = None,
                   predictions: dict[tuple[int, ...], tuple[int, ...]] | None = None) -> Runner:
    """Greedy generation with ``drafter`` (None = the target alone), warmed up once; ``ends``:
    the tokens that end a generation (the target's EOS unless given); ``predictions``: each
    prompt's prediction (spec.prediction)."""
    params = SamplingParams(max_tokens=max_tokens)
    generate(target.decoder, warm_up, SamplingParams(max_tokens=4), drafter)
    ends = target.eos_token_ids if ends is None else ends

    def run(ids: list[int]):
        predicted = (predictions or {}).get(tuple(ids), ())
        out, stats, _ = generate(target.decoder, ids, dataclasses.replace(params, prediction=predicted), drafter,
                                 eos_token_ids=ends)
        return out, stats

    return run


def hf_assisted_runner(config: Config, target: LoadedModel, draft: LoadedModel, max_tokens: int,
                       warm_up: list[int], ends: tuple[int, ...] | None = None) -> Runner:
    """transformers' own assisted generation with the same two checkpoints (its defaults:
    dynamic draft length and its confidence threshold)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dtype = DTYPES[config.dtype]
    hf_target = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(draft.path, dtype=dtype).eval()
    if draft.spec.num_layers != hf_draft.config.num_hidden_layers:  # NAME@N self-drafts
        hf_draft.model.layers = hf_draft.model.layers[: draft.spec.num_layers]
        hf_draft.config.num_hidden_layers = draft.spec.num_layers
    ends = target.eos_token_ids if ends is None else ends
    eos = list(ends) or None
    kw = dict(do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else None)

    def run(ids: list[int], new: int = max_tokens):
        with torch.inference_mode():
            out = hf_target.generate(torch.tensor([ids]), assistant_model=hf_draft, max_new_tokens=new, **kw)
        tokens = out[0, len(ids):].tolist()
        while tokens and tokens[-1] in ends:  # we do not count the EOS either
            tokens.pop()
        return tokens, None

    run(warm_up, 4)
    return run


def run_local_bench(config: Config, target: LoadedModel, draft: LoadedModel | None, prompts: list[BenchPrompt],
                    modes: list[str], max_tokens: int, progress: Progress, repeats: int = 1) -> dict:
    encoded, ends = prompt_ids(target, prompts)
    predictions = {tuple(ids): tuple(target.tokenizer.encode(p.prediction, add_special_tokens=False))
                   for ids, p in zip(encoded, prompts) if p.prediction}
    warm_up = encoded[0][:8]
    runners: dict[str, Runner] = {}
    for mode in modes:
        progress.console.print(f"[dim]preparing {mode}[/]")
        runners[mode] = (hf_assisted_runner(config, target, draft, max_tokens, warm_up, ends) if mode == "hf-assisted"
                         else engine_runner(mode, config, target, draft, max_tokens, warm_up, ends, predictions))
    return {
        "settings": {
            "target": config.target, "draft": config.draft, "dtype": config.dtype, "max_tokens": max_tokens,
            "prompts": len(prompts), "repeats": repeats, "depth": config.depth, "topk": config.topk,
            "width": config.width, "draft_stop": config.draft_stop, "draft_quant": config.draft_quant,
            "threads": torch.get_num_threads(), "temperature": 0.0,
        },
        "modes": measure(runners, encoded, [p.kind for p in prompts], progress, repeats),
    }


def prompt_ids(target: LoadedModel, prompts: list[BenchPrompt]) -> tuple[list[list[int]], tuple[int, ...]]:
    """The prompts' token ids, and the tokens that end a generation: the target's EOS, and an
    infill's end tokens too when the set holds infills (every mode and baseline stops alike)."""
    encoded = [encode_infill(target.tokenizer, p.prompt, p.suffix) if p.suffix is not None
               else encode_user_text(target.tokenizer, p.prompt, p.chat) for p in prompts]
    infills = any(p.suffix is not None for p in prompts)
    return encoded, infill_stops(target.tokenizer, target.eos_token_ids) if infills else target.eos_token_ids


def measure(runners: dict[str, Runner], encoded: list[list[int]], kinds: list[str], progress: Progress,
            repeats: int) -> dict:
    """Every runner on every prompt, taking turns prompt by prompt (the order rotates), so a
    slow minute of the machine falls on all of them; summaries against the "ar" runner."""
    modes = list(runners)
    results = {mode: ModeResult(mode) for mode in modes}
    task = progress.add_task("benchmark", total=repeats * len(encoded) * len(modes))
    for repeat in range(repeats):
        for index, ids in enumerate(encoded):
            shift = (index + repeat) % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                progress.update(task, description=f"repeat {repeat + 1}/{repeats}, prompt {index + 1}, {mode}")
                start = time.perf_counter()
                out, stats = runners[mode](ids)
                results[mode].record(repeat, index, kinds[index], out, stats, time.perf_counter() - start)
                progress.advance(task)
    ar = results.get("ar")
    return {mode: r.summary(ar, dict(enumerate(kinds))) for mode, r in results.items()}
