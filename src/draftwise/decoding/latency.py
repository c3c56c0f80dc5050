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
        self.smoothing = smoothing
        self.stale_factor = stale_factor
        self._seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        """Fold in one measured forward. Other row counts whose estimates now look inflated next to it (more than
        ``stale_factor`` times what the prior's shape predicts from this measurement) are pulled towards that
        prediction: a forward slowed by a passing load must not stop a row count from ever being tried again."""
        previous = self._seconds.get(rows)
        self._seconds[rows] = seconds if previous is None else previous + self.smoothing * (seconds - previous)
        for measured, estimate in self._seconds.items():
            expected = seconds * self._prior(measured) / self._prior(rows)
            if estimate > self.stale_factor * expected:
                self._seconds[measured] = estimate + self.smoothing * (expected - estimate)

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

    def cost(self, rows: int) -> float:
        """Estimated seconds (or relative units before any measurement) of a forward of ``rows`` rows.

        Never more than a measured larger forward: noise must not make a row count look dearer than a bigger one.
        """
        estimate = self._estimate(rows)
        larger = [seconds for measured, seconds in self._seconds.items() if measured > rows]
        return min([estimate, *larger])

    def _estimate(self, rows: int) -> float:
        if rows in self._seconds:
            return self._seconds[rows]
        if not self._seconds:
            return self._prior(rows)
        # Scale the prior by the measured row count nearest to ``rows``.
        nearest = min(self._seconds, key=lambda measured: (abs(measured - rows), measured))
        return self._seconds[nearest] * self._prior(rows) / self._prior(nearest)
