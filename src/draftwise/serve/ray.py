"""``draftwise serve --ray``: the same server scaled out on Ray Serve (``pip install 'draftwise[ray]'``).

Each replica of one Serve deployment holds one model and one continuous-batching
:class:`~draftwise.serve.engine.ServingEngine` (its worker thread started in the replica's constructor), and serves
the very FastAPI application of single-process ``draftwise serve`` as its ingress: every route, option, error,
streamed event and the ``draftwise`` statistics extension are the same. Ray Serve does the rest: its HTTP proxy,
routing across replicas, back-pressure, autoscaling on ongoing requests, health checks and restarting replicas that
die, on one machine or a Ray cluster.

What draftwise adds on top:

- :class:`SessionAffinityRouter`: requests with the same ``x-session-id`` header (Ray Serve's session header) go to
  the same replica while it has room, so drafters that learn from a conversation (ADED, Token Recycling, the
  retrieval drafters' history) see its earlier turns; other requests get Ray's power-of-two-choices routing.
- :class:`RayServerMetrics`: each replica's counters and histograms exported through Ray's metrics agent as well
  (tagged with deployment, replica and application), next to the replica's own ``/metrics``.
- ``max_ongoing_requests`` sized from the scheduler: a replica holds at most one batch running and one batch
  waiting; beyond that requests wait in Serve's router (and go to whichever replica frees a slot first), and the
  autoscaler targets one full batch per replica.
"""

from __future__ import annotations

import hashlib
import logging
import random
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.request_router import LocalityMixin, PendingRequest, RequestRouter, RunningReplica

from ..decoding.batch import DEFAULT_MAX_BATCH, DEFAULT_MAX_PREFILL_ROWS
from ..decoding.engine import DEFAULT_BUDGET
from ..decoding.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES
from ..errors import InvalidRequestError, ModelLoadError
from ..models import PRESETS, LoadOptions
from .app import create_app
from .defaults import DEFAULT_MAX_TOKENS, DEFAULT_MAX_WAITING
from .engine import ServingEngine, check_prefix_cache_bytes, on_passing_thread
from .metrics import LATENCY_BUCKETS, ServerMetrics

logger = logging.getLogger(__name__)

#: The Serve application's name (``serve status``, metrics tags, ``serve.delete``).
APP_NAME = "draftwise"

#: A zero-argument function a replica calls to get ``(model, tokenizer)``; it must be importable by Ray's workers.
ModelLoader = Callable[[], "tuple[Any, Any]"]


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica loads and how it serves (pickled to every replica).

    Args:
        model: a preset, GGUF file or checkpoint folder (loaded with :func:`draftwise.load_model` and
            ``options``), or a :data:`ModelLoader`.
        served_model_name: the name clients give as ``model``.
        method: the decoding method of every request.
        threads: torch threads per replica (``None``: torch's default, every core of the node).
        options: how a model name is loaded (:class:`~draftwise.models.LoadOptions`; ``None``: the defaults).
        api_key, protect_metrics: who may use the replicas (see :func:`~draftwise.serve.app.create_app`).
    """

    model: str | ModelLoader
    served_model_name: str
    method: str = "pld"
    max_batch: int = DEFAULT_MAX_BATCH
    max_waiting: int = DEFAULT_MAX_WAITING
    budget: int = DEFAULT_BUDGET
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    threads: int | None = None
    max_prefill_rows: int = DEFAULT_MAX_PREFILL_ROWS
    options: LoadOptions | None = None
    api_key: str | None = None
    protect_metrics: bool = False
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES


class RayServerMetrics(ServerMetrics):
    """The server's metrics, also recorded with Ray's metrics API so that Ray's Prometheus export carries every
    replica's numbers (tagged ``deployment``, ``replica``, ``application``).

    Ray refuses ``:`` in metric names, so the exported names are the ``/metrics`` names with ``draftwise_`` for
    ``draftwise:`` (Ray's exporter adds its ``ray_`` prefix): ``draftwise:spec_decode_num_drafts`` is
    ``ray_draftwise_spec_decode_num_drafts``.
    """

    def __init__(self) -> None:
        super().__init__()
        from ray.serve import metrics as serve_metrics

        self._failed = False

        def name(short: str) -> str:
            return "draftwise_" + short

        def counter(short: str, documentation: str, tags: tuple[str, ...] = ()) -> Any:
            return serve_metrics.Counter(name(short), documentation, tag_keys=tags)

        def histogram(short: str, documentation: str) -> Any:
            return serve_metrics.Histogram(name(short), documentation, boundaries=list(LATENCY_BUCKETS))

        self._ray = {
            "drafts": counter("spec_decode_num_drafts", "Draft proposals verified."),
            "draft_tokens": counter("spec_decode_num_draft_tokens", "Draft tokens verified."),
            "accepted": counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
            "per_position": counter("spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted draft tokens by draft position (0-based).", ("position",)),
            "requests": counter("request_success", "Finished requests by finish reason.", ("finished_reason",)),
            "cancelled": counter("request_cancelled", "Requests dropped before they finished."),
            "refused": counter("request_refused", "Requests refused because the queue was full."),
            "prompt_tokens": counter("prompt_tokens", "Prompt tokens of finished requests."),
            "generation_tokens": counter("generation_tokens", "Tokens generated for finished requests."),
            "e2e": histogram("e2e_request_latency_seconds", "Seconds from arrival to the last token."),
            "first_token": histogram("time_to_first_token_seconds", "Seconds from arrival to the first token."),
            "queue": histogram("request_queue_time_seconds", "Seconds waiting for a slot in the batch."),
            "prefix_queries": counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            "prefix_hits": counter("prefix_cache_hits", "Prompt tokens restored from the prefix cache."),
            "prefix_bytes": serve_metrics.Gauge(name("prefix_cache_usage_bytes"),
                                                "Bytes of keys and values in the prefix cache."),
            "paused_steps": counter("drafting_paused_steps", "Batch steps run without asking the drafters, by reason.",
                                    ("reason",)),
            "step_rates": serve_metrics.Gauge(name("step_tokens_per_second"),
                                              "Measured tokens per second of batch steps with drafts and without.",
                                              tag_keys=("batch_size", "drafts")),
            "running": serve_metrics.Gauge(name("num_requests_running"), "Requests in the running batch."),
            "waiting": serve_metrics.Gauge(name("num_requests_waiting"), "Requests waiting for a slot."),
        }

    def _export(self, record: Callable[[], None]) -> None:
        """Run one recording into Ray's metrics; a failure there is logged once and never reaches the engine's
        worker thread (which calls these methods between decoding steps)."""
        try:
            record()
        except Exception:  # metrics must not stop decoding
            if not self._failed:
                self._failed = True
                logger.exception("recording draftwise metrics with Ray failed; the replica's /metrics still counts")

    def count_drafts(self, drafts: int, draft_tokens: int, accepted: int, accepted_per_position: Any) -> None:
        super().count_drafts(drafts, draft_tokens, accepted, accepted_per_position)

        def record() -> None:
            for key, value in (("drafts", drafts), ("draft_tokens", draft_tokens), ("accepted", accepted)):
                if value:
                    self._ray[key].inc(value)
            for position, count in enumerate(accepted_per_position):
                if count:
                    self._ray["per_position"].inc(count, tags={"position": str(position)})

        self._export(record)

    def request_finished(self, state: Any, seconds: float) -> None:
        super().request_finished(state, seconds)

        def record() -> None:
            stats = state.stats
            self._ray["requests"].inc(1, tags={"finished_reason": state.finish_reason or "length"})
            if state.prompt_ids:
                self._ray["prompt_tokens"].inc(len(state.prompt_ids))
            if state.output:
                self._ray["generation_tokens"].inc(len(state.output))
            self._ray["e2e"].observe(seconds)
            self._ray["first_token"].observe(stats.queue_time_s + stats.time_to_first_token_s)
            self._ray["queue"].observe(stats.queue_time_s)

        self._export(record)

    def count_drafting_decisions(self, paused_steps: dict[str, int], rates: dict[tuple[int, bool], float]) -> None:
        super().count_drafting_decisions(paused_steps, rates)

        def record() -> None:
            for reason, steps in paused_steps.items():
                if steps:
                    self._ray["paused_steps"].inc(steps, tags={"reason": reason})
            for (batch_size, drafted), rate in rates.items():
                self._ray["step_rates"].set(rate, tags={"batch_size": str(batch_size), "drafts": "yes" if drafted else "no"})

        self._export(record)

    def count_prefix_cache(self, queried: int, hit: int, usage_bytes: int) -> None:
        super().count_prefix_cache(queried, hit, usage_bytes)

        def record() -> None:
            if queried:
                self._ray["prefix_queries"].inc(queried)
            if hit:
                self._ray["prefix_hits"].inc(hit)
            self._ray["prefix_bytes"].set(usage_bytes)

        self._export(record)

    def request_cancelled(self) -> None:
        super().request_cancelled()
        self._export(lambda: self._ray["cancelled"].inc(1))

    def request_refused(self) -> None:
        super().request_refused()
        self._export(lambda: self._ray["refused"].inc(1))

    def set_load(self, running: int, waiting: int) -> None:
        super().set_load(running, waiting)

        def record() -> None:
            self._ray["running"].set(running)
            self._ray["waiting"].set(waiting)

        self._export(record)


class DraftwiseReplica:
    """One replica: one model, one serving engine (started here), the FastAPI app of ``draftwise serve``."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import torch

        if spec.threads:
            torch.set_num_threads(spec.threads)

        def build() -> ServingEngine:
            if callable(spec.model):
                target, tokenizer = spec.model()
            else:
                from ..models import load_model

                target, tokenizer = load_model(spec.model, spec.options, progress=False)
            if tokenizer is None:
                raise InvalidRequestError(f"{spec.served_model_name} has no tokenizer: the server needs one")
            return ServingEngine(target, tokenizer, spec.method, max_batch=spec.max_batch,
                                 max_waiting=spec.max_waiting, budget=spec.budget, metrics=RayServerMetrics(),
                                 max_prefill_rows=spec.max_prefill_rows, prefix_cache_bytes=spec.prefix_cache_bytes)

        self.spec = spec
        # (torch's work then runs on the engine's thread alone: see on_passing_thread)
        self.engine = on_passing_thread(build)
        self.engine.start()

    def __serve_build_asgi_app__(self) -> Any:
        replica = serve.get_replica_context().replica_tag  # the `replica` tag of Ray's metrics too
        return create_app(self.engine, self.spec.served_model_name, self.spec.default_max_tokens,
                          manage_engine=False, replica=replica, api_key=self.spec.api_key,
                          protect_metrics=self.spec.protect_metrics)

    def check_health(self) -> None:
        """Serve's health check: a replica whose decoding thread has died is replaced."""
        if not self.engine.alive:
            raise RuntimeError("the decoding engine's worker thread is not running")

    def __del__(self) -> None:
        # Stops the worker thread (joins it: at most one decoding step) when Serve takes the replica down.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


def _rendezvous_weight(session: str, replica: RunningReplica) -> int:
    """Highest-random-weight hashing: stable across processes, and a replica that goes moves only its sessions."""
    digest = hashlib.blake2b(f"{session}\0{replica.replica_id.unique_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class SessionAffinityRouter(LocalityMixin, RequestRouter):
    """Ray Serve request router: a session's requests (``x-session-id`` header) go to one replica by rendezvous
    hashing while it accepts them (it is not at ``max_ongoing_requests``), otherwise to the least loaded other one;
    requests without a session get the power of two choices among the replicas Ray's locality rules prefer.

    Each chosen replica goes to the request it was chosen for (no FIFO hand-over, which would give one session's
    replica to another request).
    """

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        session = pending_request.metadata.session_id if pending_request is not None else ""
        if session:
            # Every replica is a candidate on every try: when all are full, back off before probing again.
            pending_request.routing_context.should_backoff = True
            ranked = sorted(candidate_replicas, key=lambda replica: _rendezvous_weight(session, replica),
                            reverse=True)
            return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]
        preferred = self.apply_locality_routing(pending_request=pending_request)
        pool = [replica for replica in candidate_replicas if replica.replica_id in preferred] or candidate_replicas
        return [random.sample(pool, min(2, len(pool)))]


def _check_model(model: str | ModelLoader) -> None:
    """Refuse, before any replica starts, a model name every replica would fail on."""
    if isinstance(model, str) and model not in PRESETS and not Path(model).expanduser().exists():
        raise ModelLoadError(f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}) nor a path here (on a "
                             "cluster, give a path that exists on every node, this one included)")


def replica_limits(max_batch: int, max_waiting: int) -> tuple[int, int]:
    """``(max_ongoing_requests, target_ongoing_requests)`` of a replica: one batch running and at most one waiting
    in the replica (more wait in Serve's router for whichever replica frees first); autoscale at one full batch."""
    return max_batch + min(max_waiting, max_batch), max_batch


def build_app(
    model: str | ModelLoader,
    *,
    served_model_name: str | None = None,
    method: str = "pld",
    replicas: int = 1,
    autoscale: tuple[int, int] | None = None,
    autoscaling_options: dict[str, Any] | None = None,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
    threads: int | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_waiting: int = DEFAULT_MAX_WAITING,
    budget: int = DEFAULT_BUDGET,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    max_prefill_rows: int = DEFAULT_MAX_PREFILL_ROWS,
    session_affinity: bool = True,
    health_check_period_s: float = 5.0,
    api_key: str | None = None,
    protect_metrics: bool = False,
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    options: LoadOptions | None = None,
    **load_options: Any,
) -> serve.Application:
    """The Ray Serve application of ``draftwise serve``: run it with ``serve.run(app)``.

    Args:
        model: a preset, GGUF file or checkpoint folder, or a zero-argument function returning
            ``(model, tokenizer)`` that Ray's workers can import.
        served_model_name: the name clients give as ``model`` (default: ``model`` when it is a string).
        method: the decoding method every request runs.
        replicas: a fixed number of replicas (ignored with ``autoscale``).
        autoscale: ``(min_replicas, max_replicas)``: Serve adds replicas while each has more than one batch of
            ongoing requests, and removes idle ones.
        autoscaling_options: more fields of Serve's ``AutoscalingConfig`` with ``autoscale`` (say
            ``{"upscale_delay_s": 5, "downscale_delay_s": 60, "look_back_period_s": 10}``; Serve's defaults: 30, 600
            and 30 seconds).
        cpus_per_replica, gpus_per_replica: Ray resources each replica reserves.
        threads: torch threads per replica (default: ``cpus_per_replica`` rounded, at least 1).
        max_batch, max_waiting, budget, default_max_tokens, max_prefill_rows, prefix_cache_bytes: as for
            ``draftwise serve`` (:class:`~draftwise.serve.engine.ServingEngine`);
            ``max_waiting`` also bounds the requests queued in Serve's router per replica (more are answered 503).
        session_affinity: route by the ``x-session-id`` header (:class:`SessionAffinityRouter`); otherwise Ray's
            default power-of-two-choices routing.
        health_check_period_s: how often Serve calls each replica's health check.
        api_key: requests must carry ``Authorization: Bearer <api_key>`` (``/health`` stays open, and ``/metrics``
            unless ``protect_metrics``); ``None``: anyone who reaches Serve's proxy may use the replicas.
        options: how each replica loads a model name (:class:`~draftwise.models.LoadOptions`, checked here, before
            any replica starts); ``load_options``: any of its fields as keywords instead or on top. A loader
            function loads the model itself, and takes none.
    """
    if replicas < 1:
        raise InvalidRequestError("replicas must be at least 1")
    if autoscale is not None and not (0 <= autoscale[0] <= autoscale[1] and autoscale[1] >= 1):
        raise InvalidRequestError("autoscale needs 0 <= min replicas <= max replicas and max replicas >= 1")
    if min(max_batch, max_waiting, default_max_tokens, max_prefill_rows) < 1:
        raise InvalidRequestError("max_batch, max_waiting, max_prefill_rows and default_max_tokens must be positive")
    check_prefix_cache_bytes(prefix_cache_bytes)
    if autoscaling_options and autoscale is None:
        raise InvalidRequestError("autoscaling_options apply with autoscale")
    fields = getattr(AutoscalingConfig, "model_fields", None) or AutoscalingConfig.__fields__
    unknown = sorted(set(autoscaling_options or {}) - set(fields))
    if unknown:
        raise InvalidRequestError(f"unknown autoscaling options {unknown} (Serve's AutoscalingConfig has "
                                  f"{sorted(fields)})")
    if budget < 0 or cpus_per_replica <= 0 or gpus_per_replica < 0 or (threads is not None and threads < 1):
        raise InvalidRequestError("budget and gpus_per_replica must be >= 0, cpus_per_replica and threads positive")
    if (options is not None or load_options) and not isinstance(model, str):
        raise InvalidRequestError("load options apply to a model name; a loader function loads the model itself")
    options = LoadOptions.of(options, **load_options) if isinstance(model, str) else None
    if options is not None and options.device.startswith("cuda") and gpus_per_replica == 0:
        raise InvalidRequestError("a CUDA device needs gpus_per_replica > 0 (Ray gives a replica only the GPUs it "
                                  "reserves)")
    if options is not None and options.torch_compile and gpus_per_replica == 0:
        raise ModelLoadError("torch_compile compiles the GPU's fixed-shape step: it needs a CUDA device, which a "
                             "replica gets only with gpus_per_replica > 0")
    _check_model(model)
    if api_key is not None and not api_key.strip():
        raise InvalidRequestError("the API key is empty")
    if protect_metrics and api_key is None:
        raise InvalidRequestError("protect_metrics asks for the API key on /metrics: give an api_key")
    if served_model_name is None:
        if not isinstance(model, str):
            raise InvalidRequestError("served_model_name is required when the model comes from a loader function")
        served_model_name = model
    from ..drafters import check_method

    check_method(method)
    spec = ReplicaSpec(model=model, served_model_name=served_model_name, method=method, max_batch=max_batch,
                       max_waiting=max_waiting, budget=budget, default_max_tokens=default_max_tokens,
                       max_prefill_rows=max_prefill_rows,
                       threads=threads or max(1, round(cpus_per_replica)), options=options, api_key=api_key,
                       protect_metrics=protect_metrics, prefix_cache_bytes=prefix_cache_bytes)
    max_ongoing, target_ongoing = replica_limits(max_batch, max_waiting)
    deployment_options: dict[str, Any] = {
        "name": "DraftwiseReplica",
        "ray_actor_options": {"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        "max_ongoing_requests": max_ongoing,
        "max_queued_requests": max_waiting * (autoscale[1] if autoscale else replicas),
        "health_check_period_s": health_check_period_s,
    }
    if autoscale is not None:
        settings = {"min_replicas": autoscale[0], "initial_replicas": max(autoscale[0], 1),
                    "max_replicas": autoscale[1], "target_ongoing_requests": target_ongoing,
                    **(autoscaling_options or {})}
        try:
            deployment_options["autoscaling_config"] = AutoscalingConfig(**settings)
        except (TypeError, ValueError) as error:
            raise InvalidRequestError(f"autoscaling options {autoscaling_options}: {error}") from None
    else:
        deployment_options["num_replicas"] = replicas
    if session_affinity:
        deployment_options["request_router_config"] = RequestRouterConfig(request_router_class=SessionAffinityRouter)
    deployment = serve.deployment(serve.ingress()(DraftwiseReplica)).options(**deployment_options)
    return deployment.bind(spec)


def run(app: serve.Application, *, address: str | None = None, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Start (or join, with ``address``: ``"auto"`` or ``"ray://head:10001"``) a Ray cluster, serve ``app`` on
    ``http://host:port`` (Serve's proxy; one per node that runs replicas) until interrupted, then take the
    application down (and the local Ray instance, when this call started it)."""
    stop = threading.Event()
    previous: dict[int, Any] = {}
    started_here = not ray.is_initialized()
    try:
        if started_here:
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        serve.start(http_options={"host": host, "port": port})
        # From here Ctrl-C (and a termination request) set an event the call waits on instead of raising wherever
        # the main thread is: raised inside Serve's own deploying calls, an interrupt was once swallowed there and the
        # process served on. Off the main thread, signals stay as they are.
        if threading.current_thread() is threading.main_thread():
            previous = {number: signal.signal(number, lambda *_: stop.set()) for number in (signal.SIGINT, signal.SIGTERM)}
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if started_here and address is None:
            serve.shutdown()  # the local instance is ours: all of it goes
        else:
            serve.delete(APP_NAME)  # a shared cluster keeps its other applications
        if started_here:
            ray.shutdown()
