"""One slotted, self-validating Config, loaded from a hardware profile with flags on top.

Profiles live in ``profiles/NAME.toml`` (flat keys named like the fields below). Order of
precedence: flags > ``--profile NAME`` > the detected profile (server with CUDA, jetson on
an aarch64 CUDA box, desktop otherwise)."""

from __future__ import annotations

import dataclasses
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from specctl.errors import ConfigError

PROFILE_DIRS = (Path(__file__).resolve().parent.parent / "profiles", Path(__file__).resolve().parent / "profiles")
MODES = ("ar", "chain", "tree", "ngram", "suffix", "multi")
LOOKUP_DRAFTERS = ("ngram", "suffix")  # drafters without a model: they run where the target does
DTYPES = ("fp32", "bf16", "fp16")
QUANTS = ("none", "int8")


def repeated(names: list) -> Any:
    """The first item that comes twice in ``names`` (None: each once)."""
    seen = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


@dataclass(slots=True)
class Config:
    device: str = "cpu"
    dtype: str = "bf16"
    attention_backend: str = "auto"
    cuda_graphs: bool = True  # on CUDA: steps of <= 64 tokens padded to a bucket and replayed as CUDA graphs
    torch_compile: bool = True  # on CUDA with cuda_graphs: those steps' layers through torch.compile (fused kernels)
    # CPU targets in bf16/fp16/int8: verification and prefill rows attend as AR decode steps do,
    # and linear products are padded or blocked as the load-time probe finds (engine.rows), so
    # speculative output is bit-identical to AR and a restored prefix to a fresh prefill
    # (specctl_kernels.row_exact); false: one call a forward and plain products, a little faster
    # (a 512-token prefill ~1.9x faster on an AMX Xeon)
    row_exact_attention: bool = True
    # CPU models in bf16: linear weights reordered once at load for oneDNN (engine.packed; an AR
    # step ~20 % faster on an AMX Xeon); false: plain F.linear, which reorders them every call
    packed_weights: bool = True
    # CPU models of Llama's layer shape: one-token steps as straight-line code (engine.decode_step;
    # the same bits, a 0.5B int8 draft step ~6 % faster); false: every step through the modules
    decode_step: bool = True
    threads: int = 0  # 0 = torch's default
    kv_budget_mb: int = 4096
    # finished sessions' KV kept for new prompts that start the same way (a chat's next turn, a
    # shared system prompt): vLLM's and SGLang's automatic prefix caching, by copy; 0 = off;
    # -1 = auto: 1024 MiB for drafts and fp32 targets, off for a bf16/fp16 target (a restored
    # prefix differs from a fresh prefill by bf16 rounding, which changes some greedy outputs)
    prefix_cache_mb: int = -1
    # a target's prompt prefill runs in chunks of this many tokens, each a compute job of its own,
    # so other sessions' rounds run between them (vLLM's chunked prefill); 0 = whole; -1 = auto:
    # 2048 on CUDA, 512 on the CPU. Every session of the model chunks the same way (outputs agree)
    prefill_chunk: int = -1
    # DeepSeek-V2/V3's multi-head latent attention: "latent" caches each token's compressed latent
    # and rotated key (576 values a layer, vLLM's MLA; attention absorbs kv_b_proj), "expanded" its
    # keys and values per head (85x the bytes for V3) with transformers' rounding to the bit
    mla_cache: str = "latent"
    max_sessions: int = 64
    # a target instance speculates while it runs at most this many sessions; past it, its rounds
    # verify the root alone (plain decoding) until the load falls (vLLM's
    # speculative_disable_by_batch_size; spec.turns); 0 = always speculate
    spec_max_sessions: int = 0
    # at most this deep a proposal while the instance runs that many sessions or more, as
    # SESSIONS:DEPTH pairs ("4:4,6:2"; SmartSpec's shorter proposals in larger batches; chain
    # and tree drafts); "auto" = learnt per load from the instance's own rounds (depths and plain
    # rounds, spec.depth_tuning); "" = the drafter's depth at any load
    spec_depth_by_load: str = ""
    mode: str = "tree"
    depth: int = 4
    topk: int = 3
    width: int = 4
    max_batch: int = 8
    prespec_budget: int = 0
    draft_stop: float = 0.0  # adaptive depth: stop drafting below this draft probability of the path (0 = off)
    draft_quant: str = "none"  # none | int8 (CPU): a quantized draft is still lossless
    target_quant: str = "none"  # none | int8 (CPU): the int8 model is then the target whose output is reproduced
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    drafters: str = ""  # mode multi: comma-separated drafters (model names, NAME@N, ngram, suffix), routed and fused
    # suffix decoding (spec.suffix; vLLM's suffix_decoding_* options): a proposal holds at most
    # min(depth, match length x max_spec_factor) nodes, none under min_token_prob; matches are
    # measured up to max_depth tokens; the outputs of the last max_cached requests are remembered
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_max_depth: int = 64
    suffix_max_cached: int = 1000
    profile: str = "desktop"

    def __post_init__(self) -> None:
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ConfigError(f"attention_backend must be auto, torch or flashinfer, got {self.attention_backend!r}")
        if self.mla_cache not in ("latent", "expanded"):
            raise ConfigError(f"mla_cache must be latent or expanded, got {self.mla_cache!r}")
        for name in ("cuda_graphs", "torch_compile", "row_exact_attention", "packed_weights", "decode_step"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("draft_quant", "target_quant"):
            if getattr(self, name) not in QUANTS:
                raise ConfigError(f"{name} must be one of {', '.join(QUANTS)}, got {getattr(self, name)!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "multi" and not self.drafter_names:
            raise ConfigError("mode multi needs drafters, e.g. --drafters qwen2.5-coder-0.5b,ngram")
        if (twice := repeated(self.drafter_names)) is not None:
            raise ConfigError(f"drafters names {twice} twice: each drafter once")
        if not isinstance(self.draft_stop, (int, float)) or isinstance(self.draft_stop, bool) or not 0.0 <= self.draft_stop < 1.0:
            raise ConfigError(f"draft_stop must be a number in [0, 1), got {self.draft_stop!r}")
        self.depth_schedule  # noqa: B018 - checked here: a bad value is a ConfigError at start
        for name, low, high in (("suffix_max_spec_factor", 0.0, 64.0), ("suffix_min_token_prob", 0.0, 1.0)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high \
                    or (name == "suffix_max_spec_factor" and value == 0):
                bounds = "(0, 64]" if name == "suffix_max_spec_factor" else "[0, 1]"
                raise ConfigError(f"{name} must be a number in {bounds}, got {value!r}")
        for name, low, high in (
            ("threads", 0, 1024), ("kv_budget_mb", 1, 1 << 24), ("prefix_cache_mb", -1, 1 << 24), ("prefill_chunk", -1, 1 << 24), ("max_sessions", 1, 1 << 20),
            ("spec_max_sessions", 0, 1 << 20),
            ("depth", 1, 64), ("topk", 1, 64), ("width", 1, 256), ("max_batch", 1, 4096), ("prespec_budget", 0, 4096),
            ("suffix_max_depth", 2, 4096), ("suffix_max_cached", 0, 1 << 20),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")

    @property
    def depth_schedule(self) -> tuple[tuple[int, int], ...]:
        """spec_depth_by_load as (sessions, depth) pairs, sessions ascending (none for "auto")."""
        return () if self.depth_auto else parse_depth_schedule(self.spec_depth_by_load)

    @property
    def load_plan(self) -> dict[str, Any]:
        """A target instance's options for planning rounds by its load (verify.server.TargetServerConfig)."""
        return {"spec_max_sessions": self.spec_max_sessions, "spec_depth_by_load": self.depth_schedule,
                "spec_depth_auto": self.depth_auto}

    @property
    def depth_auto(self) -> bool:
        """spec_depth_by_load is "auto": each load's depth learnt from the instance's rounds."""
        return str(self.spec_depth_by_load).strip() == AUTO_DEPTH

    @property
    def drafter_names(self) -> list[str]:
        return [name.strip() for name in str(self.drafters).split(",") if name.strip()]

    @property
    def kv_budget_bytes(self) -> int:
        return self.kv_budget_mb << 20

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


AUTO_DEPTH = "auto"


def parse_depth_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """"4:4,6:2" -> ((4, 4), (6, 2)); ConfigError unless SESSIONS:DEPTH pairs of positive
    integers with the sessions ascending."""
    pairs = []
    try:
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            sessions, depth = (int(x) for x in part.split(":"))
            pairs.append((sessions, depth))
        ok = all(s >= 1 and 1 <= d <= 64 for s, d in pairs) and all(a[0] < b[0] for a, b in zip(pairs, pairs[1:]))
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"spec_depth_by_load must be SESSIONS:DEPTH pairs (depth 1-64), the sessions ascending, "
                          f"e.g. 4:4,6:2, or auto; got {text!r}")
    return tuple(pairs)


def detect_profile() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return "jetson" if platform.machine() == "aarch64" else "server"
    except ImportError:  # pragma: no cover
        pass
    return "desktop"


def profile_path(name: str) -> Path:
    candidate = Path(name)
    if candidate.suffix == ".toml" and candidate.is_file():
        return candidate
    for directory in PROFILE_DIRS:
        path = directory / f"{name}.toml"
        if path.is_file():
            return path
    known = sorted({p.stem for d in PROFILE_DIRS if d.is_dir() for p in d.glob("*.toml")})
    raise ConfigError(f"unknown profile {name!r}: one of {', '.join(known)} or a path to a .toml file")


def load_profile(name: str) -> dict[str, Any]:
    path = profile_path(name)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"profile {path} is not valid TOML: {exc}") from None
    fields = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"profile {path}: unknown keys {', '.join(unknown)} (known: {', '.join(sorted(fields))})")
    return data


def build_config(profile: str | None = None, **flags: Any) -> Config:
    """Profile values, then every flag that was given (None = not given)."""
    name = profile or os.environ.get("SPECCTL_PROFILE") or detect_profile()
    values = load_profile(name)
    values["profile"] = name
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        return Config(**values)
    except TypeError as exc:
        raise ConfigError(f"bad configuration: {exc}") from None
