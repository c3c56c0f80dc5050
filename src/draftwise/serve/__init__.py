"""``draftwise serve``: an OpenAI-compatible server on the continuous-batching decoder.

- :mod:`.engine`: the decoder on a worker thread, a bounded request queue, cancellation.
- :mod:`.protocol`: the OpenAI request bodies and what every option becomes (or why it is refused).
- :mod:`.app`: the FastAPI application: completions, chat completions, streaming, models, health, metrics.
- :mod:`.metrics`: Prometheus counters (vLLM's speculation names) and latency histograms.
- :mod:`.load`: a bounded load test against a running server.
- :mod:`.defaults`: the server's defaults (readable without the server's extra installed).

The names below are imported when first used, so that :mod:`.defaults` and :mod:`.load` need no FastAPI.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"create_app": ".app", "ServerBusyError": ".engine", "ServingEngine": ".engine",
            "ServerMetrics": ".metrics"}

__all__ = ["ServerBusyError", "ServerMetrics", "ServingEngine", "create_app"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
