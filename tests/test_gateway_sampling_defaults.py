"""vLLM's --generation-config (gateway.sampling_defaults): what a request leaves out takes the
model creator's recommendation from generation_config.json (auto), OpenAI's defaults (vllm) or
a folder's file; a request's own values win."""

import json
import shutil

import pytest

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config
from specctl.gateway.sampling_defaults import describe, sampling_defaults
from tests.test_gateway import post

RECOMMENDED = {"temperature": 0.0, "repetition_penalty": 1.5, "top_k": 7, "max_new_tokens": 6, "do_sample": True}


def _with_generation_config(source, folder, fields: dict):
    shutil.copytree(source, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **fields}))
    return folder


def test_the_recommendation_is_read_from_the_generation_config(tiny_dir, tmp_path):
    model = _with_generation_config(tiny_dir["llama"], tmp_path / "m", RECOMMENDED)
    wanted = {"temperature": 0.0, "repetition_penalty": 1.5, "top_k": 7, "max_tokens": 6}  # do_sample is not one
    assert sampling_defaults(model) == wanted
    assert sampling_defaults(model, "vllm") == {}
    assert sampling_defaults(tiny_dir["llama"]) == {}  # a config with no sampling in it
    assert sampling_defaults(tiny_dir["qwen2"], str(model)) == wanted  # another folder's file
    with pytest.raises(ValueError, match=r"^--generation-config must be auto, vllm or a folder holding "
                                         r"generation_config.json; '/nowhere' holds none$"):
        sampling_defaults(model, "/nowhere")
    assert describe({"temperature": 0.6, "top_k": 20}) == (
        "default sampling from the model's generation config: temperature=0.6, top_k=20 (a request's own values win; "
        "--generation-config vllm keeps OpenAI's defaults)")


@pytest.fixture(scope="module")
def recommended_clusters(tiny_dir, tmp_path_factory):
    """The tiny model with a recommendation behind two gateways: auto and vllm."""
    model = _with_generation_config(tiny_dir["llama"], tmp_path_factory.mktemp("recommended") / "m", RECOMMENDED)
    config = build_config(None, target=str(model), draft=f"{model}@2", mode="chain", depth=3, dtype="fp32",
                          draft_quant="none", max_sessions=4)
    threads = [ClusterThread(config, ClusterConfig(targets=1, gateway_port=0, generation_config=source))
               for source in ("auto", "vllm")]
    urls = [thread.start()["gateway"] for thread in threads]
    yield urls
    for thread in threads:
        thread.stop()


def _text(base: str, body: dict) -> tuple[str, int]:
    code, _, raw = post(base + "/v1/completions", {"prompt": "hello world", **body})
    assert code == 200, raw
    choice = json.loads(raw)
    return choice["choices"][0]["text"], choice["usage"]["completion_tokens"]


def test_a_request_that_leaves_sampling_out_gets_the_recommendation_and_its_own_values_win(recommended_clusters):
    auto, vllm = recommended_clusters
    explicit = {"temperature": 0, "repetition_penalty": 1.5, "top_k": 7, "max_tokens": 6}
    recommended = _text(auto, {})
    assert recommended == _text(vllm, explicit) and recommended[1] == 6  # greedy, penalised, 6 tokens
    assert _text(auto, {"repetition_penalty": 1.0, "max_tokens": 9}) == _text(vllm, {**explicit, "max_tokens": 9,
                                                                                      "repetition_penalty": 1.0})
    seeded = {"temperature": 1.0, "seed": 3, "max_tokens": 12}  # vllm: OpenAI's defaults, nothing recommended
    assert _text(vllm, seeded) == _text(auto, {**seeded, "repetition_penalty": 1.0, "top_k": 0})
    code, _, raw = post(auto + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert code == 200 and json.loads(raw)["usage"]["completion_tokens"] <= 6  # chat's default max_tokens too


def test_a_bad_generation_config_is_refused_before_anything_starts():
    from tests.conftest import run_here
    from tests.test_cli import _assert_one_line_error

    with pytest.raises(ValueError, match="--generation-config must be auto, vllm or a folder"):
        ClusterConfig(generation_config="/nowhere")
    _assert_one_line_error(run_here("gateway", "--target", "127.0.0.1:1", "--generation-config", "/nowhere"),
                           "--generation-config must be auto, vllm or a folder holding generation_config.json")
