"""Acceptance-rate estimates by draft source and depth, learned from verification outcomes.

Drafters use them to score draft nodes (the probability that a path is accepted) so the engine can size each
step's draft against its cost.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

#: Prior mean acceptance at depth 1, 2, ... (conditional on the shallower tokens being accepted; the last value holds
#: for every deeper level). A draft that has survived a few tokens tends to be a real continuation, so the conditional
#: rate grows with depth for every method measured (e.g. prompt lookup on Spec-Bench: 0.62, 0.71, 0.79, 0.78, 0.93).
PRIOR_MEANS = (0.4, 0.65, 0.75, 0.8, 0.85)


class AcceptanceTracker:
    """Beta-smoothed conditional acceptance rate per (source kind, depth), backed off to the larger of the prior and the
    rate of all kinds (and, below depth 1, of the kind's own rate one level up).

    A (kind, depth) seen only a few times (deep nodes, rare kinds) borrows strength from every kind's outcomes at that
    depth when they are better than ``prior_means``: a method whose candidates do well is trusted at once at depths
    it has not tried yet, while other kinds' failures never sink a kind's estimate below the prior (see :meth:`rate`).

    Args:
        prior_weight: pseudo-observations behind each kind's back-off.
        pooled_weight: pseudo-observations behind ``prior_means`` in the all-kinds rate.
        max_depth: depths beyond this share the last depth's counts.
        prior_means: prior mean acceptance by depth (default :data:`PRIOR_MEANS`).
    """

    def __init__(
        self,
        prior_weight: float = 4.0,
        max_depth: int = 16,
        pooled_weight: float = 4.0,
        prior_means: tuple[float, ...] = PRIOR_MEANS,
    ) -> None:
        if not prior_means or not all(0.0 <= mean <= 1.0 for mean in prior_means):
            raise ValueError("prior_means must be a non-empty sequence of probabilities")
        self.prior_weight = prior_weight
        self.pooled_weight = pooled_weight
        self.max_depth = max_depth
        self.prior_means = tuple(prior_means)
        self._counts: dict[tuple[object, int], list[float]] = {}
        self._pooled: dict[int, list[float]] = {}
        # rate() by (kind, depth) since the last update: each depth's rate backs off to the one above it, and a batch
        # step asks for the same few (kind, depth) pairs thousands of times.
        self._rates: dict[tuple[object, int], float] = {}

    def _prior(self, depth: int) -> float:
        return self.prior_means[min(depth, len(self.prior_means)) - 1]

    def pooled_rate(self, depth: int) -> float:
        """Estimated acceptance at ``depth`` over every kind."""
        depth = min(depth, self.max_depth)
        accepts, attempts = self._pooled.get(depth, (0.0, 0.0))
        return (accepts + self.pooled_weight * self._prior(depth)) / (attempts + self.pooled_weight)

    def attempts(self, depth: int) -> int:
        """How many draft tokens of every kind were offered at ``depth``."""
        return int(self._pooled.get(min(depth, self.max_depth), (0.0, 0.0))[1])

    def rate(self, kind: object, depth: int) -> float:
        """Estimated probability that a token at ``depth`` is accepted given that the ones above it were.

        A kind's own outcomes are smoothed towards a back-off: the larger of the prior mean and the all-kinds rate at
        that depth, and below depth 1 also this kind's own rate one level up when that is higher. Only the drafter's
        own failures may pull a kind down: backing off to the all-kinds rate alone let many failing low-ranked
        siblings push a good kind below the cost threshold after a few unlucky steps, after which it was never
        verified again and its estimate never recovered (Token Recycling's rank-0 candidates fell to 2%).
        """
        depth = min(depth, self.max_depth)
        known = self._rates.get((kind, depth))
        if known is not None:
            return known
        accepts, attempts = self._counts.get((kind, depth), (0.0, 0.0))
        back_off = max(self.pooled_rate(depth), self._prior(depth))
        if depth > 1:
            back_off = max(back_off, self.rate(kind, depth - 1))
        rate = (accepts + self.prior_weight * back_off) / (attempts + self.prior_weight)
        self._rates[(kind, depth)] = rate
        return rate

    def estimates(self, kind: object, length: int) -> list[float]:
        """Conditional acceptance estimates for depths 1..length."""
        return [self.rate(kind, depth) for depth in range(1, length + 1)]

    def update_one(self, kind: object, depth: int, accepted: bool) -> None:
        """Record one draft token of ``kind`` offered at ``depth``, accepted or not."""
        depth = min(depth, self.max_depth)
        self._rates.clear()
        for counts in (self._counts.setdefault((kind, depth), [0.0, 0.0]), self._pooled.setdefault(depth, [0.0, 0.0])):
            counts[1] += 1
            counts[0] += accepted

    def update(self, kind: object, attempted: int, accepted: int) -> None:
        """Record a step that offered drafts at depths 1..attempted and had depths 1..accepted accepted."""
        for depth in range(1, attempted + 1):
            self.update_one(kind, depth, depth <= accepted)

    def path_rates(
        self, tokens: Sequence[int], kinds: Sequence[object], kind_of_path: MutableMapping[tuple[int, ...], object]
    ) -> list[float]:
        """The estimated conditional acceptance of each token of a draft path whose tokens are of ``kinds``; the
        first path to reach a token prefix sets its kind (recorded in ``kind_of_path`` for :meth:`learn_step`)."""
        rates = []
        prefix: tuple[int, ...] = ()
        for depth, (token, kind) in enumerate(zip(tokens, kinds), 1):
            prefix = (*prefix, int(token))
            rates.append(self.rate(kind_of_path.setdefault(prefix, kind), depth))
        return rates

    def learn_step(self, tree: Any, verification: Any, kind_of_path: MutableMapping[tuple[int, ...], object]) -> None:
        """Learn from a verified tree: at each level the walk reached with drafts on offer, every node offered there
        (a child of the accepted path's last node) counts as accepted or not under its kind, looked up by its token
        path in ``kind_of_path`` (nodes without a kind are skipped)."""
        accepted = verification.accepted_nodes
        parent = -1
        prefix: tuple[int, ...] = ()
        for depth in range(1, verification.attempted + 1):
            chosen = accepted[depth - 1] if depth - 1 < len(accepted) else None
            for child, child_parent in enumerate(tree.parents):
                if child_parent == parent:
                    kind = kind_of_path.get((*prefix, tree.tokens[child]))
                    if kind is not None:
                        self.update_one(kind, depth, child == chosen)
            if chosen is None:
                break
            parent = chosen
            prefix = (*prefix, tree.tokens[chosen])
