"""How long a verification forward takes for a given number of rows, learned while decoding, and the draft size
that maximises expected tokens per second (see :func:`draftwise.decoding.engine.size_trees`).

On a CPU the cost of a forward grows quickly and unevenly with the number of rows (kernel switches), so a fixed
draft budget either wastes time on unlikely nodes or leaves speed unused. Each step the engine keeps the ``k``
best-scoring draft nodes, with ``k`` maximising ``(1 + sum of their acceptance estimates) / time(k + 1 rows)``
(the expected-length-over-cost rule of Sequoia and OPT-Tree).
"""

from __future__ import annotations

import bisect

#: Relative forward time by rows when nothing was measured: a neutral shape (every row costs a little, more so as
#: rows grow). Targets loaded by :func:`draftwise.load_model` come with a curve measured on the running machine
#: (:mod:`draftwise.backend.costs`), and measured times replace either as soon as each row count has been seen.
GENERIC_PRIOR: dict[int, float] = {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 1.9, 32: 2.9, 64: 4.9}


class LatencyModel:
    """Forward seconds per row count: exponential moving averages of measurements, a prior shape elsewhere.

    Args:
        prior: forward time by row count (relative or in seconds; interpolated between entries), e.g. a target's
            measured cost curve; :data:`GENERIC_PRIOR` when ``None``.
        smoothing: weight of a new measurement in the moving average.
        stale_factor: how far above the prior's shape an estimate may sit before fresh measurements of other row
            counts pull it back.
    """

    def __init__(self, prior: dict[int, float] | None = None, smoothing: float = 0.25, stale_factor: float = 1.5) -> None:
        self.prior = dict(sorted((prior or GENERIC_PRIOR).items()))
        # A measured curve carries noise (one run had 3 rows at 1.7x the cost of 4): a forward of fewer rows is
        # never dearer than one of more.
        cheapest = float("inf")
        for rows in reversed(list(self.prior)):
            cheapest = min(cheapest, self.prior[rows])
            self.prior[rows] = cheapest
        self.smoothing = smoothing
        self.stale_factor = stale_factor
        # Measured seconds by sequences in the forward, then rows: a forward of 16 sequences with one row each
        # costs far more than one sequence's 16-row tree (each sequence reads its own cache), so the two are
        # learned apart.
        self._seconds: dict[int, dict[int, float]] = {}

    def record(self, rows: int, seconds: float, sequences: int = 1) -> None:
        """Fold in one measured forward of ``rows`` rows over ``sequences`` sequences. Other row counts of the same
        batch size whose estimates now look inflated next to it (more than ``stale_factor`` times what the prior's
        shape predicts from this measurement) are pulled towards that prediction: a forward slowed by a passing
        load must not stop a row count from ever being tried again."""
        measured = self._seconds.setdefault(sequences, {})
        previous = measured.get(rows)
        measured[rows] = seconds if previous is None else previous + self.smoothing * (seconds - previous)
        for other, estimate in measured.items():
            if _with_drafts(other, sequences) != _with_drafts(rows, sequences):
                continue  # a batch's plain step and its steps with drafts take different paths (see _estimate)
            expected = seconds * self._prior(other) / self._prior(rows)
            if estimate > self.stale_factor * expected:
                measured[other] = estimate + self.smoothing * (expected - estimate)

    def _prior(self, rows: int) -> float:
        keys = list(self.prior)
        position = bisect.bisect_left(keys, rows)
        if position < len(keys) and keys[position] == rows:
            return self.prior[rows]
        if position == 0:
            return self.prior[keys[0]]
        if position == len(keys):
            last = keys[-1]
            return self.prior[last] * rows / last
        low, high = keys[position - 1], keys[position]
        fraction = (rows - low) / (high - low)
        return self.prior[low] + fraction * (self.prior[high] - self.prior[low])

    def cost(self, rows: int, sequences: int = 1) -> float:
        """Estimated seconds (or relative units before any measurement) of a forward of ``rows`` rows over
        ``sequences`` sequences.

        Never more than a measured larger forward of as many sequences: noise must not make a row count look
        dearer than a bigger one.
        """
        estimate = self._estimate(rows, sequences)
        larger = [seconds for measured, seconds in self._seconds.get(sequences, {}).items() if measured > rows]
        return min([estimate, *larger])

    def _estimate(self, rows: int, sequences: int) -> float:
        measured = self._seconds.get(sequences)
        if not measured:
            # Nothing measured at this batch size yet (its first forward will be): the nearest batch size
            # measured, else the prior.
            if not self._seconds:
                return self._prior(rows)
            nearest = min(self._seconds, key=lambda count: (abs(count - sequences), count))
            return self._estimate(rows, nearest)
        if rows in measured:
            return measured[rows]
        # Scale the prior by the measured row count nearest to ``rows``; of several sequences, a forward with drafts
        # (more rows than sequences) from another such forward where one was measured: plain decoding of a batch
        # takes a leaner path, and its time says little about a forward that verifies drafts.
        candidates = measured
        if _with_drafts(rows, sequences):
            candidates = [count for count in measured if _with_drafts(count, sequences)] or list(measured)
        nearest = min(candidates, key=lambda count: (abs(count - rows), count))
        return measured[nearest] * self._prior(rows) / self._prior(nearest)


def _with_drafts(rows: int, sequences: int) -> bool:
    """Whether a forward of ``rows`` rows over several ``sequences`` verifies drafts (a batch's plain step has one
    row per sequence and takes a leaner path)."""
    return sequences > 1 and rows > sequences
