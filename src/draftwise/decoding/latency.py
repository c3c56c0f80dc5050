"""How long a verification forward takes for a given number of rows, learned while decoding, and the draft size
that maximises expected tokens per second (see :func:`draftwise.decoding.policy.size_trees`).

On a CPU the cost of a forward grows quickly and unevenly with the number of rows (kernel switches), so a fixed
draft budget either wastes time on unlikely nodes or leaves speed unused. Each step the engine keeps the ``k``
best-scoring draft nodes, with ``k`` maximising ``(1 + sum of their acceptance estimates) / time(k + 1 rows)``
(the expected-length-over-cost rule of Sequoia and OPT-Tree).

Chains and trees are priced apart: a target may verify a chain (each row follows the one before it) on a leaner
path than a tree of as many rows (the lean forward reads a chain's keys in place; a tree's rows each need their own),
so the engine can weigh a tree against its best path.
"""

from __future__ import annotations

import bisect
from typing import Any

#: Relative forward time by rows when nothing was measured: a neutral shape (every row costs a little, more so as
#: rows grow). Targets loaded by :func:`draftwise.load_model` come with a curve measured on the running machine
#: (:mod:`draftwise.backend.calibration.costs`), and measured times replace either as soon as each row count has been seen.
GENERIC_PRIOR: dict[int, float] = {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 1.9, 32: 2.9, 64: 4.9}


def _never_dearer_with_fewer_rows(curve: dict[int, float]) -> dict[int, float]:
    """``curve`` sorted by rows, each entry at most any entry of more rows: a measured curve carries noise (one run
    had 3 rows at 1.7x the cost of 4), and a forward of fewer rows is never dearer than one of more."""
    curve = dict(sorted(curve.items()))
    cheapest = float("inf")
    for rows in reversed(list(curve)):
        cheapest = min(cheapest, curve[rows])
        curve[rows] = cheapest
    return curve


class LatencyModel:
    """Forward seconds per row count: exponential moving averages of measurements, a prior shape elsewhere; chains
    and trees apart.

    Args:
        prior: forward time of chains by row count (relative or in seconds; interpolated between entries), e.g. a
            target's measured cost curve; :data:`GENERIC_PRIOR` when ``None``.
        smoothing: weight of a new measurement in the moving average.
        stale_factor: how far above the prior's shape an estimate may sit before fresh measurements of other row
            counts pull it back.
        tree_prior: the same for trees (branching rows), in the same units as ``prior``; ``prior`` when ``None``
            (a target that verifies both alike).
    """

    def __init__(
        self,
        prior: dict[int, float] | None = None,
        smoothing: float = 0.25,
        stale_factor: float = 1.5,
        tree_prior: dict[int, float] | None = None,
    ) -> None:
        self.prior = _never_dearer_with_fewer_rows(prior or GENERIC_PRIOR)
        self.tree_prior = _never_dearer_with_fewer_rows(tree_prior) if tree_prior else self.prior
        self.smoothing = smoothing
        self.stale_factor = stale_factor
        # Measured seconds by (sequences in the forward, whether it verified a tree), then rows: a forward of 16
        # sequences with one row each costs far more than one sequence's 16-row tree (each sequence reads its own
        # cache), and a tree more than a chain of as many rows, so each is learned apart.
        self._seconds: dict[tuple[int, bool], dict[int, float]] = {}

    @classmethod
    def of(cls, target: Any) -> LatencyModel:
        """A model whose priors are ``target``'s measured cost curves (its ``cost_prior`` and
        ``tree_cost_prior``; the generic prior where not measured)."""
        return cls(prior=getattr(target, "cost_prior", None), tree_prior=getattr(target, "tree_cost_prior", None))

    def record(self, rows: int, seconds: float, sequences: int = 1, tree: bool = False) -> None:
        """Fold in one measured forward of ``rows`` rows over ``sequences`` sequences (``tree``: some sequence's
        rows branch). Other row counts of the same kind whose estimates now look inflated next to it (more than
        ``stale_factor`` times what the prior's shape predicts from this measurement) are pulled towards that
        prediction: a forward slowed by a passing load must not stop a row count from ever being tried again."""
        measured = self._seconds.setdefault((sequences, tree), {})
        previous = measured.get(rows)
        measured[rows] = seconds if previous is None else previous + self.smoothing * (seconds - previous)
        for other, estimate in measured.items():
            if _with_drafts(other, sequences) != _with_drafts(rows, sequences):
                continue  # a batch's plain step and its steps with drafts take different paths (see _estimate)
            expected = seconds * self._prior(other, tree) / self._prior(rows, tree)
            if estimate > self.stale_factor * expected:
                measured[other] = estimate + self.smoothing * (expected - estimate)

    def _prior(self, rows: int, tree: bool = False) -> float:
        prior = self.tree_prior if tree else self.prior
        keys = list(prior)
        position = bisect.bisect_left(keys, rows)
        if position < len(keys) and keys[position] == rows:
            return prior[rows]
        if position == 0:
            return prior[keys[0]]
        if position == len(keys):
            last = keys[-1]
            return prior[last] * rows / last
        low, high = keys[position - 1], keys[position]
        fraction = (rows - low) / (high - low)
        return prior[low] + fraction * (prior[high] - prior[low])

    def cost(self, rows: int, sequences: int = 1, tree: bool = False) -> float:
        """Estimated seconds (or relative units before any measurement) of a forward of ``rows`` rows over
        ``sequences`` sequences (``tree``: some sequence's rows branch).

        Never more than a measured larger forward of the same kind: noise must not make a row count look dearer
        than a bigger one.
        """
        estimate = self._estimate(rows, sequences, tree)
        larger = [seconds for measured, seconds in self._seconds.get((sequences, tree), {}).items() if measured > rows]
        return min([estimate, *larger])

    def _estimate(self, rows: int, sequences: int, tree: bool) -> float:
        measured = self._seconds.get((sequences, tree))
        if not measured:
            # Nothing of this kind measured at this batch size yet (its first forward will be): the nearest batch
            # size measured of this kind; else the other kind's estimate, scaled by the priors' ratio; else the prior.
            sizes = [count for count, kind in self._seconds if kind == tree]
            if sizes:
                nearest = min(sizes, key=lambda count: (abs(count - sequences), count))
                return self._estimate(rows, nearest, tree)
            if self._seconds:
                return self._estimate(rows, sequences, not tree) * self._prior(rows, tree) / self._prior(rows, not tree)
            return self._prior(rows, tree)
        if rows in measured:
            return measured[rows]
        # Scale the prior by the measured row count nearest to ``rows``; of several sequences, a forward with drafts
        # (more rows than sequences) from another such forward where one was measured: plain decoding of a batch
        # takes a leaner path, and its time says little about a forward that verifies drafts.
        candidates = measured
        if _with_drafts(rows, sequences):
            candidates = [count for count in measured if _with_drafts(count, sequences)] or list(measured)
        nearest = min(candidates, key=lambda count: (abs(count - rows), count))
        return measured[nearest] * self._prior(rows, tree) / self._prior(nearest, tree)


def _with_drafts(rows: int, sequences: int) -> bool:
    """Whether a forward of ``rows`` rows over several ``sequences`` verifies drafts (a batch's plain step has one
    row per sequence and takes a leaner path)."""
    return sequences > 1 and rows > sequences
