"""``draftwise serve --ray`` started as a user starts it, in its own process: it starts a local Ray instance, serves a
GGUF file through Serve's proxy, answers the openai client, and on Ctrl-C takes the application and Ray down and
exits 0. (After ``test_ray.py``, whose Ray instance has ended by then.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from gguf_files import TINY_QWEN, write_random_gguf
from servers import free_port

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow


def test_serve_ray_starts_serves_and_stops_as_a_user_runs_it(tmp_path):
    import openai

    path = write_random_gguf(tmp_path / "model.gguf", TINY_QWEN, "Q4_0")
    port = free_port()
    command = [sys.executable, "-m", "draftwise.cli", "serve", "--ray", "--model", str(path), "--threads", "1",
               "--max-batch", "2", "--port", str(port), "--cache-dir", str(tmp_path / "cache")]
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - read back at the end
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                               start_new_session=True)

    def output() -> str:
        log.flush()
        return (tmp_path / "serve.log").read_text()[-4000:]

    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, f"serve --ray exited early:\n{output()}"
            assert time.monotonic() < deadline, f"serve --ray never became healthy:\n{output()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        assert [model.id for model in client.models.list().data] == [str(path)]
        answer = client.completions.create(model=str(path), prompt="hello", max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "length"
        assert "on Ray Serve" in output()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0, output()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        log.close()
