import pytest

from specctl.config import Config, build_config
from specctl.errors import ConfigError


def test_profile_then_flags():
    config = build_config("server", depth=3, target=None)
    assert config.profile == "server" and config.device == "cuda" and config.depth == 3 and config.width == 8


def test_detected_profile_on_cpu(monkeypatch):
    monkeypatch.delenv("SPECCTL_PROFILE", raising=False)
    config = build_config()
    assert config.profile == "desktop" and config.device == "cpu"


def test_every_shipped_profile_is_valid():
    for name in ("desktop", "server", "jetson"):
        assert isinstance(build_config(name), Config)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"depth": 0}, "depth must be an integer in [1, 64], got 0"),
        ({"dtype": "int3"}, "dtype must be one of fp32, bf16, fp16, got 'int3'"),
        ({"mode": "magic"}, "mode must be one of ar, chain, tree, ngram, suffix, multi, got 'magic'"),
        ({"device": "tpu"}, "device must be 'cpu' or 'cuda[:N]', got 'tpu'"),
        ({"attention_backend": "triton"}, "attention_backend must be auto, torch or flashinfer, got 'triton'"),
        ({"draft_quant": "int4"}, "draft_quant must be one of none, int8, got 'int4'"),
        ({"target_quant": "fp8"}, "target_quant must be one of none, int8, got 'fp8'"),
        ({"cuda_graphs": "yes"}, "cuda_graphs must be true or false, got 'yes'"),
        ({"torch_compile": 1}, "torch_compile must be true or false, got 1"),
        ({"mla_cache": "compressed"}, "mla_cache must be latent or expanded, got 'compressed'"),
        ({"suffix_max_spec_factor": 0}, "suffix_max_spec_factor must be a number in (0, 64], got 0"),
        ({"suffix_min_token_prob": 1.5}, "suffix_min_token_prob must be a number in [0, 1], got 1.5"),
        ({"suffix_max_depth": 1}, "suffix_max_depth must be an integer in [2, 4096], got 1"),
        ({"suffix_max_cached": -1}, "suffix_max_cached must be an integer in [0, 1048576], got -1"),
        ({"mode": "multi", "drafters": "ngram, m@2,ngram"}, "drafters names ngram twice: each drafter once"),
    ],
)
def test_bad_values_are_clear_errors(flags, message):
    with pytest.raises(ConfigError) as err:
        build_config("desktop", **flags)
    assert str(err.value) == message


def test_unknown_profile_and_bad_profile_files(tmp_path):
    with pytest.raises(ConfigError, match="unknown profile 'laptop': one of desktop, jetson, server"):
        build_config("laptop")
    bad = tmp_path / "bad.toml"
    bad.write_text("depth = \n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        build_config(str(bad))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("depth = 3\ncolour = 'blue'\n")
    with pytest.raises(ConfigError, match="unknown keys colour"):
        build_config(str(unknown))
    typed = tmp_path / "typed.toml"
    typed.write_text("depth = 'deep'\n")
    with pytest.raises(ConfigError, match="depth must be an integer in \\[1, 64\\], got 'deep'"):
        build_config(str(typed))
