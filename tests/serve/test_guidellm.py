"""The server driven by guidellm, the vLLM project's load tool, as users run it: its OpenAI HTTP backend with its
own defaults (vLLM's request extensions, streaming with continuous usage statistics, fixed output lengths through
``ignore_eos``), on the default preset. Every request must succeed, carry exactly the asked number of tokens, and,
greedy, equal ``draftwise.generate``'s answer for the same request. Slow (a real model), and run in CI too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from servers import RunningServer

import draftwise
from draftwise.models import resolve_checkpoint
from draftwise.serve import ServingEngine

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 48
OUTPUT_TOKENS = 12
REQUESTS = 4


@pytest.fixture(scope="module")
def smollm():
    torch.set_num_threads(2)
    return draftwise.load_model("smollm2-135m")


@pytest.fixture(scope="module")
def server(smollm):
    model, tokenizer = smollm
    running = RunningServer(ServingEngine(model, tokenizer, "pld", max_batch=4, max_prefill_rows=256),
                            model="smollm2-135m")
    yield running
    running.stop()


def run_guidellm(url: str, stream: bool, output: str, api_key: str | None = None, data: str = "") -> dict:
    backend = {"kind": "openai_http", "target": url, "stream": stream, "extras": {"body": {"temperature": 0}}}
    if api_key is not None:
        backend["api_key"] = api_key
    command = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", json.dumps(backend),
        "--profile", "kind=concurrent,streams=2",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}{data}",
        "--tokenizer", f"kind=huggingface_auto,model={resolve_checkpoint('smollm2-135m', progress=False)}",
        "--output", f"kind=json,path={output}",
        "--disable-console",
    ]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    with open(output) as handle:
        return json.load(handle)["benchmarks"][0]


def server_counts(server: RunningServer) -> tuple[float, float, float]:
    """Requests the server finished, saw cancelled and refused so far, from its Prometheus registry."""
    registry = server.engine.metrics.registry
    finished = sum(sample.value for metric in registry.collect() if metric.name == "draftwise:request_success"
                   for sample in metric.samples if sample.name.endswith("_total"))
    cancelled = registry.get_sample_value("draftwise:request_cancelled_total") or 0.0
    refused = registry.get_sample_value("draftwise:request_refused_total") or 0.0
    return finished, cancelled, refused


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_guidellm_runs_without_errors_and_gets_generates_answers(server, smollm, tmp_path, stream):
    before = server_counts(server)
    benchmark = run_guidellm(server.base, stream, str(tmp_path / "guidellm.json"))
    after = server_counts(server)
    requests = benchmark["requests"]
    assert not requests["errored"] and not requests["incomplete"], requests["errored"][:1]
    # The server finished every request guidellm sent, none cancelled or refused. guidellm's own record may miss the
    # last answer: its worker processes stop on their local request counts and can exit before reporting it.
    finished, cancelled, refused = (a - b for a, b in zip(after, before))
    assert (finished, cancelled, refused) == (REQUESTS, 0, 0)
    assert REQUESTS - 1 <= len(requests["successful"]) <= REQUESTS
    metrics = benchmark["metrics"]
    assert metrics["output_tokens_per_second"]["successful"]["mean"] > 0
    if stream:
        assert metrics["time_to_first_token_ms"]["successful"]["median"] > 0
    model, tokenizer = smollm
    for request in requests["successful"]:
        assert request["output_tokens"] == OUTPUT_TOKENS  # guidellm's ignore_eos: exactly the asked length
        arguments = request["request_args"]
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        content = arguments["body"]["messages"][0]["content"]
        text = content if isinstance(content, str) else "".join(part["text"] for part in content)
        expected = draftwise.generate(model, tokenizer, [{"role": "user", "content": text}], method="ar",
                                      max_new_tokens=OUTPUT_TOKENS, ignore_eos=True)
        assert request["output"] == expected.text


def test_guidellm_passes_the_servers_api_key(smollm, tmp_path):
    model, tokenizer = smollm
    keyed = RunningServer(ServingEngine(model, tokenizer, "pld", max_batch=4, max_prefill_rows=256),
                          model="smollm2-135m", api_key="sk-guidellm-test")
    try:
        benchmark = run_guidellm(keyed.base, True, str(tmp_path / "guidellm.json"), api_key="sk-guidellm-test")
    finally:
        keyed.stop()
    requests = benchmark["requests"]
    assert not requests["errored"] and not requests["incomplete"], requests["errored"][:1]
    assert REQUESTS - 1 <= len(requests["successful"]) <= REQUESTS


def test_guidellm_conversations_with_shared_prefixes_hit_the_prefix_cache(server, tmp_path):
    """guidellm's multi-turn synthetic data with its shared prefixes (``turns``, ``prefix_tokens``, ``prefix_count``):
    no errors, and the server restores prompt tokens from its prefix cache."""
    registry = server.engine.metrics.registry
    hits_before = registry.get_sample_value("draftwise:prefix_cache_hits_total") or 0.0
    benchmark = run_guidellm(server.base, True, str(tmp_path / "guidellm.json"),
                             data=",turns=2,prefix_tokens=64,prefix_count=1")
    requests = benchmark["requests"]
    assert not requests["errored"] and not requests["incomplete"], requests["errored"][:1]
    assert requests["successful"]
    assert (registry.get_sample_value("draftwise:prefix_cache_hits_total") or 0.0) - hits_before >= 64
