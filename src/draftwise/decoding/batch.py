"""Continuous batching: sequences join between steps and leave as they finish, all running sequences verified in
one forward per step.

Every sequence keeps its own draft tree, its own accepted length and its own KV cache: no sequence ever sees another's
keys, and on a target whose products are batch invariant (the lean backend) every sequence's tokens are exactly the
ones it would get decoded alone. The tree sizes of a step are chosen for the forward as a whole
(:func:`~draftwise.decoding.policy.size_trees`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from ..errors import InvalidRequestError
from .engine import Decoder, SequenceState, StepEvent

#: Sequences decoded at once unless told otherwise.
DEFAULT_MAX_BATCH = 16


class Scheduler:
    """Runs submitted sequences through a :class:`~draftwise.decoding.engine.Decoder`, at most ``max_batch`` at a
    time; the others wait in order of submission.

    Args:
        decoder: the decoder (its target, draft budget and latency model).
        max_batch: most sequences in one forward.
    """

    def __init__(self, decoder: Decoder, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidRequestError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.decoder = decoder
        self.max_batch = max_batch
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []

    def submit(self, sequences: SequenceState | Iterable[SequenceState]) -> None:
        """Queue sequences (started with :meth:`Decoder.start`); they join the batch at the next steps."""
        queued = [sequences] if isinstance(sequences, SequenceState) else list(sequences)
        now = time.perf_counter()
        for sequence in queued:
            sequence.submitted = now
        self.waiting.extend(queued)

    def cancel(self, sequence: SequenceState) -> None:
        """Drop a sequence, waiting or running (its slot is free at the next step)."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing running."""
        return not self.waiting and not self.running

    def step(self) -> list[tuple[SequenceState, StepEvent]]:
        """Admit waiting sequences into free slots (their prefill emits their first token) and run one step of
        those already running; finished sequences leave. Returns each sequence's event of this step."""
        running = [sequence for sequence in self.running if not sequence.finished]
        admitted = []
        while self.waiting and len(running) + len(admitted) < self.max_batch:
            admitted.append(self.waiting.popleft())
        events: list[tuple[SequenceState, StepEvent]] = []
        if running:
            events += zip(running, self.decoder.step(running))
        if admitted:
            events += zip(admitted, self.decoder.prefill(admitted))
        self.running = [sequence for sequence in running + admitted if not sequence.finished]
        return events
