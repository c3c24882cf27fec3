"""llama.cpp's ``samplers`` (gateway.llama_samplers): its names, aliases and letters, the order
they give, what a list that leaves a sampler out turns off, the refusals exactly; /completion
applies llama.cpp's own order (temperature last) and the OpenAI routes take ``samplers`` too."""

import json

import pytest

from specctl.gateway.api import ApiError, CompletionRequest
from specctl.gateway.llama import LlamaCompletionRequest, completion_request
from specctl.gateway.llama_samplers import DEFAULT_SAMPLERS, sampler_chain
from specctl.gateway.translate import sampling_params
from tests.test_gateway import PROMPT, post

LAST = ("top_k", "top_p", "min_p", "temperature")


def test_names_aliases_and_letters_give_the_order_of_the_served_samplers():
    assert sampler_chain(list(DEFAULT_SAMPLERS)).order == LAST
    assert sampler_chain(["Temp", "nucleus", "top-k"]).order == ("temperature", "top_p", "top_k", "min_p")
    chain = sampler_chain("edkypmxt")
    assert (chain.order, chain.names) == (LAST, ("penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                                 "temperature"))
    assert sampler_chain([]).order == ("temperature", "top_k", "top_p", "min_p")  # all off but the order's shape
    assert not sampler_chain(["top_k"]).runs("temperature") and sampler_chain(["top_k"]).runs("top_k")
    # llama.vim's list: the infill sampler accepted (not applied), temperature off
    assert sampler_chain(["top_k", "top_p", "infill"]).order == ("top_k", "top_p", "temperature", "min_p")


@pytest.mark.parametrize("samplers, message", [
    (["top_k", "beam"], "samplers names 'beam', which is not one of llama.cpp's samplers: give penalties, dry, "
                        "top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature (or their letters, e.g. \"kpmt\")"),
    ("kz", "samplers names 'z', which is not one of llama.cpp's samplers: give penalties, dry, top_n_sigma, top_k, "
           "typ_p, top_p, min_p, xtc, temperature (or their letters, e.g. \"kpmt\")"),
    (["top_k", "top-k"], "samplers lists top_k twice: give each sampler once"),
    (["top_p", "penalties"], "samplers puts penalties after top_p: specctl applies the penalties (and logit_bias) "
                             "before the other samplers; list penalties first"),
])
def test_bad_sampler_lists_are_400s_saying_what_to_give(samplers, message):
    with pytest.raises(ApiError) as refused:
        sampler_chain(samplers)
    assert (refused.value.status, str(refused.value), refused.value.param) == (400, message, "samplers")


def test_completion_applies_temperature_last_and_a_sampler_left_out_is_off():
    def params(**options):
        req = completion_request(LlamaCompletionRequest(prompt="x", seed=3, **options), [[1, 2]], 64)
        return sampling_params(req, 2, 64, 16)

    served = params(repeat_penalty=1.3)
    assert (served.sampler_order, served.temperature, served.top_k, served.top_p, served.min_p,
            served.repetition_penalty) == (LAST, 0.8, 40, 0.95, 0.05, 1.3)
    bare = params(repeat_penalty=1.3, samplers=["top_p"])  # llama.cpp: only top-p runs, unscaled, no penalties
    assert (bare.sampler_order, bare.temperature, bare.top_k, bare.top_p, bare.min_p, bare.repetition_penalty) == (
        ("top_p", "temperature", "top_k", "min_p"), 1.0, 0, 0.95, 0.0, 1.0)
    assert params(temperature=0, samplers="k").greedy  # 0 stays greedy without the temperature sampler
    # the OpenAI routes: vLLM's order unless samplers is given
    assert sampling_params(CompletionRequest(prompt="x", temperature=0.5), 2, 64, 16).sampler_order == ()
    assert sampling_params(CompletionRequest(prompt="x", temperature=0.5, samplers="kpmt"), 2, 64, 16
                           ).sampler_order == LAST


def test_completion_samples_in_llama_cpp_s_order_as_completions_do_when_asked(cluster):
    """A seeded /completion (llama.cpp's defaults, temperature last) gives the text
    /v1/completions gives with the same options and llama.cpp's samplers; the settings and /props
    list the samplers."""
    url = cluster[1]["gateway"]
    options = {"temperature": 0.9, "top_k": 40, "top_p": 0.6, "min_p": 0.05, "seed": 0}
    status, _, body = post(url + "/completion", {"prompt": PROMPT, "n_predict": 12, **options})
    llama = json.loads(body)
    assert status == 200 and llama["generation_settings"]["samplers"] == list(DEFAULT_SAMPLERS)
    openai = json.loads(post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "samplers": "kpmt",
                                                       **options})[2])["choices"][0]["text"]
    assert llama["content"] == openai
    vllm_order = json.loads(post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, **options})[2])
    assert vllm_order["choices"][0]["text"] != openai  # the order bites: top-p reads another distribution
    status, _, body = post(url + "/completion", {"prompt": PROMPT, "samplers": ["top_k", "beam"]})
    assert status == 400 and json.loads(body)["error"]["param"] == "samplers"
    import urllib.request

    with urllib.request.urlopen(url + "/props", timeout=30) as response:
        assert json.loads(response.read())["default_generation_settings"]["params"]["samplers"] == list(
            DEFAULT_SAMPLERS)
