"""What loading a model costs beyond reading its weights."""

import json
import subprocess
import sys

import torch

from specctl.engine.loader import load_model

LOADS_WITHOUT_DYNAMO = """
import json, sys
from pathlib import Path
from specctl.engine.loader import load_model
for path in map(Path, json.loads(sys.argv[1])):
    load_model("tiny", path)
    load_model("tiny", path, weights=False)
print(sorted(name for name in sys.modules if name.startswith("torch._dynamo"))[:3])
"""


def test_loading_every_family_imports_no_torch_dynamo(tiny_dir):
    """A decoder is built on the meta device; a random init there (the embedding's normal_) or
    RoPE computed there runs through torch's Python refs, whose first use imports torch._dynamo:
    about a second of each process's first load. Every family, full and vocabulary-only, in a
    fresh interpreter (this one has imported it long since)."""
    targets = [str(path) for name, path in tiny_dir.items() if not name.endswith("-draft")]
    assert len(targets) >= 20
    result = subprocess.run([sys.executable, "-c", LOADS_WITHOUT_DYNAMO, json.dumps(targets)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_the_embedding_holds_the_checkpoints_rows_and_rope_is_on_the_cpu(tiny_dir):
    """The uninitialised embedding table is the checkpoint's after loading (not left empty), and
    RoPE's frequencies, computed off the meta device, are real numbers."""
    from safetensors import safe_open

    model = load_model("tiny", tiny_dir["qwen2"])
    with safe_open(str(tiny_dir["qwen2"] / "model.safetensors"), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(model.decoder.embed_tokens.weight, table)
    assert model.decoder.inv_freq.device.type == "cpu" and torch.isfinite(model.decoder.inv_freq).all()
    skeleton = load_model("tiny", tiny_dir["qwen2"], weights=False)
    assert skeleton.decoder.embed_tokens.weight.is_meta
