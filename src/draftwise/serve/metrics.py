"""Prometheus metrics of the server, named as vLLM names its speculation counters (``draftwise:`` instead of
``vllm:``), so existing dashboards need only the prefix changed.

- ``draftwise:spec_decode_num_drafts``: draft proposals verified (steps with a draft on offer).
- ``draftwise:spec_decode_num_draft_tokens``: draft tokens verified.
- ``draftwise:spec_decode_num_accepted_tokens``: draft tokens accepted.
- ``draftwise:spec_decode_num_accepted_tokens_per_pos{position}``: accepted draft tokens by depth (0-based).
  Mean acceptance length = 1 + accepted tokens / drafts.
- ``draftwise:prefix_cache_queries`` and ``draftwise:prefix_cache_hits``: prompt tokens looked up in the prefix
  cache, and of those the tokens restored from it (vLLM's names; hit rate = hits / queries);
  ``draftwise:prefix_cache_usage_bytes``: bytes of keys and values it holds.
- ``draftwise:drafting_paused_steps{reason}``: batch steps run without asking the drafters, by why drafting was
  paused (``cost``, ``throughput``, ``measuring``: :data:`~draftwise.decoding.policy.PAUSE_REASONS`), and
  ``draftwise:step_tokens_per_second{batch_size, drafts}``: the measured rates the throughput judge compares, of steps
  with drafts (``drafts="yes"``) and without, per batch size.
- request counters and token counters, request latency histograms (end to end, time to first token, time in queue),
  and gauges of running and waiting requests.

Each server has its own registry: two servers in one process never mix their numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..decoding.engine import SequenceState

#: Latency buckets in seconds (requests of a few tokens to a few thousand).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    """The server's counters, gauges and histograms in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        prefix = "draftwise:"

        def counter(name: str, documentation: str, labels: Sequence[str] = ()) -> Any:
            return Counter(prefix + name, documentation, labels, registry=self.registry)

        def histogram(name: str, documentation: str) -> Any:
            return Histogram(prefix + name, documentation, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.num_drafts = counter("spec_decode_num_drafts", "Draft proposals verified.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_position = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position (0-based).", ["position"]
        )
        self.requests = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.cancelled = counter("request_cancelled", "Requests dropped before they finished (client went away).")
        self.refused = counter("request_refused", "Requests refused because the queue was full.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests.")
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Seconds from arrival to the last token.")
        self.first_token = histogram("time_to_first_token_seconds", "Seconds from arrival to the first token.")
        self.queue_time = histogram("request_queue_time_seconds", "Seconds waiting for a slot in the batch.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens restored from the prefix cache.")
        self.prefix_bytes = Gauge(prefix + "prefix_cache_usage_bytes", "Bytes of keys and values in the prefix cache.",
                                  registry=self.registry)
        self.paused_steps = counter("drafting_paused_steps", "Batch steps run without asking the drafters, by reason.",
                                    ["reason"])
        self.step_rates = Gauge(prefix + "step_tokens_per_second",
                                "Measured tokens per second of batch steps with drafts and without, per batch size.",
                                ["batch_size", "drafts"], registry=self.registry)
        self.running = Gauge(prefix + "num_requests_running", "Requests in the running batch.", registry=self.registry)
        self.waiting = Gauge(prefix + "num_requests_waiting", "Requests waiting for a slot.", registry=self.registry)

    def count_drafts(self, drafts: int, draft_tokens: int, accepted: int, accepted_per_position: Sequence[int]) -> None:
        """Add one step's speculation counts of one sequence."""
        if drafts:
            self.num_drafts.inc(drafts)
        if draft_tokens:
            self.num_draft_tokens.inc(draft_tokens)
        if accepted:
            self.num_accepted_tokens.inc(accepted)
        for position, count in enumerate(accepted_per_position):
            if count:
                self.accepted_per_position.labels(position=str(position)).inc(count)

    def request_finished(self, state: SequenceState, seconds: float) -> None:
        stats = state.stats
        self.requests.labels(finished_reason=state.finish_reason or "length").inc()
        self.prompt_tokens.inc(len(state.prompt_ids))
        self.generation_tokens.inc(len(state.output))
        self.e2e_latency.observe(seconds)
        self.first_token.observe(stats.queue_time_s + stats.time_to_first_token_s)
        self.queue_time.observe(stats.queue_time_s)

    def count_prefix_cache(self, queried: int, hit: int, usage_bytes: int) -> None:
        """Add prompt tokens looked up and restored since the last call; set the cache's size."""
        if queried:
            self.prefix_queries.inc(queried)
        if hit:
            self.prefix_hits.inc(hit)
        self.prefix_bytes.set(usage_bytes)

    def count_drafting_decisions(self, paused_steps: dict[str, int], rates: dict[tuple[int, bool], float]) -> None:
        """Add batch steps run without drafting since the last call (by reason); set the measured step rates (by
        batch size and whether the steps drafted)."""
        for reason, steps in paused_steps.items():
            if steps:
                self.paused_steps.labels(reason=reason).inc(steps)
        for (batch_size, drafted), rate in rates.items():
            self.step_rates.labels(batch_size=str(batch_size), drafts="yes" if drafted else "no").set(rate)

    def request_cancelled(self) -> None:
        self.cancelled.inc()

    def request_refused(self) -> None:
        self.refused.inc()

    def set_load(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
