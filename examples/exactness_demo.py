"""Greedy exactness, shown: every speculative mode against the target alone (fp32).

    python examples/exactness_demo.py                 # tiny random models, many seeds
    python examples/exactness_demo.py --smollm        # + smollm2-135m drafted by its first 10 / 20 layers
    python examples/exactness_demo.py --qwen          # + the Qwen pair on 3 prompts (minutes)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from specctl.engine.loader import load_decoder, load_model
from specctl.engine.tiny import make_tiny_model
from specctl.spec.decode import generate
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.params import SamplingParams
from specctl.store import resolve_model

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three facts about the Moon.",
    "Give me a JSON object describing a book with title, author and year.",
]


def compare(table: Table, label: str, target, drafts: dict, prompts: list[list[int]], max_tokens: int, eos=()) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=not eos)
    references = [generate(target, ids, params, eos_token_ids=eos)[0] for ids in prompts]
    for name, drafter in drafts.items():
        same, mal = 0, []
        for ids, ref in zip(prompts, references):
            out, stats, _ = generate(target, ids, params, drafter, eos_token_ids=eos)
            same += out == ref
            mal.append(stats.mean_accepted_length)
        table.add_row(label, name, f"{same}/{len(prompts)}", f"{sum(mal) / len(mal):.2f}")


def chat_ids(model, text):
    rendered = model.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return model.tokenizer.encode(rendered, add_special_tokens=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smollm", action="store_true")
    parser.add_argument("--qwen", action="store_true")
    args = parser.parse_args()
    table = Table(title="greedy exactness vs the target alone (fp32)")
    for column in ("target", "mode / draft", "identical to ar", "mean accepted length"):
        table.add_column(column)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen2"):
            t = load_decoder(make_tiny_model(Path(tmp) / arch, arch, seed=0))
            d = load_decoder(make_tiny_model(Path(tmp) / f"{arch}-d", arch, seed=9, layers=2))
            self2 = load_decoder(Path(tmp) / arch, layer_range=(0, 2))
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in torch.randint(1, 40, (20,), generator=gen)]
            drafts = {"chain d=4, disagreeing draft": ModelChainDrafter(d, 4), "chain d=4, first 2 layers": ModelChainDrafter(self2, 4),
                      "tree 4x3x4, disagreeing draft": ModelTreeDrafter(d, 4, 3, 4), "tree 4x3x4, first 2 layers": ModelTreeDrafter(self2, 4, 3, 4),
                      "ngram d=4": NgramDrafter(4)}
            compare(table, f"tiny-{arch} (20 prompts)", t, drafts, prompts, 32)
    if args.smollm:
        path = resolve_model("smollm2-135m")
        target = load_model("smollm2-135m", path, "fp32")
        prompts = [chat_ids(target, p) for p in PROMPTS]
        for layers in (10, 20):
            d = load_model(f"@{layers}", path, "fp32", num_layers=layers).decoder
            drafts = {f"chain d=4, @{layers}": ModelChainDrafter(d, 4), f"tree 4x3x4, @{layers}": ModelTreeDrafter(d, 4, 3, 4)}
            compare(table, "smollm2-135m (3 prompts)", target.decoder, drafts, prompts, 32, target.eos_token_ids)
        compare(table, "smollm2-135m (3 prompts)", target.decoder, {"ngram d=4": NgramDrafter(4)}, prompts, 32, target.eos_token_ids)
    if args.qwen:
        target = load_model("qwen2.5-coder-1.5b", resolve_model("qwen2.5-coder-1.5b"), "fp32")
        d = load_model("qwen2.5-coder-0.5b", resolve_model("qwen2.5-coder-0.5b"), "fp32").decoder
        prompts = [chat_ids(target, p) for p in PROMPTS]
        drafts = {"chain d=4, 0.5b": ModelChainDrafter(d, 4), "tree 4x3x4, 0.5b": ModelTreeDrafter(d, 4, 3, 4), "ngram d=4": NgramDrafter(4)}
        compare(table, "qwen2.5-coder-1.5b (3 prompts)", target.decoder, drafts, prompts, 48, target.eos_token_ids)
    Console().print(table)


if __name__ == "__main__":
    main()
