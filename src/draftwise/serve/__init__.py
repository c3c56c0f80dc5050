"""``draftwise serve``: an OpenAI-compatible server on the continuous-batching decoder.

- :mod:`.engine`: the decoder on a worker thread, a bounded request queue, cancellation.
- :mod:`.protocol`: the OpenAI request bodies and what every option becomes (or why it is refused).
- :mod:`.app`: the FastAPI application: completions, chat completions, streaming, models, health, metrics.
- :mod:`.metrics`: Prometheus counters (vLLM's speculation names) and latency histograms.
- :mod:`.load`: a bounded load test against a running server.
"""

from .app import create_app
from .engine import ServerBusyError, ServingEngine
from .metrics import ServerMetrics

__all__ = ["ServerBusyError", "ServerMetrics", "ServingEngine", "create_app"]
