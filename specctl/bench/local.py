"""``specctl bench local``: every mode on the same prompts in one process, greedy, with the
target alone (ar) and transformers' assisted generation (hf-assisted) as baselines."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from rich.progress import Progress

from specctl.bench.prompts import BenchPrompt
from specctl.config import Config
from specctl.engine.loader import DTYPES, LoadedModel
from specctl.engine.text import encode_user_text
from specctl.spec.rounds import generate
from specctl.spec.factory import make_drafter
from specctl.spec.sampling import SamplingParams

MODES = ("ar", "chain", "tree", "ngram", "hf-assisted")


@dataclass(slots=True)
class ModeResult:
    mode: str
    new_tokens: int = 0
    wall_s: float = 0.0
    rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def summary(self, ar: "ModeResult | None") -> dict:
        spec = self.mode not in ("ar", "hf-assisted")
        same = None
        if ar is not None and ar.outputs and self.outputs:
            same = sum(a == b for a, b in zip(ar.outputs, self.outputs)) / len(self.outputs)
        return {
            "tokens_per_s": round(self.tokens_per_s, 3),
            "speedup_vs_ar": round(self.tokens_per_s / ar.tokens_per_s, 3) if ar and ar.tokens_per_s else None,
            "mean_accepted_length": round(1 + self.accepted / self.rounds, 3) if spec and self.rounds else None,
            "acceptance_rate": round(self.accepted / self.drafted, 3) if spec and self.drafted else None,
            "new_tokens": self.new_tokens,
            "wall_s": round(self.wall_s, 3),
            "outputs_equal_to_ar": same,
        }


def run_engine_mode(mode: str, config: Config, target: LoadedModel, draft: LoadedModel | None,
                    prompts: list[list[int]], max_tokens: int, advance) -> ModeResult:
    drafter = make_drafter(config.replace(mode=mode), draft)
    params = SamplingParams(max_tokens=max_tokens)
    generate(target.decoder, prompts[0][:8], SamplingParams(max_tokens=4), drafter)  # warm-up
    result = ModeResult(mode)
    for ids in prompts:
        start = time.perf_counter()
        out, stats, _ = generate(target.decoder, ids, params, drafter, eos_token_ids=target.eos_token_ids)
        result.wall_s += time.perf_counter() - start
        result.new_tokens += len(out)
        result.rounds += stats.drafts  # speculative rounds: acceptance is over drafts
        result.accepted += stats.accepted
        result.drafted += stats.drafted
        result.outputs.append(out)
        advance()
    return result


def run_hf_assisted(config: Config, target: LoadedModel, draft: LoadedModel, prompts: list[list[int]],
                    max_tokens: int, advance) -> ModeResult:
    """transformers' own assisted generation with the same two checkpoints."""
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
    eos = list(target.eos_token_ids) or None
    kw = dict(do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else None)
    result = ModeResult("hf-assisted")
    with torch.inference_mode():
        hf_target.generate(torch.tensor([prompts[0][:8]]), assistant_model=hf_draft, max_new_tokens=4, **kw)
        for ids in prompts:
            start = time.perf_counter()
            out = hf_target.generate(torch.tensor([ids]), assistant_model=hf_draft, max_new_tokens=max_tokens, **kw)
            result.wall_s += time.perf_counter() - start
            new = out[0, len(ids):].tolist()
            while new and new[-1] in target.eos_token_ids:  # we do not count the EOS either
                new.pop()
            result.new_tokens += len(new)
            result.outputs.append(new)
            advance()
    del hf_target, hf_draft
    return result


def run_local_bench(config: Config, target: LoadedModel, draft: LoadedModel | None, prompts: list[BenchPrompt],
                    modes: list[str], max_tokens: int, progress: Progress) -> dict:
    encoded = [encode_user_text(target.tokenizer, p.prompt, p.chat) for p in prompts]
    task = progress.add_task("benchmark", total=len(modes) * len(encoded))
    results: dict[str, ModeResult] = {}
    for mode in modes:
        progress.update(task, description=f"mode {mode}")
        advance = lambda: progress.advance(task)  # noqa: E731
        if mode == "hf-assisted":
            results[mode] = run_hf_assisted(config, target, draft, encoded, max_tokens, advance)
        else:
            results[mode] = run_engine_mode(mode, config, target, draft, encoded, max_tokens, advance)
    ar = results.get("ar")
    return {
        "settings": {
            "target": config.target, "draft": config.draft, "dtype": config.dtype, "max_tokens": max_tokens,
            "prompts": len(prompts), "depth": config.depth, "topk": config.topk, "width": config.width,
            "draft_quant": config.draft_quant,
            "threads": torch.get_num_threads(), "temperature": 0.0,
        },
        "modes": {mode: r.summary(ar) for mode, r in results.items()},
    }
