"""Continuous batching: sequences join between steps and leave as they finish, all running sequences verified in
one forward per step.

With ``max_prefill_rows`` set (the server sets it), prompts are prefilled in that same forward where the target
allows it (``Target.chunked_prefill``): each step takes at most ``max_prefill_rows`` prompt rows, oldest prompt
first, so a long prompt is prefilled in pieces over several steps while the running sequences go on decoding, and
several short prompts share one forward. Every piece's rows are bitwise the rows of the same prompt prefilled
alone; with the decoder's prefix cache a prompt starts from the cached blocks it begins with
(:mod:`~draftwise.decoding.prefix_cache`), the same bits again. Otherwise a newly admitted prompt is prefilled whole,
in its own forward, in the step that admits it.

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
#: Most prompt rows prefilled in one step by the server unless told otherwise: a step then costs at most that many
#: rows more than its decoding (vLLM's ``max_num_batched_tokens``, counted without the decoding rows).
DEFAULT_MAX_PREFILL_ROWS = 256


class Scheduler:
    """Runs submitted sequences through a :class:`~draftwise.decoding.engine.Decoder`, at most ``max_batch`` at a
    time; the others wait in order of submission.

    Args:
        decoder: the decoder (its target, draft budget and latency model).
        max_batch: most sequences in one forward (those being prefilled included).
        max_prefill_rows: most prompt rows prefilled in one step (see the module docstring; ``None``, the default:
            each admitted prompt whole, in its own forward); smaller keeps the running sequences' steps shorter,
            larger brings first tokens sooner when many prompts arrive at once.
    """

    def __init__(
        self, decoder: Decoder, max_batch: int = DEFAULT_MAX_BATCH, max_prefill_rows: int | None = None
    ) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidRequestError(f"max_batch must be a positive integer, got {max_batch!r}")
        if max_prefill_rows is not None and (not isinstance(max_prefill_rows, int) or max_prefill_rows < 1):
            raise InvalidRequestError(f"max_prefill_rows must be a positive integer, got {max_prefill_rows!r}")
        self.decoder = decoder
        self.max_batch = max_batch
        self.max_prefill_rows = max_prefill_rows
        self.waiting: deque[SequenceState] = deque()
        self.prefilling: list[SequenceState] = []
        self.running: list[SequenceState] = []

    def submit(self, sequences: SequenceState | Iterable[SequenceState]) -> None:
        """Queue sequences (started with :meth:`Decoder.start`); they join the batch at the next steps."""
        queued = [sequences] if isinstance(sequences, SequenceState) else list(sequences)
        now = time.perf_counter()
        for sequence in queued:
            sequence.submitted = now
        self.waiting.extend(queued)

    def cancel(self, sequence: SequenceState) -> None:
        """Drop a sequence, waiting, being prefilled or running (its slot is free at the next step)."""
        for queue in (self.running, self.prefilling, self.waiting):
            if sequence in queue:
                queue.remove(sequence)
                return

    @property
    def idle(self) -> bool:
        """Nothing waiting, being prefilled or running."""
        return not self.waiting and not self.prefilling and not self.running

    def step(self) -> list[tuple[SequenceState, StepEvent]]:
        """Admit waiting sequences into free slots, run one step of those already running with the next pieces of
        the prompts being prefilled (a prompt's last piece emits its first token); finished sequences leave.
        Returns the event of this step of each sequence that has emitted its first token."""
        running = [sequence for sequence in self.running if not sequence.finished]
        admitted = []
        while self.waiting and len(running) + len(self.prefilling) + len(admitted) < self.max_batch:
            admitted.append(self.waiting.popleft())
        if self.max_prefill_rows is None or not self.decoder.target.chunked_prefill:
            events: list[tuple[SequenceState, StepEvent]] = []
            if running:
                events += zip(running, self.decoder.step(running))
            if admitted:
                events += zip(admitted, self.decoder.prefill(admitted))
            self.running = [sequence for sequence in running + admitted if not sequence.finished]
            return events
        for sequence in admitted:
            self.decoder.open(sequence, reuse_prefix=True)
        self.prefilling += admitted
        chunks = self._prompt_chunks()
        if not running and not chunks:
            return []
        events = [
            (sequence, event)
            for sequence, event in zip(running + [sequence for sequence, _ in chunks], self.decoder.step(running, chunks))
            if sequence.prefilled == len(sequence.prompt_ids)  # (a prompt still being prefilled has nothing to say)
        ]
        prefilled = [sequence for sequence in self.prefilling if not sequence.prompt_left]
        self.prefilling = [sequence for sequence in self.prefilling if sequence.prompt_left]
        self.running = [sequence for sequence in running + prefilled if not sequence.finished]
        return events

    def _prompt_chunks(self) -> list[tuple[SequenceState, int]]:
        """This step's prompt pieces: ``max_prefill_rows`` rows handed out oldest prompt first (first tokens come
        in order of arrival, and a prompt never waits behind a later one)."""
        rows_left, chunks = self.max_prefill_rows or 0, []
        for sequence in self.prefilling:
            if rows_left <= 0:
                break
            rows = min(rows_left, sequence.prompt_left)
            chunks.append((sequence, rows))
            rows_left -= rows
        return chunks
