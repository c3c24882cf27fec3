"""lm-eval through the gateway against lm-eval on transformers directly: the same per-sample
log-likelihoods (echo + logprobs) and the same greedy generations (stop strings).

    specctl up --port 8123 --dtype fp32 &            # the default Qwen pair
    pip install "lm-eval[api]==0.4.13"               # in an environment of its own
    python examples/lm_eval/compare.py --gateway http://127.0.0.1:8123 --lm-eval /path/to/venv/bin/lm_eval

Two small tasks over qa.jsonl (8 coding questions): a multiple-choice one (loglikelihood:
batched token ids, echo, logprobs 1, max_tokens 1) and a generate_until one (stop at a newline).
Prints the largest log-likelihood difference and how many generations are identical."""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
"""
MC = TASK + """output_type: multiple_choice
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN = TASK + """output_type: generate_until
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def samples(root: str, task: str) -> list[dict]:
    path = sorted(glob.glob(f"{root}/**/samples_{task}_*.jsonl", recursive=True))[-1]
    return sorted((json.loads(line) for line in open(path)), key=lambda s: s["doc_id"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8123")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="the gateway's model name")
    parser.add_argument("--weights", default=os.path.expanduser("~/.cache/specctl/models/qwen2.5-coder-1.5b"),
                        help="the same model's directory, for lm-eval's hf backend and the tokenizer")
    parser.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="specctl-lm-eval-"))
    data = HERE / "qa.jsonl"
    (work / "mc.yaml").write_text(MC.format(name="specctl_mc", data=data))
    (work / "gen.yaml").write_text(GEN.format(name="specctl_gen", data=data))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    common = ["--tasks", "specctl_mc,specctl_gen", "--include_path", str(work), "--log_samples"]
    backends = {
        "specctl": ["--model", "local-completions", "--model_args",
                    f"model={args.model},base_url={args.gateway}/v1/completions,tokenizer={args.weights},"
                    "tokenized_requests=True,num_concurrent=1,max_retries=1"],
        "hf": ["--model", "hf", "--model_args", f"pretrained={args.weights},dtype=float32", "--batch_size", "1"],
    }
    for name, model in backends.items():
        subprocess.run([args.lm_eval, *model, *common, "--output_path", str(work / name)], check=True, env=env)
    mc = list(zip(samples(str(work / "specctl"), "specctl_mc"), samples(str(work / "hf"), "specctl_mc")))
    diffs = [abs(float(a[0][0]) - float(b[0][0])) for s, h in mc for a, b in zip(s["resps"], h["resps"])]
    gen = list(zip(samples(str(work / "specctl"), "specctl_gen"), samples(str(work / "hf"), "specctl_gen")))
    print(f"loglikelihoods: {len(diffs)} compared, largest difference {max(diffs):.3g}; "
          f"acc {sum(s['acc'] for s, _ in mc) / len(mc):.3f} (specctl) vs {sum(h['acc'] for _, h in mc) / len(mc):.3f} (hf)")
    print(f"generations: {sum(s['resps'] == h['resps'] for s, h in gen)} of {len(gen)} identical")


if __name__ == "__main__":
    main()
