"""A draftwise server on a thread of the test process, on a free loopback port."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import uvicorn

from draftwise.serve import ServingEngine, create_app

#: The served model name of test servers.
MODEL = "tiny-qwen2"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RunningServer:
    """A uvicorn server on a thread, on a free loopback port."""

    def __init__(self, engine: ServingEngine, default_max_tokens: int = 24, model: str = MODEL,
                 **app_options) -> None:
        self.engine = engine
        self.port = free_port()
        config = uvicorn.Config(create_app(engine, model, default_max_tokens, **app_options), host="127.0.0.1",
                                port=self.port, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.base = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key=app_options.get("api_key") or "none",
                                    max_retries=0, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def post(self, path: str, body: bytes | dict, content_type: str = "application/json") -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.base + path, timeout=30) as response:
            return response.status, response.read().decode()
