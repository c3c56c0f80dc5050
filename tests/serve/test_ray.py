"""``draftwise serve --ray`` on a local Ray instance: two replicas of a tiny model behind Ray Serve's proxy answer
streaming and plain requests exactly as ``draftwise.generate`` does, both replicas serve, a session sticks to one
replica, errors and metrics pass through unchanged, a replica killed mid-run fails only its own requests (its streams
cut, as the client sees them) while the other goes on and Serve brings a new one up, a replica whose engine thread
stopped is replaced by Serve's health check, and an autoscaled application grows under load and shrinks when idle."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
aiohttp = pytest.importorskip("aiohttp")  # a dependency of ray[serve]

from tiny import POISON, poisonable_serving_model, repetitive_prompt, tiny_serving_model

import draftwise
from draftwise.errors import InvalidRequestError
from draftwise.serve.ray import APP_NAME, build_app, replica_limits

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2"
TESTS = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def text_prompt(seed: int) -> str:
    import random

    return "".join(chr(0x100 + token) for token in repetitive_prompt(random.Random(seed), low=10, high=30))


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def cluster(metrics_port):
    """A local Ray instance (2 CPUs) serving two replicas of the tiny model, half a CPU each (the autoscaling test
    runs its own application beside them)."""
    python_path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", _metrics_export_port=metrics_port,
             runtime_env={"env_vars": {"PYTHONPATH": python_path}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        started = time.perf_counter()
        app = build_app(poisonable_serving_model, served_model_name=MODEL, method="pld", replicas=2, cpus_per_replica=0.5,
                        max_batch=4, default_max_tokens=24, health_check_period_s=1)
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(f"two replicas up in {time.perf_counter() - started:.1f} s")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    target, tokenizer = tiny_serving_model()
    return lambda prompt, tokens: draftwise.generate(target, tokenizer, prompt, method="pld", max_new_tokens=tokens)


async def stream_completion(client: aiohttp.ClientSession, prompt: str, max_tokens: int, session: str | None = None,
                            on_first=None, on_start=None) -> tuple[str, str, str]:
    """One streamed completion: ``(text, finish_reason, replica)``; raises on a broken stream or an error event.
    ``on_start(replica)`` is called once the response's headers name its replica, ``on_first(replica)`` (awaited) at
    its first piece."""
    headers = {"x-session-id": session} if session else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    pieces, reason = [], None
    async with client.post("/v1/completions", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        replica = response.headers["x-draftwise-replica"]
        if on_start is not None:
            on_start(replica)
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            pieces.append(event["choices"][0]["text"])
            reason = event["choices"][0]["finish_reason"] or reason
            if on_first is not None and len(pieces) == 1:
                await on_first(replica)
    if reason is None:
        raise RuntimeError("the stream ended without a finish reason")
    return "".join(pieces), reason, replica


def http_client(base: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(base_url=base, timeout=aiohttp.ClientTimeout(total=120))


async def run_streams(base: str, prompts: list[str], max_tokens: int, concurrency: int,
                      sessions: list[str | None] | None = None) -> list:
    limit = asyncio.Semaphore(concurrency)
    async with http_client(base) as client:
        async def one(index: int):
            async with limit:
                session = sessions[index] if sessions else None
                return await stream_completion(client, prompts[index], max_tokens, session)

        return await asyncio.gather(*(one(index) for index in range(len(prompts))), return_exceptions=True)


def test_two_replicas_stream_answers_equal_to_generate(cluster, reference):
    prompts = [text_prompt(seed) for seed in range(16)]
    results = asyncio.run(run_streams(cluster, prompts, 24, concurrency=8))
    errors = [result for result in results if isinstance(result, BaseException)]
    assert not errors, errors[:3]
    for prompt, (text, reason, _) in zip(prompts, results):
        assert text == reference(prompt, 24).text
        assert reason == "length"
    assert len({replica for _, _, replica in results}) == 2, "both replicas serve"


def test_plain_requests_errors_models_and_metrics_pass_through(cluster, reference):
    import openai

    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=60)
    prompt = text_prompt(3)
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert answer.choices[0].text == reference(prompt, 16).text
    assert answer.model_extra["draftwise"]["method"] == "pld"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
    assert [model.id for model in client.models.list().data] == [MODEL]
    with pytest.raises(openai.BadRequestError, match="not a supported option"):
        client.completions.create(model=MODEL, prompt=prompt, extra_body={"best_of_everything": 2})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt=prompt)
    with urllib.request.urlopen(cluster + "/metrics", timeout=30) as response:
        assert "draftwise:spec_decode_num_drafts_total" in response.read().decode()
    with urllib.request.urlopen(cluster + "/health", timeout=30) as response:
        assert response.status == 200 and json.loads(response.read())["status"] == "ok"


def test_a_session_sticks_to_one_replica(cluster):
    sessions = [f"conversation-{index}" for index in range(16)]  # all on one replica by chance: 2**-15
    replicas: dict[str, set[str]] = {}
    for turn in range(2):
        prompts = [text_prompt(1000 * turn + index) for index in range(16)]
        results = asyncio.run(run_streams(cluster, prompts, 4, concurrency=4, sessions=sessions))
        for session, result in zip(sessions, results):
            assert not isinstance(result, BaseException), result
            replicas.setdefault(session, set()).add(result[2])
    assert all(len(served) == 1 for served in replicas.values()), replicas
    assert len(set().union(*replicas.values())) == 2, "sessions spread over both replicas"


def test_ray_exports_every_replicas_metrics(cluster, metrics_port):
    """Ray's Prometheus endpoint carries the draftwise counters of both replicas, tagged by replica."""
    asyncio.run(run_streams(cluster, [text_prompt(seed) for seed in range(8)], 8, concurrency=4))
    deadline = time.monotonic() + 90
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as response:
            exported = response.read().decode()
        lines = [line for line in exported.splitlines() if line.startswith("ray_draftwise_generation_tokens")]
        replicas = {re.search(r'replica="([^"]+)"', line).group(1) for line in lines if 'replica="' in line}
        if len(replicas) == 2:
            break
        assert time.monotonic() < deadline, f"draftwise metrics of two replicas never exported: {lines[:4]}"
        time.sleep(2)
    assert any(line.startswith("ray_draftwise_spec_decode_num_drafts") for line in exported.splitlines())


def replica_actor(unique_id: str):
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith(unique_id):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no replica actor {unique_id}")


def running_replicas() -> int:
    status = serve.status().applications[APP_NAME].deployments["DraftwiseReplica"]
    return status.replica_states.get("RUNNING", 0)


def test_a_killed_replica_fails_its_requests_and_comes_back(cluster, reference):
    prompts = [text_prompt(100 + seed) for seed in range(6)]
    killed: list[str] = []
    placed: dict[int, str] = {}  # each stream's replica, from its headers, whether it finishes or not

    async def scenario() -> dict[int, object]:
        async with http_client(cluster) as client:
            tasks: dict[int, asyncio.Task] = {}

            async def kill_first(replica: str) -> None:
                if not killed:
                    killed.append(replica)
                    await asyncio.to_thread(lambda: ray.kill(replica_actor(replica), no_restart=True))

            def start(index: int) -> None:
                tasks[index] = asyncio.create_task(stream_completion(
                    client, prompts[index], 180, on_first=kill_first if index == 0 else None,
                    on_start=lambda replica: placed.update({index: replica})))

            # Streams on both replicas first (Serve's router may send a burst to one: more are sent until one lands
            # on the other), then the doomed stream, whose replica is killed at its first piece.
            for index in range(1, len(prompts)):
                start(index)
            deadline = time.monotonic() + 60
            while len(set(placed.values())) < 2:
                assert time.monotonic() < deadline, f"no stream reached a second replica ({placed})"
                if all(index in placed or task.done() for index, task in tasks.items()) and len(prompts) < 24:
                    prompts.append(text_prompt(100 + len(prompts)))
                    start(len(prompts) - 1)
                await asyncio.sleep(0.05)
            start(0)
            await asyncio.wait(list(tasks.values()))
            return {index: (task.exception() or task.result()) for index, task in tasks.items()}

    results = asyncio.run(scenario())
    assert killed, "the stream never started"
    # What its client sees: Serve's proxy ends the chunked response unfinished, so the stream fails as cut (never
    # as a short answer with a finish reason).
    assert isinstance(results[0], aiohttp.ClientPayloadError), repr(results[0])
    assert "not completed" in str(results[0])
    assert any(replica != killed[0] for replica in placed.values()), placed
    # Streams on the surviving replica finish with the right answer. Those on the killed replica fail with an error,
    # or finish with the right answer where the replica had sent all of it before the kill (the client may still be
    # reading it): never a wrong or cut answer.
    for index, replica in placed.items():
        result = results[index]
        if replica != killed[0]:
            assert not isinstance(result, BaseException), f"stream {index} on the surviving replica failed: {result!r}"
        if not isinstance(result, BaseException):
            assert result[0] == reference(prompts[index], 180).text, f"stream {index} answered wrongly"
    # New requests are served while Serve replaces the replica (one retry: the proxy may not know yet).
    for seed in range(4):
        outcome = asyncio.run(run_streams(cluster, [text_prompt(seed)], 8, concurrency=1))[0]
        if isinstance(outcome, BaseException):
            outcome = asyncio.run(run_streams(cluster, [text_prompt(seed)], 8, concurrency=1))[0]
        assert not isinstance(outcome, BaseException), outcome
    # Serve brings a new replica up: two replicas other than the killed one answer.
    deadline = time.monotonic() + 180
    answering: set[str] = set()
    while len(answering - set(killed)) < 2:
        assert time.monotonic() < deadline, f"Serve did not bring the replica back (answering: {answering})"
        served = asyncio.run(run_streams(cluster, [text_prompt(seed) for seed in range(4)], 4, concurrency=4))
        answering |= {result[2] for result in served if not isinstance(result, BaseException)}
        time.sleep(0.5)
    assert running_replicas() == 2


def test_a_replica_whose_engine_stopped_is_replaced_by_the_health_check(cluster, reference):
    """A replica's engine thread stops (the actor lives on): the request that stopped it ends with a clear error, the
    replica answers 503 from then on, and Serve's health check replaces it."""
    import openai

    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError, match="the decoding engine stopped: SystemExit"):
        client.completions.create(model=MODEL, prompt=[*POISON, 1, 2], max_tokens=8, temperature=0)
    deadline = time.monotonic() + 120
    while running_replicas() == 2:  # (the health check runs every second: the replica is found unhealthy)
        assert time.monotonic() < deadline, "Serve never found the stopped engine"
        time.sleep(0.2)
    while running_replicas() < 2:
        assert time.monotonic() < deadline, "Serve did not replace the replica"
        time.sleep(0.5)
    # Both replicas serve again, with the right answers (one retry: the proxy may still know the replaced one).
    for seed in range(6):
        prompt = text_prompt(200 + seed)
        try:
            answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        except openai.APIStatusError:
            answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert answer.choices[0].text == reference(prompt, 8).text


def test_the_autoscaler_adds_a_replica_under_load_and_removes_it_when_idle(cluster):
    """An application autoscaled between 1 and 2 replicas (one-sequence batches, short delays): sustained load
    above one batch per replica brings a second replica up, which serves; idle, it goes again."""
    import threading

    import openai

    name = "autoscaled"
    app = build_app(tiny_serving_model, served_model_name=MODEL, method="ar", autoscale=(1, 2), cpus_per_replica=0.25,
                    max_batch=1, max_waiting=16, default_max_tokens=16, health_check_period_s=1,
                    autoscaling_options={"upscale_delay_s": 1, "downscale_delay_s": 2, "look_back_period_s": 11})
    serve.run(app, name=name, route_prefix="/" + name)

    def replicas() -> int:
        return serve.status().applications[name].deployments["DraftwiseReplica"].replica_states.get("RUNNING", 0)

    try:
        assert replicas() == 1
        client = openai.OpenAI(base_url=f"{cluster}/{name}/v1", api_key="none", max_retries=2, timeout=60)
        stop, served_by, failures = threading.Event(), set(), []

        def load(seed: int) -> None:
            while not stop.is_set():
                try:
                    response = client.completions.with_raw_response.create(
                        model=MODEL, prompt=text_prompt(seed), max_tokens=16, temperature=0)
                    served_by.add(response.headers["x-draftwise-replica"])
                except openai.APIError as error:
                    failures.append(error)

        clients = [threading.Thread(target=load, args=(seed,), daemon=True) for seed in range(6)]
        for thread in clients:
            thread.start()
        try:
            deadline = time.monotonic() + 120
            while replicas() < 2 or len(served_by) < 2:
                assert time.monotonic() < deadline, f"no second replica under load ({replicas()} running)"
                time.sleep(0.5)
        finally:
            stop.set()
            for thread in clients:
                thread.join(timeout=60)
        assert not failures, failures[:3]
        deadline = time.monotonic() + 120
        while replicas() > 1:
            assert time.monotonic() < deadline, "the idle second replica was never removed"
            time.sleep(0.5)
    finally:
        serve.delete(name)


def test_deployment_options_follow_the_scheduler():
    deployment = build_app("smollm2-135m", autoscale=(1, 3), max_batch=8, max_waiting=100, cpus_per_replica=2,
                           dtype="float32")._bound_deployment
    config = deployment._deployment_config
    assert deployment.max_ongoing_requests == 16  # one batch running, one waiting
    assert config.autoscaling_config.target_ongoing_requests == 8  # scale out past one full batch per replica
    assert (config.autoscaling_config.min_replicas, config.autoscaling_config.max_replicas) == (1, 3)
    assert config.max_queued_requests == 300
    assert deployment.ray_actor_options == {"num_cpus": 2, "num_gpus": 0.0}
    assert config.request_router_config.request_router_class.endswith("SessionAffinityRouter")
    fixed = build_app("smollm2-135m", replicas=2, session_affinity=False)._bound_deployment
    assert fixed.num_replicas == 2
    assert not fixed._deployment_config.request_router_config.request_router_class.endswith("SessionAffinityRouter")


def test_replica_limits_and_bad_options():
    assert replica_limits(16, 256) == (32, 16)
    assert replica_limits(4, 2) == (6, 4)
    with pytest.raises(InvalidRequestError, match="replicas"):
        build_app("smollm2-135m", replicas=0)
    with pytest.raises(InvalidRequestError, match="autoscale"):
        build_app("smollm2-135m", autoscale=(3, 2))
    with pytest.raises(InvalidRequestError, match="served_model_name"):
        build_app(tiny_serving_model)
    with pytest.raises(Exception, match="unknown"):
        build_app("smollm2-135m", method="no-such-method")
    with pytest.raises(Exception, match="unknown dtype"):
        build_app("smollm2-135m", dtype="float8")
    with pytest.raises(Exception, match="unknown weights"):
        build_app("smollm2-135m", weights="q3_k")
    assert build_app("smollm2-135m", weights="q8_0") is not None
    with pytest.raises(InvalidRequestError, match="load options"):
        build_app(tiny_serving_model, served_model_name=MODEL, dtype="float32")
    with pytest.raises(Exception, match="torch_compile .*CUDA"):
        build_app("smollm2-135m", torch_compile=True)
    with pytest.raises(InvalidRequestError, match="gpus_per_replica"):
        build_app("smollm2-135m", device="cuda")
    with pytest.raises(InvalidRequestError, match="API key is empty"):
        build_app("smollm2-135m", api_key="  ")
    with pytest.raises(InvalidRequestError, match="protect_metrics"):
        build_app("smollm2-135m", protect_metrics=True)
    assert build_app("smollm2-135m", api_key="sk-key", protect_metrics=True) is not None
    with pytest.raises(InvalidRequestError, match="apply with autoscale"):
        build_app("smollm2-135m", autoscaling_options={"upscale_delay_s": 1})
    with pytest.raises(InvalidRequestError, match="unknown autoscaling options"):
        build_app("smollm2-135m", autoscale=(1, 2), autoscaling_options={"upscale_delay": 1})
    with pytest.raises(InvalidRequestError, match="downscale_delay_s"):
        build_app("smollm2-135m", autoscale=(1, 2), autoscaling_options={"downscale_delay_s": -1})
