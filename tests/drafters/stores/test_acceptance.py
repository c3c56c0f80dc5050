"""The acceptance-rate tracker that scores draft nodes."""

from __future__ import annotations

import pytest

from draftwise.drafters.stores.acceptance import PRIOR_MEANS, AcceptanceTracker


def test_acceptance_tracker_prior_and_updates():
    tracker = AcceptanceTracker(prior_weight=4.0, pooled_weight=2.0, max_depth=3, prior_means=(0.3, 0.6, 0.8))
    assert tracker.estimates("k", 4) == pytest.approx([0.3, 0.6, 0.8, 0.8])
    tracker.update("k", attempted=2, accepted=1)
    pooled_1 = (1 + 2 * 0.3) / (1 + 2)
    pooled_2 = (0 + 2 * 0.6) / (1 + 2)
    assert tracker.pooled_rate(1) == pytest.approx(pooled_1)
    assert tracker.rate("k", 1) == pytest.approx((1 + 4 * pooled_1) / (1 + 4))
    # Below depth 1 the back-off is the larger of every kind's rate there and this kind's rate one level up.
    rate_1 = (1 + 4 * pooled_1) / (1 + 4)
    assert pooled_2 < rate_1
    assert tracker.rate("k", 2) == pytest.approx((0 + 4 * rate_1) / (1 + 4))
    assert tracker.rate("k", 3) == pytest.approx(0.8)
    # An unseen kind borrows every kind's rate at that depth, but its own outcomes dominate once it has some.
    assert tracker.rate("other", 1) == pytest.approx(pooled_1)
    tracker.update("k", attempted=5, accepted=5)  # depths past max_depth share its counts
    pooled_3 = (3 + 2 * 0.8) / (3 + 2)
    assert tracker.rate("k", 3) == pytest.approx((3 + 4 * pooled_3) / (3 + 4))
    assert tracker.rate("k", 9) == tracker.rate("k", 3)
    for _ in range(40):
        tracker.update("other", attempted=1, accepted=0)
    assert tracker.rate("other", 1) < 0.1 < tracker.rate("k", 1)


def test_a_few_failures_do_not_starve_a_good_kinds_deeper_nodes():
    """Many failing siblings at depth 2 drag every kind's rate there down; a kind that does well at depth 1 keeps
    that rate as its depth-2 back-off instead, so its deeper nodes are still worth verifying."""
    tracker = AcceptanceTracker()
    for _ in range(50):
        tracker.update("good", attempted=1, accepted=1)
    for _ in range(30):
        tracker.update_one("bad", 2, False)
    tracker.update_one("good", 2, False)
    assert tracker.pooled_rate(2) < 0.1
    assert tracker.rate("good", 2) > 0.7
    # Hundreds of failing low-ranked siblings at depth 1 leave a kind with two unlucky failures near the prior, above
    # the siblings: it is still verified and can show its real rate (it would otherwise sink to a few percent).
    tracker = AcceptanceTracker()
    for _ in range(500):
        tracker.update_one("rank 1", 1, False)
    tracker.update_one("rank 0", 1, False)
    tracker.update_one("rank 0", 1, False)
    assert tracker.rate("rank 0", 1) == pytest.approx(4 * PRIOR_MEANS[0] / 6)
    assert tracker.rate("rank 0", 1) > 10 * tracker.rate("rank 1", 1)


def test_acceptance_tracker_default_prior_grows_with_depth():
    tracker = AcceptanceTracker()
    assert tracker.estimates("k", 3) == pytest.approx(list(PRIOR_MEANS[:3]))
    assert list(PRIOR_MEANS) == sorted(PRIOR_MEANS)
    with pytest.raises(ValueError):
        AcceptanceTracker(prior_means=(1.5,))


def test_acceptance_rates_stay_probabilities():
    tracker = AcceptanceTracker()
    for _ in range(50):
        tracker.update(2, attempted=6, accepted=6)
    assert all(0.0 < rate < 1.0 for rate in tracker.estimates(2, 8))
    for _ in range(50):
        tracker.update(3, attempted=6, accepted=0)
    assert all(0.0 < rate < 1.0 for rate in tracker.estimates(3, 8))
