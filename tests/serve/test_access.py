"""Access control: a server started with an API key answers only requests that carry ``Authorization: Bearer KEY``
(401 in OpenAI's error shape otherwise), keeps ``/health`` open and ``/metrics`` open unless told; the openai client
and ``draftwise loadtest`` pass the key; the command line takes it from a flag, a file or vLLM's environment
variable and warns when a server without one binds beyond loopback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from servers import MODEL, RunningServer
from tiny import ChatCharTokenizer, make_tiny_model, planned

from draftwise import cli
from draftwise.serve import ServingEngine
from draftwise.serve.access import API_KEY_VARIABLE, exposure_warning
from draftwise.serve.load import sweep

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return planned(make_tiny_model("qwen2", seed=0), tmp_path_factory.mktemp("machine"))


@pytest.fixture(scope="module", params=[False, True], ids=["metrics-open", "metrics-protected"])
def server(request, target):
    running = RunningServer(ServingEngine(target, ChatCharTokenizer(), "pld", max_batch=4), api_key=KEY,
                            protect_metrics=request.param)
    running.protect_metrics = request.param
    yield running
    running.stop()


def _call(server: RunningServer, path: str, key: str | None = None,
          body: dict | None = None) -> tuple[int, dict | str, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(server.base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
            status, answer_headers = response.status, dict(response.headers)
    except urllib.error.HTTPError as error:
        text = error.read().decode()
        status, answer_headers = error.code, dict(error.headers)
    try:
        return status, json.loads(text), answer_headers
    except json.JSONDecodeError:
        return status, text, answer_headers


BODY = {"model": MODEL, "messages": [{"role": "user", "content": "\u0105\u0106\u0105\u0106"}], "max_tokens": 4}


@pytest.mark.parametrize("key", [None, "sk-wrong", KEY[:-1], KEY + "0", ""], ids=["none", "wrong", "short", "long",
                                                                                     "empty"])
def test_a_request_without_the_key_is_refused_in_openais_shape(server, key):
    for path, body in (("/v1/chat/completions", BODY), ("/v1/models", None), ("/v1/completions",
                                                                            {"model": MODEL, "prompt": "x"})):
        status, answer, headers = _call(server, path, key, body)
        assert status == 401, (path, answer)
        assert answer["error"]["code"] == "invalid_api_key" and answer["error"]["type"] == "invalid_request_error"
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert headers.get("www-authenticate", headers.get("WWW-Authenticate")) == "Bearer"


def test_the_key_opens_every_route_and_health_stays_open(server):
    assert _call(server, "/health")[0] == 200
    status, answer, _ = _call(server, "/v1/chat/completions", KEY, BODY)
    assert status == 200 and answer["choices"][0]["message"]["content"]
    metrics_status = _call(server, "/metrics")[0]
    assert metrics_status == (401 if server.protect_metrics else 200)
    assert _call(server, "/metrics", KEY)[0] == 200


def test_the_openai_client_with_and_without_the_key(server):
    answer = server.client.chat.completions.create(model=MODEL, messages=BODY["messages"], max_tokens=4)
    assert answer.choices[0].message.content
    streamed = server.client.chat.completions.create(model=MODEL, messages=BODY["messages"], max_tokens=4,
                                                     stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    stranger = openai.OpenAI(base_url=server.base + "/v1", api_key="sk-someone-else", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        stranger.chat.completions.create(model=MODEL, messages=BODY["messages"], max_tokens=4)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


def test_the_load_test_passes_the_key(server):
    (report,) = sweep(server.base + "/v1", MODEL, ["\u0105\u0106\u0105\u0106\u0105"], [2], 4, requests=4, warmup=0,
                      api_key=KEY)
    assert not report.errors and len(report.records) == 4
    assert report.speculation is not None, "the counters were read from /metrics with the key"
    (refused,) = sweep(server.base + "/v1", MODEL, ["\u0105\u0106"], [1], 4, requests=1, warmup=0)
    assert len(refused.errors) == 1 and "AuthenticationError" in refused.errors[0]


def test_the_command_line_reads_the_key_from_a_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    from draftwise.cli.serve import api_key_of

    parser = cli.build_parser()

    def key_of(*arguments: str) -> str | None:
        return api_key_of(parser.parse_args(["serve", *arguments]))

    monkeypatch.delenv(API_KEY_VARIABLE, raising=False)
    assert key_of() is None
    assert key_of("--api-key", KEY) == KEY
    path = tmp_path / "key.txt"
    path.write_text(f"{KEY}\n")
    assert key_of("--api-key-file", str(path)) == KEY
    monkeypatch.setenv(API_KEY_VARIABLE, "sk-from-the-environment")
    assert key_of() == "sk-from-the-environment" and key_of("--api-key", KEY) == KEY


@pytest.mark.parametrize("arguments, message", [
    (["--api-key", "k", "--api-key-file", "f"], "not both"),
    (["--api-key", " "], "empty"),
    (["--protect-metrics"], "--protect-metrics"),
])
def test_the_command_line_refuses_a_bad_key(capsys, monkeypatch, arguments, message):
    monkeypatch.delenv(API_KEY_VARIABLE, raising=False)
    assert cli.main(["serve", "--method", "pld", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_key_file_is_named(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    for path in (empty, tmp_path / "missing.txt"):
        assert cli.main(["serve", "--api-key-file", str(path)]) == 2
        assert str(path) in capsys.readouterr().err


def test_a_server_open_beyond_loopback_without_a_key_is_warned_of():
    assert exposure_warning("0.0.0.0", None) and "without an API key" in exposure_warning("0.0.0.0", None)
    assert exposure_warning("10.1.2.3", None)
    assert exposure_warning("0.0.0.0", KEY) is None
    for host in ("127.0.0.1", "localhost", "::1", "127.0.1.1"):
        assert exposure_warning(host, None) is None
