"""The serving engine: one continuous-batching decoder on a worker thread, fed by requests from any thread.

Requests are queued (a bounded queue: a full one refuses new requests instead of growing), join the running batch
between steps and leave it as they finish or are cancelled. Each request hears about its tokens through a callback
called on the worker thread after every step that emitted some (the web layer hands them to its event loop).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..api import (
    StopSequences,
    check_logit_bias,
    check_min_new_tokens,
    check_prediction,
    check_request,
    eos_token_ids,
)
from ..backend.target import Target, as_target
from ..decoding.batch import DEFAULT_MAX_BATCH, DEFAULT_MAX_PREFILL_ROWS, Scheduler
from ..decoding.engine import DEFAULT_BUDGET, Decoder, SequenceState
from ..decoding.logprobs import TokenLogprob
from ..decoding.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache
from ..decoding.sampling import SamplingParams
from ..decoding.stats import GenerationStats
from ..drafters import Drafter, make_drafter
from ..drafters.prediction import PredictionDrafter
from ..errors import DraftwiseError, InvalidRequestError, UnsupportedOptionError
from .defaults import DEFAULT_MAX_WAITING
from .metrics import ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


def on_passing_thread(build: Callable[[], T]) -> T:
    """Call ``build`` (say, load a model and make its :class:`ServingEngine`) on a thread that ends with it.

    torch's CPU threads come from OpenMP, which keeps a pool of workers for every thread that has run parallel
    work. While the pools hold more threads than the machine has cores, their workers spin only a moment before
    sleeping, so that every parallel region (every product of a forward) starts by waking one: on two cores a
    16-row product from the engine's thread took 85 us after the main thread had loaded the model, 33 us with no
    other pool, and :func:`draftwise.generate` run on such a thread decoded at two thirds of its speed on the main
    thread. A pool goes with its thread, so loading on a passing thread leaves the engine's thread the only one.
    """
    outcome: Future[T] = Future()

    def run() -> None:
        try:
            outcome.set_result(build())
        except BaseException as error:  # noqa: BLE001 - raised again on the calling thread, by result()
            outcome.set_exception(error)

    # A daemon thread (not an executor's): an interrupt of the caller (Ctrl-C during a long load) ends the process
    # without waiting for it.
    thread = threading.Thread(target=run, name="draftwise-load", daemon=True)
    thread.start()
    thread.join()
    return outcome.result()


def check_prefix_cache_bytes(value: int) -> None:
    """Refuse a prefix cache bound that is not a whole number of bytes >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(f"the prefix cache's size must be a whole number of bytes >= 0 (0: off), not {value!r}")


class ServerBusyError(DraftwiseError):
    """The request queue is full: try again later."""


class EngineStoppedError(ServerBusyError):
    """The engine's worker thread has stopped: this server (replica) serves nothing more."""


@dataclass
class TokenEvent:
    """Tokens one step emitted for a request; at its end, why it finished and its statistics.

    ``finish_reason`` is ``"error"`` (with ``error`` set) when the engine failed; ``logprobs``: the tokens'
    log-probabilities, for a request that asked for them.
    """

    tokens: list[int]
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first tokens, when asked for


@dataclass(eq=False)
class Ticket:
    """A submitted request: what the worker needs to start it, and its sequence once started."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stops: StopSequences | None
    on_event: Callable[[TokenEvent], None]
    eos: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: bool = False
    min_new_tokens: int = 0
    prediction: list[int] | None = None
    submitted: float = field(default_factory=time.perf_counter)
    predicted: PredictionDrafter | None = None  # the request's drafter, with a prediction
    state: SequenceState | None = None
    cancelled: bool = False


class ServingEngine:
    """Runs requests through a :class:`~draftwise.decoding.batch.Scheduler` on a worker thread.

    Args:
        model: the target (from :func:`draftwise.load_model`) or a transformers causal LM.
        tokenizer: its tokenizer.
        method: the decoding method every request runs (a spec such as ``"pld"`` or ``"aded:corpus=..."``); each
            request drafts with a fork of one drafter, so what a learning drafter learns serves every request.
        max_batch: most sequences in one forward.
        max_prefill_rows: most prompt rows prefilled in one step (long prompts are prefilled in pieces between
            decoding steps; see :mod:`draftwise.decoding.batch`).
        max_waiting: most requests waiting for a slot; more are refused with :class:`ServerBusyError`.
        budget: most draft nodes per sequence and step.
        metrics: where counters and histograms go (a fresh registry when ``None``).
        prefix_cache_bytes: most bytes of keys and values kept for prefix caching (prompts and outputs of earlier
            requests reused by later ones that begin the same way, :mod:`draftwise.decoding.prefix_cache`); 0: off.
            Where the target cannot reuse positions bitwise, prefix caching is off (``prefix_caching_off`` says
            why).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        method: str | Drafter = "pld",
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_waiting: int = DEFAULT_MAX_WAITING,
        budget: int = DEFAULT_BUDGET,
        metrics: ServerMetrics | None = None,
        max_prefill_rows: int = DEFAULT_MAX_PREFILL_ROWS,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    ) -> None:
        check_prefix_cache_bytes(prefix_cache_bytes)
        self.target: Target = as_target(model)
        self.tokenizer = tokenizer
        self.method = method if isinstance(method, str) else (method.name or type(method).__name__)
        self.drafter = method if isinstance(method, Drafter) else make_drafter(method)
        #: Why prompts are not reused across requests (``None`` while prefix caching is on).
        self.prefix_caching_off: str | None = None
        prefix_cache = None
        if not prefix_cache_bytes:
            self.prefix_caching_off = "switched off"
        elif not self.target.prefix_caching:
            self.prefix_caching_off = ("this model's prompts are not prefilled as verification rows (prefix caching "
                                       "needs the lean forward with its compiled kernels)")
            logger.warning("prefix caching is off: %s", self.prefix_caching_off)
        else:
            prefix_cache = PrefixCache(prefix_cache_bytes)
        self.decoder = Decoder(self.target, budget=budget, prefix_cache=prefix_cache)
        self.scheduler = Scheduler(self.decoder, max_batch, max_prefill_rows)
        self.max_waiting = max_waiting
        self.eos = eos_token_ids(self.target.model, tokenizer)
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._inbox: queue.SimpleQueue[Ticket | None] = queue.SimpleQueue()
        self._cancelled: queue.SimpleQueue[Ticket] = queue.SimpleQueue()
        self._pending = 0  # submitted, not yet started
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}  # id(state) -> ticket, for running and waiting sequences
        self._seen: dict[int, tuple[int, int, int, list[int]]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        #: Why the worker thread stopped by itself (``None`` while it runs, or when :meth:`stop` stopped it).
        self.stopped_because: str | None = None
        self._prefix_counted = (0, 0)  # the prefix cache's (queried, hit) tokens already in the metrics
        self._paused_counted: dict[str, int] = {}  # the policy's paused steps already in the metrics
        self._rates_exported: dict[tuple[int, bool], Any] = {}  # the measured step rates last exported

    # -- any thread ---------------------------------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.target.context_length

    def check(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Refuse a request the engine cannot serve (see :func:`draftwise.api.check_request`)."""
        check_request(self.context_length, prompt_ids, max_new_tokens, self.decoder.budget)

    def submit(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        on_event: Callable[[TokenEvent], None],
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        min_new_tokens: int = 0,
        prediction_ids: Sequence[int] | None = None,
    ) -> Ticket:
        """Queue a request; ``on_event`` is called on the worker thread with each step's tokens for it
        (``ignore_eos``: go on past end-of-sequence tokens, up to ``max_new_tokens``; ``stop_token_ids``: more
        tokens that end it, kept in the output, as vLLM does, even with ``ignore_eos``; ``logprobs``: every token's
        log-probability comes with it, with that many alternatives; ``prompt_logprobs``: so do the prompt's, with
        the first tokens; ``min_new_tokens``: tokens generated before an end token or a stop sequence may end it;
        ``prediction_ids``: the expected output, drafted beside the method's drafts, as OpenAI's Predicted Outputs).

        Raises:
            InvalidRequestError: a request the engine cannot serve.
            ServerBusyError: the queue is full.
        """
        self.check(prompt_ids, max_new_tokens)
        check_min_new_tokens(min_new_tokens, max_new_tokens)
        check_logit_bias(sampling or SamplingParams(), self.target.config.vocab_size)
        if prediction_ids is not None:
            check_prediction(prediction_ids, self.target.config.vocab_size)
        if prompt_logprobs and (logprobs is None or not self.target.chunked_prefill):
            raise UnsupportedOptionError(
                "the prompt's log-probabilities need logprobs and a model whose prompts are prefilled as verification "
                "rows (the lean forward with its compiled kernels)")
        ticket = Ticket(
            prompt_ids=[int(token) for token in prompt_ids],
            max_new_tokens=max_new_tokens,
            sampling=sampling or SamplingParams(),
            stops=StopSequences(self.tokenizer, list(stop)) if stop else None,
            on_event=on_event,
            eos=(() if ignore_eos else tuple(self.eos)) + tuple(int(token) for token in stop_token_ids),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_new_tokens=min_new_tokens,
            prediction=[int(token) for token in prediction_ids] if prediction_ids else None,
        )
        with self._lock:
            if self.stopped_because is not None:
                raise EngineStoppedError(self.stopped_because)
            if self._pending + len(self.scheduler.waiting) >= self.max_waiting:
                raise ServerBusyError(
                    f"the server is at capacity ({self.max_waiting} requests waiting); retry later"
                )
            self._pending += 1
            self._inbox.put(ticket)  # (under the lock: a dying worker takes it and answers it, or refuses it above)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Drop a request (a client went away); its slot is free at the next step."""
        ticket.cancelled = True
        self._cancelled.put(ticket)
        self._inbox.put(None)  # wake the worker

    def start(self) -> None:
        """Start the worker thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="draftwise-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the worker thread (requests still running get no more events)."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running (a stopped or crashed engine serves nothing)."""
        return self._thread is not None and self._thread.is_alive() and self.stopped_because is None

    @property
    def running(self) -> int:
        """Requests holding a slot: decoding, or having their prompt prefilled."""
        return len(self.scheduler.running) + len(self.scheduler.prefilling)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting) + self._pending

    # -- the worker thread ----------------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            self._loop()
        except BaseException as error:
            # Not a failed step (those are answered and the loop goes on): the thread itself is going (an exit
            # raised in a forward, say). Every request it holds or will never take hears so, none is left hanging;
            # later ones are refused (submit), and /health and Serve's health check see a dead engine.
            logger.critical("the decoding engine's worker thread stopped", exc_info=True)
            with self._lock:
                self.stopped_because = f"the decoding engine stopped: {type(error).__name__}: {error}"
            self._fail_all(self.stopped_because)
            raise

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopping.is_set():
            self._take_inbox(block=self.scheduler.idle)
            self._drop_cancelled()
            if self.scheduler.idle:
                continue
            try:
                events = self.scheduler.step()
            except Exception as error:  # noqa: BLE001 - every request must hear about it, and the server go on
                logger.exception("decoding step failed")
                self._fail_all(f"the engine failed: {type(error).__name__}: {error}")
                continue
            for state, event in events:
                self._deliver(state, event.tokens, event.finish_reason)
            self.metrics.set_load(self.running, self.waiting)
            self._count_prefix_cache()
            self._count_drafting_decisions()

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    self._start(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _start(self, ticket: Ticket) -> None:
        with self._lock:
            self._pending -= 1
        if ticket.cancelled:
            return
        drafter = self.drafter.fork()
        if ticket.prediction:
            drafter = ticket.predicted = PredictionDrafter(drafter, ticket.prediction)
        state = self.decoder.start(
            ticket.prompt_ids,
            drafter,
            max_new_tokens=ticket.max_new_tokens,
            eos_token_ids=ticket.eos,
            is_stopped=ticket.stops,
            sampling=ticket.sampling,
            logprobs=ticket.logprobs,
            prompt_logprobs=ticket.prompt_logprobs,
            min_new_tokens=ticket.min_new_tokens,
        )
        ticket.state = state
        self._tickets[id(state)] = ticket
        self.scheduler.submit(state)
        state.submitted = ticket.submitted

    def _drop_cancelled(self) -> None:
        while True:
            try:
                ticket = self._cancelled.get_nowait()
            except queue.Empty:
                return
            if ticket.state is not None and id(ticket.state) in self._tickets:
                self.scheduler.cancel(ticket.state)
                self._forget(ticket.state)
                self.metrics.request_cancelled()

    def _forget(self, state: SequenceState) -> None:
        self._tickets.pop(id(state), None)
        self._seen.pop(id(state), None)

    def _deliver(self, state: SequenceState, tokens: list[int], finish_reason: str | None) -> None:
        ticket = self._tickets.get(id(state))
        if ticket is None:
            return
        self._count_drafts(state)
        if finish_reason is not None:
            self._forget(state)
            self.metrics.request_finished(state, time.perf_counter() - ticket.submitted)
        try:
            logprobs = None
            if ticket.logprobs is not None:
                logprobs = state.token_logprobs[len(state.token_logprobs) - len(tokens):]
            first = bool(tokens) and len(state.output) == len(tokens)
            ticket.on_event(TokenEvent(list(tokens), finish_reason, state.stats if finish_reason else None,
                                       logprobs=logprobs, prompt_logprobs=state.prompt_logprobs if first else None))
        except Exception:  # noqa: BLE001 - a broken listener must not stop the other requests
            logger.exception("a request's listener failed; cancelling it")
            if finish_reason is None:
                self.scheduler.cancel(state)
                self._forget(state)

    def _count_drafts(self, state: SequenceState) -> None:
        """Add what this sequence drafted and had accepted since its last step to the speculation counters."""
        stats = state.stats
        before = self._seen.get(id(state), (0, 0, 0, []))
        now = (
            stats.drafts,
            stats.drafted_tokens,
            stats.accepted_tokens,
            list(stats.accepts_per_position),
        )
        per_position = [
            count - (before[3][position] if position < len(before[3]) else 0) for position, count in enumerate(now[3])
        ]
        self.metrics.count_drafts(now[0] - before[0], now[1] - before[1], now[2] - before[2], per_position)
        self._seen[id(state)] = now

    def _count_drafting_decisions(self) -> None:
        """Export the drafting policy's pauses since the last step and the measured rates that changed."""
        policy = self.decoder.policy
        paused = {reason: steps - self._paused_counted.get(reason, 0) for reason, steps in policy.paused_steps.items()}
        rates = {}
        for batch_size, state in policy.states.items():
            for drafted in (True, False):
                measured = state.rate(drafted)
                if measured is not None and self._rates_exported.get((batch_size, drafted)) != measured:
                    rates[(batch_size, drafted)] = measured.tokens_per_second
                    self._rates_exported[(batch_size, drafted)] = measured
        if any(paused.values()) or rates:
            self.metrics.count_drafting_decisions(paused, rates)
            self._paused_counted = dict(policy.paused_steps)

    def _count_prefix_cache(self) -> None:
        cache = self.decoder.prefix_cache
        if cache is None:
            return
        queried, hit = self._prefix_counted
        if cache.queried_tokens != queried or cache.hit_tokens != hit:
            self.metrics.count_prefix_cache(cache.queried_tokens - queried, cache.hit_tokens - hit, cache.bytes)
            self._prefix_counted = (cache.queried_tokens, cache.hit_tokens)

    def _fail_all(self, message: str) -> None:
        if self.stopped_because is not None:  # (nothing will take the inbox's requests: they fail too)
            with self._lock:
                self._pending = 0
            try:
                while True:
                    ticket = self._inbox.get_nowait()
                    if ticket is not None and not ticket.cancelled:
                        try:
                            ticket.on_event(TokenEvent([], "error", None, message))
                        except Exception:  # noqa: BLE001
                            logger.exception("a request's listener failed")
            except queue.Empty:
                pass
        for state in [*self.scheduler.running, *self.scheduler.prefilling, *self.scheduler.waiting]:
            ticket = self._tickets.get(id(state))
            self.scheduler.cancel(state)
            self._forget(state)
            if ticket is not None:
                try:
                    ticket.on_event(TokenEvent([], "error", state.stats, message))
                except Exception:  # noqa: BLE001
                    logger.exception("a request's listener failed")
