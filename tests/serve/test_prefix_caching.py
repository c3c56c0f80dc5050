"""Prefix caching in the server: a follow-up turn that resends the conversation is answered exactly as without the
cache, its usage names the cached prompt tokens (OpenAI's ``prompt_tokens_details.cached_tokens``), ``/metrics`` counts
queries and hits under vLLM's names, and the option switches it off."""

from __future__ import annotations

import asyncio
import random

import pytest
from servers import MODEL, RunningServer
from tiny import ChatCharTokenizer, make_tiny_model, repetitive_prompt

import draftwise
from draftwise import cli
from draftwise.backend.calibration.invariance import plan_rows
from draftwise.backend.calibration.machine import MeasurementStore
from draftwise.backend.forward.lean import LeanTarget
from draftwise.errors import InvalidRequestError
from draftwise.serve import ServingEngine


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    lean = LeanTarget(make_tiny_model("qwen2", seed=0))
    plan_rows(lean, MeasurementStore(tmp_path_factory.mktemp("machine")))
    return lean


def text(tokens: list[int]) -> str:
    return "".join(chr(0x100 + token) for token in tokens)


def metric(body: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize("prefix_cache_bytes", [1 << 30, 0])
def test_a_follow_up_turn_reuses_the_conversation(target, prefix_cache_bytes):
    running = RunningServer(ServingEngine(target, ChatCharTokenizer(), "pld", prefix_cache_bytes=prefix_cache_bytes))
    try:
        if not target.prefix_caching:
            pytest.skip("no prefix caching without the compiled kernels")
        rng = random.Random(2)
        first = text(repetitive_prompt(rng, low=60, high=70))
        answer = running.client.completions.create(model=MODEL, prompt=first, max_tokens=40, temperature=0)
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
        second = first + answer.choices[0].text + text(repetitive_prompt(rng, low=5, high=8))
        expected = draftwise.generate(target, ChatCharTokenizer(), second, method="pld", max_new_tokens=20)
        chunks = list(running.client.completions.create(model=MODEL, prompt=second, max_tokens=20, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected.text
        cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
        status, body = running.get("/metrics")
        assert status == 200
        queries = metric(body, "draftwise:prefix_cache_queries_total")
        hits = metric(body, "draftwise:prefix_cache_hits_total")
        if prefix_cache_bytes:
            assert cached > len(first) and hits == cached
            assert queries == len(expected.prompt_ids) + answer.usage.prompt_tokens
            assert metric(body, "draftwise:prefix_cache_usage_bytes") > 0
            assert running.engine.prefix_caching_off is None
        else:
            assert cached == 0 and queries == hits == 0
            assert running.engine.prefix_caching_off == "switched off"
    finally:
        running.stop()


def test_a_target_without_it_serves_with_it_off(tiny_qwen2):
    engine = ServingEngine(tiny_qwen2, ChatCharTokenizer(), "ar")
    assert engine.decoder.prefix_cache is None and "verification rows" in engine.prefix_caching_off


@pytest.mark.parametrize("size", [-1, 1.5, True])
def test_a_bad_size_is_refused(target, size):
    with pytest.raises(InvalidRequestError, match="prefix cache"):
        ServingEngine(target, ChatCharTokenizer(), "ar", prefix_cache_bytes=size)


def test_the_command_line_refuses_a_negative_size(capsys):
    assert cli.main(["serve", "--prefix-cache-mb", "-1"]) == 2
    assert "--prefix-cache-mb" in capsys.readouterr().err


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_the_conversation_profile_resends_each_conversation(target, chat, tmp_path, capsys):
    """``loadtest --turns``: each conversation's follow-ups resend it; their first-token times are reported apart
    from the first turns', with the prompt tokens the server restored (and the server's hits are those)."""
    from draftwise.serve.load import run_load

    running = RunningServer(ServingEngine(target, ChatCharTokenizer(), "pld", max_batch=4))
    try:
        prompts = [text(repetitive_prompt(random.Random(seed), low=40, high=60)) for seed in range(3)]
        report = asyncio.run(run_load(running.base + "/v1", MODEL, prompts, requests=3, concurrency=2,
                                      max_tokens=10, chat=chat, turns=3, ignore_eos=True))
        assert not report.errors and not report.incomplete and report.requests == 9
        assert sorted(record.turn for record in report.records) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        metrics = report.metrics()
        assert metrics["request_totals"]["successful"] == 9
        assert metrics["follow_up_time_to_first_token_ms"]["median"] > 0
        assert metrics["first_turn_time_to_first_token_ms"]["median"] > 0
        registry = running.engine.metrics.registry
        hits = registry.get_sample_value("draftwise:prefix_cache_hits_total")
        assert sum(record.cached_tokens for record in report.records) == hits
        if target.prefix_caching:
            assert all(record.cached_tokens > 0 for record in report.records if record.turn)
            assert metrics["follow_up_cached_prompt_tokens"] > 40
        assert cli.main(["loadtest", "--url", running.base + "/v1", "--model", MODEL, "--max-tokens", "4",
                         "--requests", "2", "--turns", "2", "--per-category", "1", "--json",
                         str(tmp_path / "turns.json")]) == 0
        capsys.readouterr()
        from draftwise.serve.load import read_results

        _, [level] = read_results(tmp_path / "turns.json")
        assert level["metrics"]["request_totals"]["successful"] == 4
        assert level["metrics"]["follow_up_time_to_first_token_ms"]["median"] > 0
        assert cli.main(["loadtest", "--turns", "0"]) == 2
    finally:
        running.stop()
