"""GPU end to end (run on a lent H100, 2026-11-25; docs/results/gpu-e2e-h100-2026-11-25.json):
random weights of the Qwen2.5 1.5B/0.5B shapes, bf16, CUDA graphs + compiled layers; AR vs
chain/tree/n-gram speculation, tokens/s min/median/max over 4 prompts, same-as-AR.

Random weights accept nothing from another random model, and greedy decoding of them
degenerates into repeating a token (so n-gram lookup hits); "self" drafts with the target
itself (every token accepted), "exit@N" with its first N layers.
Usage: python examples/gpu_e2e_random_weights.py [TOKENS]  (needs CUDA; writes $OUT/e2e.json;
E2E_MODES="ar r/step,ngram d8" times ar and those modes only)."""
import json
import os
import statistics
import sys
import time

import torch

from specctl.bench.kernels import time_steps
from specctl.bench.shapes import random_decoder, shape_config
from specctl.engine.fusion import fuse_projections
from specctl.engine.parts import decoder_part
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate

OUT = os.environ.get("OUT", "/tmp")
torch.manual_seed(0)


def build(shape):
    dec = random_decoder(shape_config(shape), torch.bfloat16, "cuda")
    fuse_projections(dec)
    return dec


def draft_step_ms(draft, stop: float, prompt: list[int], rounds: int = 30) -> float:
    """Median ms a forward of a greedy d4 chain proposal (the catch-up of one token and 3 steps)."""
    session = ModelChainDrafter(draft, 4, stop=stop).open(len(prompt) + rounds + 8)
    seq, times = list(prompt), []
    for r in range(rounds + 3):
        seq.append(1000 + r)
        torch.cuda.synchronize()
        start = time.perf_counter()
        session.propose(seq, SamplingParams(), None)  # ends in its read-back
        times.append((time.perf_counter() - start) * 1e3 / 4)
        session.on_verified([])
    session.close()
    return statistics.median(times[3:])


def main():
    n_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    target = build("1.5b").use_static_steps(graphs=True, compile=True)
    draft = build("0.5b").use_static_steps(graphs=True, compile=True)
    exits = {}
    for n in (2, 4):
        exits[n] = decoder_part(target, (0, n), embed=True, head=True).use_static_steps(graphs=True, compile=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 150000, (length,), generator=gen).tolist() for length in (40, 200, 90, 400)]
    params = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    modes = {
        "ar": lambda: None,  # runs ahead: the next step is launched before the token is read back
        "ar r/step": lambda: None,  # reads each token back before the next step (before 2026-11-27)
        "chain 0.5b d4": lambda: ModelChainDrafter(draft, 4),
        # a stop too small to end a chain: the same drafts, read back every step (before 2026-11-26)
        "chain 0.5b d4 r/step": lambda: ModelChainDrafter(draft, 4, stop=1e-30),
        "chain self d4": lambda: ModelChainDrafter(target, 4),
        "ngram d8": lambda: NgramDrafter(8),
        "chain exit@2 d4": lambda: ModelChainDrafter(exits[2], 4),
        "chain exit@2 r/step": lambda: ModelChainDrafter(exits[2], 4, stop=1e-30),
        "chain exit@4 d4": lambda: ModelChainDrafter(exits[4], 4),
        "tree exit@4 4x2x4": lambda: ModelTreeDrafter(exits[4], 4, 2, 4),
        "tree self 4x2x4": lambda: ModelTreeDrafter(target, 4, 2, 4),
    }
    # Warm every mode over every prompt: compiles and the graphs of every KV size the timed runs
    # meet (with a first prompt alone, the first mode to meet a size paid its captures).
    only = os.environ.get("E2E_MODES")  # a comma-separated subset, for a short device call
    if only:
        modes = {name: make for name, make in modes.items() if name in only.split(",") or name == "ar"}

    def run(name: str, prompt: list[int]):
        return generate(target, prompt, params, modes[name](), run_ahead=False if name == "ar r/step" else None)

    for name in modes:
        for prompt in prompts:
            run(name, prompt)
    static = [target.static, draft.static] + [decoder.static for decoder in exits.values()]
    results, reference = {}, {}
    for name in modes:
        rates, same, accepted, drafts, prefill = [], 0, 0, 0, []
        captures = sum(runner.captures for runner in static)
        for i, prompt in enumerate(prompts):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out, stats, _ = run(name, prompt)
            wall = time.perf_counter() - start
            rates.append(len(out) / wall)
            prefill.append(1000 * stats.prefill_s)
            if name == "ar":
                reference[i] = out
            same += out == reference[i]
            accepted += stats.accepted
            drafts += stats.drafts
        mal = 1 + accepted / drafts if drafts else 1.0
        # Graphs captured during the timed sessions (buffers are shared across sessions since
        # 2026-11-26: after the warm-up a session of a seen size should capture none).
        captured = sum(runner.captures for runner in static) - captures
        results[name] = {"tok_s": [round(min(rates), 1), round(statistics.median(rates), 1), round(max(rates), 1)],
                         "mean_accepted_length": round(mal, 2), "same_as_ar": f"{same}/{len(prompts)}",
                         "prefill_ms": [round(ms, 1) for ms in prefill], "graphs_captured": captured}
        print(f"{name:18s} tok/s {results[name]['tok_s']}  MAL {mal:.2f}  same as ar {same}/{len(prompts)}  "
              f"prefill ms {results[name]['prefill_ms']}  graphs captured {captured}", flush=True)
    ar = results["ar"]["tok_s"][1]
    ar_step = time_steps(target, 512, (1,), 30)[0].ms_median
    steps = {}
    for stop, label in () if only else ((0.0, "read once"), (1e-30, "read each step")):
        ms = draft_step_ms(draft, stop, prompts[3])
        steps[label] = {"ms": round(ms, 3), "vs_target_ar_step": round(ms / ar_step, 3)}
        print(f"0.5b draft step in a d4 chain ({label}): {ms:.2f} ms = {ms / ar_step:.2f}x the 1.5b AR step "
              f"({ar_step:.2f} ms, context 512)", flush=True)
    for name, r in results.items():
        r["median_vs_ar"] = round(r["tok_s"][1] / ar, 2)
    with open(f"{OUT}/e2e.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "tokens": n_tokens, "prompts": [len(p) for p in prompts],
                   "results": results,
                   "draft_step": steps, "target_ar_step_ms": round(ar_step, 3)}, f, indent=1)


if __name__ == "__main__":
    main()
