"""A serving engine whose worker thread stops by itself (not a failed step, which is answered and survived): every
request it held or had queued ends with an error that says so, later requests are refused with a 503, and
``/health`` answers 503, which is what Ray Serve's health check and load balancers act on."""

from __future__ import annotations

import threading
import time
import urllib.error

import openai
import pytest
from servers import MODEL, RunningServer
from tiny import ChatCharTokenizer, make_tiny_model

from draftwise.backend.calibration.invariance import plan_rows
from draftwise.backend.calibration.machine import MeasurementStore
from draftwise.backend.forward.lean import LeanTarget
from draftwise.serve import ServingEngine
from draftwise.serve.engine import EngineStoppedError


def poisoned(target: LeanTarget, ready: threading.Event, after: int = 60) -> LeanTarget:
    """``target`` whose forward takes 5 ms more once ``ready`` is set, and raises ``SystemExit`` (as an exit called
    deep in a library would) at the ``after``-th forward from then."""
    forward = target.forward
    count = 0

    def checked(caches, blocks, **options):
        nonlocal count
        if ready.is_set():
            count += 1
            if count == after:
                raise SystemExit("a library called exit")
            time.sleep(0.005)
        return forward(caches, blocks, **options)

    target.forward = checked
    return target


@pytest.fixture
def target(tmp_path):
    lean = LeanTarget(make_tiny_model("qwen2", seed=0))
    plan_rows(lean, MeasurementStore(tmp_path))
    return lean


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the exit, raised on)
def test_a_stopped_engine_ends_every_request_with_a_clear_error(target):
    ready = threading.Event()
    engine = ServingEngine(poisoned(target, ready), ChatCharTokenizer(), "ar", max_batch=1)
    running = RunningServer(engine)
    try:
        client = running.client
        assert client.completions.create(model=MODEL, prompt="ĀāĂ", max_tokens=4, temperature=0).choices[0].text
        outcomes: dict[str, object] = {}

        def ask(name: str, prompt: list[int], max_tokens: int) -> None:
            try:
                outcomes[name] = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                           temperature=0)
            except openai.APIError as error:
                outcomes[name] = error

        ready.set()
        # One decoding (its steps take 5 ms), two waiting for its slot, when the thread stops at the 60th step.
        threads = [threading.Thread(target=ask, args=(name, prompt, max_tokens))
                   for name, prompt, max_tokens in (("decoding", [3, 4, 5, 6] * 4, 200), ("waiting", [9, 8, 7] * 3, 8),
                                                    ("waiting too", [5, 4] * 5, 8))]
        for thread in threads:
            thread.start()
            time.sleep(0.05)
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads), "a request was left hanging"
        assert set(outcomes) == {"decoding", "waiting", "waiting too"}
        for name, outcome in outcomes.items():
            assert isinstance(outcome, openai.APIStatusError), (name, outcome)
            assert outcome.status_code in (500, 503) and "engine stopped" in str(outcome), (name, outcome)
        assert not engine.alive and "SystemExit: a library called exit" in engine.stopped_because
        with pytest.raises(urllib.error.HTTPError) as health:
            running.get("/health")
        assert health.value.code == 503 and "engine_dead" in health.value.read().decode()
        with pytest.raises(openai.APIStatusError, match="engine stopped") as refused:
            client.completions.create(model=MODEL, prompt="Āā", max_tokens=4)
        assert refused.value.status_code == 503
        with pytest.raises(EngineStoppedError):
            engine.submit([1, 2, 3], 4, lambda event: None)
    finally:
        running.stop()
