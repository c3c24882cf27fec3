"""A request's id (gateway.request_id): taken from X-Request-Id or the body's request_id as vLLM
takes it, naming the answer, sent with each generation to the target instance, and echoed in
the X-Request-Id header when --enable-request-id-headers asks."""

import json
import re

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from specctl.gateway.api import ApiError
from specctl.gateway.request_id import KEY, add_header, request_id
from specctl.spec.params import SamplingParams
from specctl.verify.server import TargetServer
from tests.test_gateway import PROMPT, _http


def test_the_header_wins_then_the_body_then_a_fresh_id():
    assert request_id(make_mocked_request("POST", "/", headers={"X-Request-Id": "trace-1"}), "body-1") == "trace-1"
    assert request_id(make_mocked_request("POST", "/"), "body-1") == "body-1"
    fresh = [request_id(make_mocked_request("POST", "/")) for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", rid) for rid in fresh) and fresh[0] != fresh[1]
    request = make_mocked_request("POST", "/", headers={"X-Request-Id": "trace-1"})
    request_id(request)
    assert request[KEY] == "trace-1"  # kept for the answer's header


@pytest.mark.parametrize("body_id, param", [("", "request_id"), ("a b", "request_id"), ("x" * 257, "request_id"),
                                            ("caf\u00e9", "request_id")])
def test_an_id_that_cannot_go_in_a_header_or_a_log_line_is_a_400(body_id, param):
    with pytest.raises(ApiError) as caught:
        request_id(make_mocked_request("POST", "/"), body_id)
    assert caught.value.status == 400 and caught.value.param == param
    assert str(caught.value) == "request_id must be 1-256 printable ASCII characters without spaces"
    with pytest.raises(ApiError, match="^X-Request-Id must be 1-256"):
        request_id(make_mocked_request("POST", "/", headers={"X-Request-Id": "a b"}), "fine")


def test_the_answer_header_is_the_requests_id_else_the_clients_else_fresh():
    request = make_mocked_request("POST", "/", headers={"X-Request-Id": "given"})
    request[KEY] = "used"
    response = web.Response()
    add_header(request, response)
    assert response.headers["X-Request-Id"] == "used"
    response = web.Response()
    add_header(make_mocked_request("GET", "/", headers={"X-Request-Id": "given"}), response)
    assert response.headers["X-Request-Id"] == "given"
    response = web.Response()
    add_header(make_mocked_request("GET", "/"), response)
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["X-Request-Id"])


def test_the_id_names_the_answer_reaches_the_target_and_comes_back_when_asked(cluster, monkeypatch):
    base, config = cluster[1]["gateway"], cluster[0].cluster.gateway.config
    seen: list[str] = []
    create = TargetServer._create

    async def recording(self, msg, send):  # the real method, the id it was sent noted on the way
        seen.append(msg.request_id)
        return await create(self, msg, send)

    monkeypatch.setattr(TargetServer, "_create", recording)
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    code, headers, raw = _http("POST", base + "/v1/completions", {"X-Request-Id": "trace-7"}, body)
    assert code == 200 and json.loads(raw)["id"] == "cmpl-trace-7"
    assert "X-Request-Id" not in headers  # not asked for: vLLM's default
    assert seen == ["trace-7"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2, "request_id": "mine"}
    code, _, raw = _http("POST", base + "/v1/chat/completions", {}, chat)
    assert code == 200 and json.loads(raw)["id"] == "chatcmpl-mine"
    assert sorted(seen[1:]) == ["mine-0", "mine-1"]  # a choice each
    longest = "x" * 256  # with its choices' "-<index>" still a valid GENERATE for the target
    code, _, raw = _http("POST", base + "/v1/chat/completions", {"X-Request-Id": longest}, chat)
    assert code == 200 and json.loads(raw)["id"] == "chatcmpl-" + longest and sorted(seen[3:]) == [
        longest + "-0", longest + "-1"]
    code, _, raw = _http("POST", base + "/v1/chat/completions", {}, {**chat, "stream": True, "n": 1})
    ids = {json.loads(line[6:])["id"] for line in raw.split(b"\n") if line.startswith(b"data: {")}
    assert ids == {"chatcmpl-mine"}
    config.request_id_headers = True  # as --enable-request-id-headers sets it
    try:
        code, headers, raw = _http("POST", base + "/v1/completions", {"X-Request-Id": "trace-8"}, body)
        assert code == 200 and headers["X-Request-Id"] == "trace-8" and json.loads(raw)["id"] == "cmpl-trace-8"
        code, headers, raw = _http("POST", base + "/v1/completions", {}, body)
        assert json.loads(raw)["id"] == "cmpl-" + headers["X-Request-Id"]  # one fresh id for both
        code, headers, raw = _http("POST", base + "/v1/completions", {"X-Request-Id": "trace-9"}, {})
        assert code == 400 and headers["X-Request-Id"] == "trace-9"  # errors too
        code, headers, _ = _http("GET", base + "/v1/models", {})
        assert code == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"])
        code, headers, raw = _http("POST", base + "/v1/completions", {}, {**body, "request_id": "a b"})
        assert code == 400 and json.loads(raw)["error"]["param"] == "request_id"
    finally:
        config.request_id_headers = False


def test_log_requests_writes_a_line_when_a_request_is_taken_and_one_when_it_ends(cluster, caplog):
    from specctl.gateway import request_log

    base, config = cluster[1]["gateway"], cluster[0].cluster.gateway.config
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2, "seed": 5}
    with caplog.at_level("INFO", logger="specctl.gateway.requests"):
        _http("POST", base + "/v1/completions", {"X-Request-Id": "quiet"}, body)
        assert [r for r in caplog.records if "quiet" in r.getMessage()] == []  # off by default (vLLM's too)
        config.log_requests = True  # as --enable-log-requests sets it
        try:
            code, _, _ = _http("POST", base + "/v1/completions", {"X-Request-Id": "trace-log"}, body)
            _http("POST", base + "/v1/completions", {"X-Request-Id": "trace-bad"}, {**body, "max_tokens": 0})
        finally:
            config.log_requests = False
    lines = [r.getMessage() for r in caplog.records if r.name == "specctl.gateway.requests"]
    prompt_tokens = len(json.loads(_http("POST", base + "/tokenize", {}, {"prompt": PROMPT})[2])["tokens"])
    assert code == 200 and lines[0] == (f"request trace-log received (completions): {prompt_tokens} prompt tokens, n=2, "
                                        "stream=False, temperature=0.0, max_tokens=3, seed=5, ignore_eos=True")
    assert re.fullmatch(r"request trace-log finished \(completions\): ok, 6 completion tokens, [0-9.]+ s", lines[1])
    assert re.fullmatch(r"request trace-bad finished \(completions\): 400, 0 completion tokens, [0-9.]+ s", lines[2])
    assert len(lines) == 3
    long_grammar = request_log.asked(SamplingParams(structured=("regex", "a" * 200)))
    assert long_grammar == ("temperature=0.0, max_tokens=128, structured="
                            + repr(("regex", "a" * 200))[:request_log.LONGEST_VALUE] + "...")
