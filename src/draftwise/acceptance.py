"""Acceptance-rate estimates by draft source and depth, learned from verification outcomes.

Drafters use them to score draft nodes (the probability that a path is accepted) so the engine can size each
step's draft against its cost.
"""

from __future__ import annotations

#: Prior mean acceptance at depth 1, 2 and deeper (conditional on the shallower tokens being accepted).
PRIOR_MEANS = (0.35, 0.6, 0.7)


class AcceptanceTracker:
    """Beta-smoothed conditional acceptance rate per (source kind, depth).

    Args:
        prior_weight: pseudo-observations behind the prior mean.
        max_depth: depths beyond this share the last depth's counts.
    """

    def __init__(self, prior_weight: float = 4.0, max_depth: int = 16) -> None:
        self.prior_weight = prior_weight
        self.max_depth = max_depth
        self._counts: dict[tuple[object, int], list[float]] = {}

    def _prior(self, depth: int) -> float:
        return PRIOR_MEANS[min(depth, len(PRIOR_MEANS)) - 1]

    def rate(self, kind: object, depth: int) -> float:
        """Estimated probability that a token at ``depth`` is accepted given that the ones above it were."""
        depth = min(depth, self.max_depth)
        accepts, attempts = self._counts.get((kind, depth), (0.0, 0.0))
        return (accepts + self.prior_weight * self._prior(depth)) / (attempts + self.prior_weight)

    def estimates(self, kind: object, length: int) -> list[float]:
        """Conditional acceptance estimates for depths 1..length."""
        return [self.rate(kind, depth) for depth in range(1, length + 1)]

    def update_one(self, kind: object, depth: int, accepted: bool) -> None:
        """Record one draft token of ``kind`` offered at ``depth``, accepted or not."""
        counts = self._counts.setdefault((kind, min(depth, self.max_depth)), [0.0, 0.0])
        counts[1] += 1
        counts[0] += accepted

    def update(self, kind: object, attempted: int, accepted: int) -> None:
        """Record a step that offered drafts at depths 1..attempted and had depths 1..accepted accepted."""
        for depth in range(1, attempted + 1):
            self.update_one(kind, depth, depth <= accepted)
