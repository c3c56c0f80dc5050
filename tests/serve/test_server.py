"""The OpenAI-compatible server, driven with the official ``openai`` client over loopback: answers equal
``draftwise.generate``, streams carry one token per event and join to the same text, bad requests get a 4xx with a
message, disconnects free their slot, a full queue answers 503, and a bounded load test of 64 concurrent streaming
clients finishes without errors, each client with its own text."""

from __future__ import annotations

import asyncio
import json
import random
import resource
import socket
import threading
import time

import openai
import pytest
import torch
from servers import MODEL, RunningServer
from tiny import ChatCharTokenizer, make_tiny_model, repetitive_prompt

import draftwise
from draftwise.backend.calibration.invariance import plan_rows
from draftwise.backend.calibration.machine import MeasurementStore
from draftwise.backend.forward.lean import LeanTarget
from draftwise.backend.rows import RowBlock
from draftwise.decoding.drafter import NoDrafter
from draftwise.decoding.engine import Decoder
from draftwise.decoding.logprobs import token_logprobs
from draftwise.decoding.sampling import SamplingParams
from draftwise.errors import UnsupportedOptionError
from draftwise.serve import ServerBusyError, ServingEngine
from draftwise.serve.engine import on_passing_thread
from draftwise.serve.load import RequestRecord, read_results, run_load, speculation_between, sweep


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = make_tiny_model("qwen2", seed=0)
    lean = LeanTarget(model)
    plan_rows(lean, MeasurementStore(tmp_path_factory.mktemp("machine")))
    return lean


@pytest.fixture(scope="module")
def server(target):
    running = RunningServer(ServingEngine(target, ChatCharTokenizer(), "pld", max_batch=8))
    yield running
    running.stop()


def text_prompt(seed: int, low: int = 10, high: int = 40) -> str:
    return "".join(chr(0x100 + token) for token in repetitive_prompt(random.Random(seed), low=low, high=high))


def test_models_and_health(server):
    models = server.client.models.list()
    assert [model.id for model in models.data] == [MODEL]
    status, body = server.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_completion_equals_generate(target, method):
    running = RunningServer(ServingEngine(target, ChatCharTokenizer(), method))
    try:
        for seed in range(3):
            prompt = text_prompt(seed)
            expected = draftwise.generate(target, ChatCharTokenizer(), prompt, method=method, max_new_tokens=30)
            answer = running.client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
            assert answer.choices[0].text == expected.text
            assert answer.usage.completion_tokens == len(expected.token_ids)
            assert answer.usage.prompt_tokens == len(expected.prompt_ids)
            assert answer.choices[0].finish_reason == "length"
            stats = answer.model_extra["draftwise"]
            # Steps depend on draft sizes, which follow the measured forward times: not compared.
            assert stats["method"] == method and 0 < stats["steps"] <= len(expected.token_ids)
    finally:
        running.stop()


def test_chat_completion_and_token_prompt_equal_generate(server, target):
    messages = [{"role": "system", "content": "ĀāĂ"}, {"role": "user", "content": text_prompt(5)}]
    expected = draftwise.generate(target, ChatCharTokenizer(), messages, method="pld", max_new_tokens=20)
    answer = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert answer.choices[0].message.content == expected.text
    assert answer.choices[0].message.role == "assistant"
    by_ids = server.client.completions.create(model=MODEL, prompt=expected.prompt_ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_stream_one_token_per_event_joins_to_the_text(server, target):
    prompt = text_prompt(7)
    expected = draftwise.generate(target, ChatCharTokenizer(), prompt, method="pld", max_new_tokens=40)
    assert expected.stats.mean_accepted_tokens > 1  # multi-token steps happen
    chunks = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    token_chunks = [chunk for chunk in chunks if chunk.choices]
    assert len(token_chunks) == len(expected.token_ids)
    assert "".join(chunk.choices[0].text for chunk in token_chunks) == expected.text
    assert [chunk.choices[0].finish_reason for chunk in token_chunks][-2:] == [None, "length"]
    usage = chunks[-1]
    assert not usage.choices and usage.usage.completion_tokens == len(expected.token_ids)
    assert usage.model_extra["draftwise"]["mean_accepted_tokens"] > 1

    messages = [{"role": "user", "content": prompt}]
    expected_chat = draftwise.generate(target, ChatCharTokenizer(), messages, method="pld", max_new_tokens=40)
    chat_chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                                             temperature=0, stream=True))
    assert len(chat_chunks) == len(expected_chat.token_ids)
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content for chunk in chat_chunks) == expected_chat.text


def test_vllm_request_extensions(server, target):
    """What vLLM's clients and load tools send: usage in every chunk, no model name, stop token ids, the stop string
    kept in the output."""
    prompt = text_prompt(11)
    plain = draftwise.generate(target, ChatCharTokenizer(), prompt, method="ar", max_new_tokens=30)
    chunks = list(server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    token_chunks = [chunk for chunk in chunks if chunk.choices]
    assert [chunk.usage.completion_tokens for chunk in token_chunks] == list(range(1, 31))
    assert all(chunk.usage.prompt_tokens == len(plain.prompt_ids) for chunk in token_chunks)
    assert "".join(chunk.choices[0].text for chunk in token_chunks) == plain.text
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 30

    status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0})
    assert status == 200 and body["model"] == MODEL and body["choices"][0]["text"] == plain.text

    stop_token = plain.token_ids[12]
    first = plain.token_ids.index(stop_token)
    for ignore_eos in (False, True):
        status, body = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 30,
                                                        "temperature": 0, "stop_token_ids": [stop_token],
                                                        "ignore_eos": ignore_eos})
        assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == first + 1  # the stop token is kept, as in vLLM
        assert body["choices"][0]["text"] == ChatCharTokenizer().decode(plain.token_ids[: first + 1])

    stop = plain.text[10:12]
    cut = plain.text.index(stop)
    kept = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stop,
                                            extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == plain.text[: cut + len(stop)] and kept.choices[0].finish_reason == "stop"
    streamed = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stop,
                                                stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == plain.text[: cut + len(stop)]

    echoed = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.text
    by_ids = server.client.completions.create(model=MODEL, prompt=plain.prompt_ids, max_tokens=30, temperature=0,
                                              echo=True)
    assert by_ids.choices[0].text == prompt + plain.text
    streamed = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                                     echo=True, stream=True))
    assert streamed[0].choices[0].text == prompt and len(streamed) == 31
    assert "".join(chunk.choices[0].text for chunk in streamed) == prompt + plain.text
    status, body = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                                         "echo": True})
    assert status == 400 and "'echo'" in body["error"]["message"]


def plain_logprobs(target, prompt_ids: list[int], max_new_tokens: int, top: int, **sampling) -> list:
    """Each token's log-probability in plain one-row decoding (``ar``), straight from the decoder."""
    decoder = Decoder(target)
    state = decoder.start(prompt_ids, NoDrafter(), max_new_tokens=max_new_tokens, logprobs=top,
                          sampling=SamplingParams(**sampling))
    decoder.prefill([state])
    while not state.finished:
        decoder.step([state])
    return state.token_logprobs


def test_logprobs_are_plain_decodings(server, target):
    """Log-probabilities through a speculative server (pld) are plain decoding's, bit for bit, on chat and
    completions, streamed or not, greedy and sampled; the chosen token leads the alternatives under greedy."""
    tokenizer = ChatCharTokenizer()
    prompt = text_prompt(21, low=30, high=40)
    plain = draftwise.generate(target, tokenizer, prompt, method="ar", max_new_tokens=20)
    expected = plain_logprobs(target, plain.prompt_ids, 20, 3)
    assert [entry.token for entry in expected] == plain.token_ids
    assert all(entry.top[0][0] == entry.token and entry.top[0][1] == entry.logprob for entry in expected)
    text = tokenizer.decode

    answer = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=3)
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].text == plain.text
    assert logprobs.tokens == [text([entry.token]) for entry in expected]
    assert logprobs.token_logprobs == [entry.logprob for entry in expected]
    assert logprobs.top_logprobs == [{text([token]): value for token, value in entry.top} for entry in expected]
    assert logprobs.text_offset == list(range(20))  # (one character a token here)

    streamed = [chunk.choices[0].logprobs for chunk in server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=3, stream=True) if chunk.choices]
    assert [value for chunk in streamed for value in chunk.token_logprobs] == logprobs.token_logprobs

    chat = [{"role": "user", "content": prompt}]
    plain_chat = draftwise.generate(target, tokenizer, chat, method="ar", max_new_tokens=16)
    expected_chat = plain_logprobs(target, plain_chat.prompt_ids, 16, 2)
    answer = server.client.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0,
                                                   logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == [entry.logprob for entry in expected_chat]
    assert [[alternative.logprob for alternative in entry.top_logprobs] for entry in content] == [
        [value for _, value in entry.top] for entry in expected_chat]
    assert content[0].token == text([expected_chat[0].token]) and content[0].bytes == list(content[0].token.encode())
    streamed = server.client.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0,
                                                     logprobs=True, stream=True)
    entries = [entry for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]
    assert [entry.logprob for entry in entries] == [entry.logprob for entry in expected_chat]
    assert all(entry.top_logprobs == [] for entry in entries)
    assert server.client.chat.completions.create(model=MODEL, messages=chat, max_tokens=4).choices[0].logprobs is None

    # The prompt's own (echo with logprobs: lm-evaluation-harness's loglikelihood requests), each bitwise one-row
    # decoding's row, the first prompt token without one.
    with torch.inference_mode():
        cache = target.new_cache(len(plain.prompt_ids) + 4)
        rows = [target.prefill([cache], [plain.prompt_ids[:1]]).logits[0][-1]]
        for token in plain.prompt_ids[1:-1]:
            rows.append(target.forward([cache], [RowBlock.chain([token])]).logits[0][-1])
            target.commit(cache, [0])
    prompt_expected = token_logprobs(torch.stack(rows), plain.prompt_ids[1:], 1)
    for stream in (False, True):
        answer = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=1,
                                                  echo=True, stream=stream)
        if stream:
            chunks = [chunk.choices[0] for chunk in answer if chunk.choices]
            assert "".join(chunk.text for chunk in chunks) == prompt + plain.text[:2]
            logprobs = {key: [value for chunk in chunks for value in getattr(chunk.logprobs, key)]
                        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        else:
            assert answer.choices[0].text == prompt + plain.text[:2]
            logprobs = answer.choices[0].logprobs.model_dump()
        assert logprobs["tokens"] == list(prompt + plain.text[:2])
        assert logprobs["token_logprobs"] == [None] + [entry.logprob for entry in prompt_expected + expected[:2]]
        assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"]) == len(plain.prompt_ids) + 2
        assert logprobs["text_offset"] == list(range(len(plain.prompt_ids) + 2))
    transformers_engine = ServingEngine(make_tiny_model("qwen2", seed=0), ChatCharTokenizer(), "ar")
    with pytest.raises(UnsupportedOptionError, match="prompt's log-probabilities"):
        transformers_engine.submit(plain.prompt_ids, 4, lambda event: None, logprobs=1, prompt_logprobs=True)

    sampled = plain_logprobs(target, plain.prompt_ids, 20, 0, temperature=0.9, top_k=20, seed=5)
    answer = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.9, seed=5,
                                              logprobs=0, extra_body={"top_k": 20})
    assert answer.choices[0].logprobs.token_logprobs == [entry.logprob for entry in sampled]


def test_stop_sequences_and_seeded_sampling(server, target):
    prompt = text_prompt(9)
    plain = draftwise.generate(target, ChatCharTokenizer(), prompt, method="ar", max_new_tokens=30)
    stop = plain.text[10:12]
    expected = draftwise.generate(target, ChatCharTokenizer(), prompt, method="pld", max_new_tokens=30, stop=[stop])
    answer = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stop)
    assert answer.choices[0].text == expected.text and answer.choices[0].finish_reason == "stop"
    streamed = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                                stop=[stop], stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text

    options = {"temperature": 0.8, "top_p": 0.9, "seed": 11}
    sampled = draftwise.generate(target, ChatCharTokenizer(), prompt, method="ar", max_new_tokens=30, **options)
    answer = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, **options)
    assert answer.choices[0].text == sampled.text


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": MODEL, "prompt": "Āā", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "Āā"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": ""}, 400, "empty"),
    ({"model": MODEL, "prompt": "Āā", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "Āā", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "Ā" * 300}, 400, "context window"),
    ({"model": MODEL, "prompt": "Āā", "max_tokens": 1000}, 400, "context window"),
    ({"model": MODEL, "prompt": "Āā", "n": 2}, 400, "'n'"),
    ({"model": MODEL, "prompt": "Āā", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "Āā", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "Āā", "logit_bias": {"9999": 5}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "Āā", "logit_bias": {"3": 500}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "Āā", "logit_bias": {"a": 5}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "Āā", "mirostat": 1}, 400, "'mirostat' is not a supported option"),
    ({"model": MODEL, "prompt": "Āā", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "Āā", "temperature": 0, "top_p": 0.5}, 400, "top_p"),
    ({"model": MODEL, "prompt": [1, 2, 9999]}, 400, "token ids"),
    ({"model": MODEL, "prompt": "Āā", "min_tokens": 40, "max_tokens": 8}, 400, "min_new_tokens"),
    ({"model": MODEL, "prompt": "Āā", "min_tokens": -1}, 400, "'min_tokens'"),
    ({"model": MODEL, "prompt": "Āā", "stop_token_ids": [9999]}, 400, "stop_token_ids"),
])
def test_bad_completion_requests(server, body, status, message):
    code, answer = server.post("/v1/completions", body)
    assert code == status, answer
    assert message in answer["error"]["message"], answer
    assert answer["error"]["type"]


@pytest.mark.parametrize("body, message", [
    ({"model": MODEL, "messages": []}, "messages is empty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "  "}]}, "every message is empty"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "Āā"}]}, "role"),
    ({"model": MODEL, "messages": "Āā"}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Āā"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Āā"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Āā"}], "stream_options": {"include_usage": True}},
     "stream_options"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Āā"}], "top_logprobs": 2}, "needs logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Āā"}], "logprobs": True, "top_logprobs": 30},
     "top_logprobs"),
])
def test_bad_chat_requests(server, body, message):
    code, answer = server.post("/v1/chat/completions", body)
    assert code == 400, answer
    assert message in answer["error"]["message"], answer


def test_openai_client_raises_on_errors(server):
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="Āā")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Āā"}], max_tokens=0)


def test_metrics_use_vllm_speculation_names(server):
    server.client.completions.create(model=MODEL, prompt=text_prompt(3), max_tokens=30, temperature=0)
    status, text = server.get("/metrics")
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert values[f"draftwise:{name}_total"] > 0, name
    assert values['draftwise:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert values["draftwise:e2e_request_latency_seconds_count"] >= 1
    assert "draftwise:time_to_first_token_seconds_bucket" in text
    assert values['draftwise:request_success_total{finished_reason="length"}'] >= 1


def test_metrics_say_where_drafting_was_judged_not_to_pay(target):
    """The policy's paused steps by reason, and the step rates the throughput judge compares, reach /metrics."""
    from draftwise.decoding.policy import MeasuredRate

    engine = ServingEngine(target, ChatCharTokenizer(), "pld")
    policy = engine.decoder.policy
    policy.paused_steps.update(throughput=3, measuring=1)
    state = policy.state(4)
    state.rate_with_drafts, state.rate_without_drafts = MeasuredRate(150.0, 5), MeasuredRate(200.0, 5)
    engine._count_drafting_decisions()
    policy.paused_steps["throughput"] += 2
    engine._count_drafting_decisions()
    text = engine.metrics.exposition().decode()
    assert 'draftwise:drafting_paused_steps_total{reason="throughput"} 5.0' in text
    assert 'draftwise:drafting_paused_steps_total{reason="measuring"} 1.0' in text
    assert 'draftwise:step_tokens_per_second{batch_size="4",drafts="yes"} 150.0' in text
    assert 'draftwise:step_tokens_per_second{batch_size="4",drafts="no"} 200.0' in text


def test_a_disconnected_stream_frees_its_slot(target):
    engine = ServingEngine(target, ChatCharTokenizer(), "pld")
    step = engine.decoder.step

    def slow_step(sequences, prompt_chunks=()):
        time.sleep(0.02)
        return step(sequences, prompt_chunks)

    engine.decoder.step = slow_step
    running = RunningServer(engine)
    try:
        body = json.dumps({"model": MODEL, "prompt": "Āā", "max_tokens": 200, "ignore_eos": True, "stream": True,
                           "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", running.port)) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            received = b""
            while b"data:" not in received:
                received += connection.recv(4096)
        deadline = time.monotonic() + 10
        while engine.running or engine.waiting:
            assert time.monotonic() < deadline, "the slot was not freed"
            time.sleep(0.05)
        assert "draftwise:request_cancelled_total 1.0" in running.get("/metrics")[1]
        assert not engine._tickets and not engine._seen
    finally:
        running.stop()


def test_a_full_queue_answers_503(target):
    engine = ServingEngine(target, ChatCharTokenizer(), "ar", max_waiting=2)
    # Not started: nothing leaves the queue.
    for _ in range(2):
        engine.submit([1, 2, 3], 4, lambda event: None)
    with pytest.raises(ServerBusyError, match="capacity"):
        engine.submit([1, 2, 3], 4, lambda event: None)

    running = RunningServer(ServingEngine(target, ChatCharTokenizer(), "ar"))
    try:
        def busy(*args, **kwargs):
            raise ServerBusyError("the server is at capacity (2 requests waiting); retry later")

        running.engine.submit = busy
        code, answer = running.post("/v1/completions", {"model": MODEL, "prompt": "Āā"})
        assert code == 503 and "capacity" in answer["error"]["message"]
    finally:
        running.stop()


def test_load_64_concurrent_streams(target):
    """A bounded load test: 64 concurrent streaming clients, 192 requests over 12 prompts; no errors, every
    request gets its own prompt's greedy text, and a second round grows the process's memory by little."""
    running = RunningServer(ServingEngine(target, ChatCharTokenizer(), "pld", max_batch=16))
    try:
        prompts = [text_prompt(100 + seed, low=5, high=60) for seed in range(12)]
        expected = [
            draftwise.generate(target, ChatCharTokenizer(), [{"role": "user", "content": prompt}], method="pld",
                               max_new_tokens=24).text
            for prompt in prompts
        ]
        base = running.base + "/v1"
        first = asyncio.run(run_load(base, MODEL, prompts, 192, concurrency=64, max_tokens=24, expected=expected))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        second = asyncio.run(run_load(base, MODEL, prompts, 192, concurrency=64, max_tokens=24, expected=expected))
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
        for report in (first, second):
            assert not report.errors, report.errors[:3]
            assert not report.mismatches
            assert report.output_tokens == 192 * 24
            latency = report.metrics()["request_latency"]
            assert latency["p99"] >= latency["median"] > 0
        assert grown_kib < 64 * 1024, f"memory grew by {grown_kib} KiB in the second round"
        assert not running.engine._tickets and not running.engine.running and not running.engine.waiting
    finally:
        running.stop()


def test_engine_rejects_what_it_cannot_serve(target):
    engine = ServingEngine(target, ChatCharTokenizer(), "pld")
    with pytest.raises(draftwise.InvalidRequestError, match="context window"):
        engine.submit(list(range(10)) * 30, 4, lambda event: None)
    with pytest.raises(draftwise.InvalidRequestError, match="max_new_tokens"):
        engine.submit([1, 2], 0, lambda event: None)
    assert torch.is_grad_enabled()  # the worker's settings stay on its own thread


@pytest.mark.parametrize("arguments, message", [
    (["serve", "--method", "nope"], "nope"),
    (["serve", "--max-batch", "0"], "--max-batch"),
    (["loadtest", "--requests", "0"], "--requests"),
    (["loadtest", "--sweep", "1,x"], "--sweep takes"),
    (["loadtest", "--sweep", "1,4", "--concurrency", "2"], "not both"),
    (["loadtest", "--compare", "/no/such/results.json"], "--compare"),
    (["loadtest", "--no-run"], "--no-run shows"),
    (["serve", "--ray", "--autoscale", "2"], "--autoscale takes MIN,MAX"),
    (["serve", "--ray", "--autoscale", "3,1"], "autoscale needs"),
    (["serve", "--ray", "--replicas", "0"], "replicas must be at least 1"),
    (["serve", "--ray", "--replicas", "2", "--autoscale", "1,3"], "not both"),
    (["serve", "--replicas", "2"], "--replicas needs --ray"),
    (["serve", "--ray", "--model", "/no/such/model.gguf"], "unknown model"),
    (["serve", "--ray", "--weights", "q8_0", "--model", "/no/such/model.gguf"], "unknown model"),
])
def test_serve_and_loadtest_commands_refuse_bad_options(capsys, arguments, message):
    from draftwise import cli

    assert cli.main(arguments) == 2
    assert message in capsys.readouterr().err


def test_request_metrics_follow_guidellms_definitions():
    streamed = RequestRecord(start=10.0, end=12.5, output_tokens=5, first_token=10.5, last_token=12.0)
    assert streamed.request_latency == 2.5
    assert streamed.time_to_first_token_ms == pytest.approx(500.0)
    assert streamed.inter_token_latency_ms == pytest.approx(375.0)  # (last - first) / (tokens - 1)
    assert streamed.time_per_output_token_ms == pytest.approx(400.0)  # (last - start) / tokens
    whole = RequestRecord(start=10.0, end=12.0, output_tokens=4)
    assert whole.time_to_first_token_ms is None and whole.inter_token_latency_ms is None
    assert whole.time_per_output_token_ms == pytest.approx(500.0)
    assert RequestRecord(start=0.0, end=1.0, output_tokens=1, first_token=0.5, last_token=0.5).inter_token_latency_ms is None


def test_speculation_between_two_readings_of_the_counters():
    before = {"drafts": 10, "draft_tokens": 40, "accepted_tokens": 20, "generation_tokens": 100}
    after = {"drafts": 40, "draft_tokens": 160, "accepted_tokens": 80, "generation_tokens": 300}
    spent = speculation_between(before, after)
    # 200 tokens, 60 of them accepted drafts: 140 sequence steps, 30 of which verified a draft.
    assert spent["sequence_steps"] == 140 and spent["drafting_share"] == pytest.approx(30 / 140, abs=1e-4)
    assert spent["mean_acceptance_length"] == 3.0 and spent["acceptance_rate"] == 0.5
    assert spent["tokens_per_sequence_step"] == pytest.approx(200 / 140, abs=1e-4)
    assert speculation_between(None, after) is None


@pytest.mark.parametrize("stream", [True, False])
def test_a_sweep_measures_each_level_with_guidellms_metrics(server, stream):
    prompts = [text_prompt(300 + seed, low=10, high=40) for seed in range(6)]
    reports = sweep(server.base + "/v1", MODEL, prompts, [1, 3], max_tokens=12, requests=6, warmup=1,
                    stream=stream, ignore_eos=True)
    assert [report.concurrency for report in reports] == [1, 3]
    for report in reports:
        metrics = report.metrics()
        assert not report.errors, report.errors[:3]
        assert metrics["request_totals"] == {"successful": 6, "errored": 0, "incomplete": 0}
        assert metrics["output_token_count"] == 6 * 12  # ignore_eos: exactly max_tokens each
        assert metrics["output_tokens_per_second"] > 0 and metrics["request_latency"]["median"] > 0
        assert metrics["time_per_output_token_ms"]["median"] > 0
        if stream:
            assert 0 < metrics["time_to_first_token_ms"]["median"] <= 1000 * metrics["request_latency"]["p99"]
            assert metrics["inter_token_latency_ms"]["median"] > 0
        else:
            assert metrics["time_to_first_token_ms"] is None and metrics["inter_token_latency_ms"] is None
        speculation = report.speculation  # read from the server's /metrics around the level
        assert speculation is not None and speculation["sequence_steps"] >= 6
        assert 0 <= speculation["drafting_share"] <= 1 and speculation["mean_acceptance_length"] >= 1
        assert speculation["tokens_per_sequence_step"] == pytest.approx(
            72 / speculation["sequence_steps"], abs=1e-3)
    # (Whether a level drafts is the policy's call on this machine's measured costs: over the sweep, some level did.)
    assert any(report.speculation["drafting_share"] > 0 for report in reports)


def test_loadtest_command_writes_results_a_chart_and_compares(server, tmp_path, capsys):
    from draftwise import cli

    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(
        json.dumps({"question_id": seed, "category": "test", "turns": [text_prompt(400 + seed)]}) + "\n"
        for seed in range(3)
    ))
    common = ["loadtest", "--url", server.base + "/v1", "--model", MODEL, "--data-file", str(questions),
              "--max-tokens", "6", "--requests", "3"]
    assert cli.main([*common, "--sweep", "1,2", "--label", "first", "--json", str(tmp_path / "first.json")]) == 0
    label, levels = read_results(tmp_path / "first.json")
    assert label == "first" and [level["concurrency"] for level in levels] == [1, 2]
    assert levels[0]["metrics"]["request_totals"]["successful"] == 3
    chart = tmp_path / "chart.png"
    assert cli.main([*common, "--concurrency", "2", "--no-stream", "--label", "second",
                     "--compare", str(tmp_path / "first.json"), "--plot", str(chart)]) == 0
    table = capsys.readouterr().out
    assert "first" in table and "second" in table and "TTFT" in table
    assert chart.stat().st_size > 10_000
    assert cli.main(["loadtest", "--no-run", "--compare", str(tmp_path / "first.json")]) == 0
    assert "first" in capsys.readouterr().out


def test_a_server_is_built_on_a_passing_thread():
    """The model is loaded on a thread that ends with the load (its CPU thread pool with it), not on this one; its
    result or its error comes back here."""
    thread = on_passing_thread(threading.current_thread)
    assert thread is not threading.current_thread() and not thread.is_alive()

    def failing():
        raise draftwise.InvalidRequestError("no tokenizer")

    with pytest.raises(draftwise.InvalidRequestError, match="no tokenizer"):
        on_passing_thread(failing)


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(server):
    """vLLM's ``min_tokens``: no stop token id, end token or stop string ends the answer before that many tokens;
    after them they end it as usual."""
    body = {"model": MODEL, "prompt": text_prompt(21), "max_tokens": 20, "temperature": 0}
    code, plain = server.post("/v1/completions", body)
    assert code == 200
    first = server.engine.tokenizer.encode_text(plain["choices"][0]["text"])[1]
    code, stopped = server.post("/v1/completions", {**body, "stop_token_ids": [first]})
    assert code == 200 and stopped["usage"]["completion_tokens"] == 2
    code, held = server.post("/v1/completions", {**body, "stop_token_ids": [first], "min_tokens": 8})
    assert code == 200 and held["usage"]["completion_tokens"] >= 8
    assert held["choices"][0]["text"][:1] == plain["choices"][0]["text"][:1]


def test_logit_bias_and_penalties_are_honoured(server):
    body = {"model": MODEL, "prompt": text_prompt(23), "max_tokens": 6, "temperature": 0}
    code, plain = server.post("/v1/completions", body)
    assert code == 200
    tokenizer = server.engine.tokenizer
    first = tokenizer.encode_text(plain["choices"][0]["text"])[0]
    favourite = (first + 7) % tokenizer.vocab_size
    code, forced = server.post("/v1/completions", {**body, "logit_bias": {str(favourite): 100}})
    assert code == 200 and tokenizer.encode_text(forced["choices"][0]["text"]) == [favourite] * 6
    code, barred = server.post("/v1/completions", {**body, "logit_bias": {str(first): -100}})
    assert code == 200 and tokenizer.encode_text(barred["choices"][0]["text"])[0] != first
    code, penalised = server.post("/v1/completions", {**body, "logit_bias": {str(favourite): 100},
                                                      "frequency_penalty": 2, "presence_penalty": 2})
    assert code == 200 and penalised["usage"]["completion_tokens"] == 6
