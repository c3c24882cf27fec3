"""What loading a model costs beyond reading its weights."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specctl.engine.loader import load_model
from specctl.errors import CheckpointUnreadable, UnsupportedArchitecture
from specctl.engine.tokenizers import KEPT, load_tokenizer, tokenizer_key, vocab_fingerprint

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


def _copy_tokenizer_dir(source: Path, to: Path) -> Path:
    """``source`` without its weights: its tokenizer's files and config."""
    to.mkdir()
    for file in source.iterdir():
        if not file.name.endswith(".safetensors"):
            shutil.copy(file, to / file.name)
    return to


def test_models_with_the_same_tokenizer_files_share_one_tokenizer(tiny_dir):
    """A draft and its target of one family (different weights, layers and configs) get one
    tokenizer object, parsed once; a different vocabulary gets its own."""
    target, draft = load_model("t", tiny_dir["qwen2"]), load_model("d", tiny_dir["qwen2-draft"])
    assert tokenizer_key(tiny_dir["qwen2"]) == tokenizer_key(tiny_dir["qwen2-draft"])
    assert draft.tokenizer is target.tokenizer
    other = load_model("o", tiny_dir["llama-other-vocab"])
    assert other.tokenizer is not target.tokenizer and len(other.tokenizer) != len(target.tokenizer)


def test_a_changed_tokenizer_file_or_model_type_changes_the_key(tiny_dir, tmp_path):
    """Any tokenizer file edited (a chat template) is another tokenizer; so is another model
    type's config (AutoTokenizer may pick its class by it); weights and the rest of the config
    are not the tokenizer's."""
    base = tokenizer_key(tiny_dir["qwen2"])
    edited = _copy_tokenizer_dir(tiny_dir["qwen2"], tmp_path / "edited")
    (edited / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert tokenizer_key(edited) != base
    retyped = _copy_tokenizer_dir(tiny_dir["qwen2"], tmp_path / "retyped")
    config = json.loads((retyped / "config.json").read_text())
    (retyped / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert tokenizer_key(retyped) != base
    resized = _copy_tokenizer_dir(tiny_dir["qwen2"], tmp_path / "resized")
    (resized / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    (resized / "model.safetensors").write_bytes(b"not the tokenizer's")
    assert tokenizer_key(resized) == base


def test_at_most_kept_tokenizers_are_held_and_the_oldest_goes_first(tiny_dir):
    """Loading more distinct tokenizers than KEPT drops the least recently used: loaded again,
    it is a new object; the most recent is still shared."""
    families = ["llama", "qwen2", "qwen3", "phi3", "gemma2", "olmo2"]
    assert len(families) > KEPT and len({tokenizer_key(tiny_dir[f]) for f in families}) == len(families)
    first = load_tokenizer(tiny_dir[families[0]])
    for family in families[1:]:
        last = load_tokenizer(tiny_dir[family])
    assert load_tokenizer(tiny_dir[families[-1]]) is last
    assert load_tokenizer(tiny_dir[families[0]]) is not first


def test_the_vocabulary_fingerprint_is_hashed_once_per_tokenizer(tiny_dir, monkeypatch):
    tokenizer = load_model("t", tiny_dir["qwen3"]).tokenizer
    expected = vocab_fingerprint(tokenizer)
    reads = []
    monkeypatch.setattr(tokenizer, "get_vocab", lambda: reads.append(1) or {})
    assert vocab_fingerprint(tokenizer) == expected and reads == []
    assert load_model("d", tiny_dir["qwen3-draft"]).vocab_fingerprint == expected and reads == []


def _with_config(tiny_dir, tmp_path, edit) -> Path:
    """A copy of the tiny Llama whose config.json ``edit`` rewrites (a dict in, a text out)."""
    path = tmp_path / "model"
    shutil.copytree(tiny_dir["llama"], path)
    config = path / "config.json"
    config.write_text(edit(json.loads(config.read_text())))
    return path


@pytest.mark.parametrize("edit, error, message", [
    (lambda config: "{not json", CheckpointUnreadable,
     "{path}: transformers {version} cannot read its config.json (OSError: It looks like the config file at "
     "'{path}/config.json' is not a valid JSON file.); fix the file, or use the transformers release that wrote it"),
    (lambda config: json.dumps({**config, "model_type": "foo_bar"}), UnsupportedArchitecture,
     "{path}: transformers {version} does not know model type 'foo_bar'; a newer transformers may (pip install -U "
     "transformers), or pick a checkpoint of a supported family"),
    # what transformers 5.17 met in a config 5.0 wrote for OLMo 3 (a RoPE base where it wants a dict)
    (lambda config: json.dumps({**config, "rope_parameters": 10000.0}), CheckpointUnreadable, None),
], ids=["not-json", "unknown-model-type", "another-release-s-shape"])
def test_a_config_transformers_cannot_read_is_one_line_that_says_what_to_do(tiny_dir, tmp_path, edit, error,
                                                                          message):
    import transformers

    path = _with_config(tiny_dir, tmp_path, edit)
    for load in (lambda: load_model("tiny", path), lambda: load_model("tiny", path, weights=False)):
        with pytest.raises(error) as caught:
            load()
        said = str(caught.value)
        assert "\n" not in said and len(said) < 600
        if message is not None:
            assert said == message.format(path=path, version=transformers.__version__)
        else:
            assert said.startswith(f"{path}: transformers {transformers.__version__} cannot read its config.json "
                                   "(StrictDataclassFieldValidationError: Validation error for field 'rope_parameters'")
            assert said.endswith("...); fix the file, or use the transformers release that wrote it")


def test_damaged_weights_a_missing_tokenizer_and_another_model_s_config_are_one_line_each(tiny_dir, tmp_path):
    import safetensors
    import transformers

    cut = tmp_path / "cut"
    shutil.copytree(tiny_dir["llama"], cut)
    weights = cut / "model.safetensors"
    with open(weights, "r+b") as f:  # an interrupted copy
        f.truncate(weights.stat().st_size // 2)
    with pytest.raises(CheckpointUnreadable) as caught:
        load_model("tiny", cut)
    assert str(caught.value) == (
        f"{weights}: safetensors {safetensors.__version__} cannot read its tensors (SafetensorError: Error while "
        "deserializing header: incomplete metadata, file not fully covered); the file is damaged or incomplete: "
        "copy, download or convert it again")

    untokenized = tmp_path / "untokenized"
    shutil.copytree(tiny_dir["llama"], untokenized, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(CheckpointUnreadable) as caught:
        load_model("tiny", untokenized)
    said = str(caught.value)
    assert said.startswith(f"{untokenized}: transformers {transformers.__version__} cannot load its tokenizer "
                           "(ValueError: Couldn't instantiate the backend tokenizer")
    assert said.endswith("); the checkpoint needs its tokenizer files (tokenizer.json; or tokenizer.model with "
                         "sentencepiece installed)") and "\n" not in said

    wider = _with_config(tiny_dir, tmp_path, lambda config: json.dumps({**config, "hidden_size": 128}))
    with pytest.raises(CheckpointUnreadable) as caught:
        load_model("tiny", wider)
    assert str(caught.value).startswith(
        f"checkpoint {wider}: its weights do not fit its config.json: lm_head.weight (320, 64) (the config: "
        "(320, 128)), embed_tokens.weight (320, 64) (the config: (320, 128)), ")
    assert str(caught.value).endswith(" — a config.json of another model beside these weights?")


def test_a_checkpoint_of_pickled_weights_says_how_to_make_safetensors(tiny_dir, tmp_path):
    from specctl.errors import ModelNotFound

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_dir["llama"], pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ModelNotFound) as caught:
        load_model("tiny", pickled)
    assert str(caught.value) == f"no .safetensors weights in {pickled}"
    (pickled / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelNotFound) as caught:
        load_model("tiny", pickled)
    assert str(caught.value) == (
        f"no .safetensors weights in {pickled} (only pytorch_model.bin: specctl reads no pickled weights; save the "
        "model again with transformers' save_pretrained, which writes safetensors)")
