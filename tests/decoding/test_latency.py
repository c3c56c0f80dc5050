"""The learned cost model of verification forwards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftwise.decoding.latency import GENERIC_PRIOR, LatencyModel
from draftwise.decoding.policy import least_paying_score, size_trees
from draftwise.decoding.tree import DraftTree


def test_prior_interpolates_and_extrapolates():
    latency = LatencyModel(prior={1: 1.0, 3: 2.0, 5: 4.0})
    assert latency.cost(1) == 1.0
    assert latency.cost(2) == pytest.approx(1.5)
    assert latency.cost(4) == pytest.approx(3.0)
    assert latency.cost(10) == pytest.approx(8.0)  # proportional beyond the last entry
    assert LatencyModel().cost(16) == GENERIC_PRIOR[16]


def test_measurements_replace_and_rescale_the_prior():
    latency = LatencyModel(prior={1: 1.0, 2: 2.0, 4: 4.0}, smoothing=0.5)
    latency.record(1, 0.010)
    assert latency.cost(1) == pytest.approx(0.010)
    assert latency.cost(4) == pytest.approx(0.040)  # prior shape scaled by the nearest measurement
    latency.record(1, 0.020)
    assert latency.cost(1) == pytest.approx(0.015)  # moving average
    latency.record(4, 0.010)
    assert latency.cost(4) == pytest.approx(0.010)
    assert latency.cost(3) == pytest.approx(0.010 * 3 / 4)  # nearest measured is 4 rows (tie -> fewer rows)


def star(scores):
    """A tree of children of the root with these scores."""
    return DraftTree(tuple(range(1, len(scores) + 1)), (-1,) * len(scores), tuple(scores))


def best_size(latency, scores):
    return len(size_trees([star(scores)], latency)[0])


def test_tree_size_maximises_expected_tokens_per_second():
    latency = LatencyModel(prior={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 10.0})
    # Up to 4 rows (root + 3 nodes) cost the same: take every node with a positive score, not a 5th row at 10x.
    assert best_size(latency, [0.9, 0.5, 0.1]) == 3
    assert best_size(latency, [0.9, 0.5, 0.4, 0.3]) == 3
    assert best_size(latency, []) == 0
    expensive = LatencyModel(prior={1: 1.0, 2: 3.0})
    assert best_size(expensive, [0.9]) == 0  # 1.9 tokens for 3x the time is a loss
    cheap = LatencyModel(prior={1: 1.0, 2: 1.5})
    assert best_size(cheap, [0.9]) == 1


def test_batch_sizing_pays_for_the_whole_forward():
    """Across sequences the best nodes win wherever they are; a dearer forward (bigger batch) verifies fewer, and
    none once drafts stop paying; unscored trees are verified whole."""
    latency = LatencyModel(prior={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.1, 5: 1.2, 6: 1.3, 8: 3.0})
    trees = size_trees([star([0.9, 0.2]), star([0.8, 0.7])], latency)
    assert [tree.scores for tree in trees] == [(0.9,), (0.8, 0.7)]
    flat = LatencyModel(prior={1: 1.0, 64: 64.0})  # every row costs as much as the first
    assert [len(tree) for tree in size_trees([star([0.9]), star([0.9])], flat)] == [0, 0]
    unscored = DraftTree.chain([4, 5, 6])
    assert size_trees([unscored, star([0.01])], flat)[0] is unscored


def test_a_slow_outlier_does_not_stop_a_row_count_for_good():
    latency = LatencyModel(prior={1: 1.0, 2: 1.2}, smoothing=0.5)
    latency.record(1, 0.050)
    latency.record(2, 4.0)  # one forward slowed by a passing load
    assert best_size(latency, [0.9]) == 0
    for _ in range(20):  # the engine keeps measuring one-row forwards at the usual speed
        latency.record(1, 0.050)
    assert latency.cost(2) < 1.5 * 0.060 * 1.01
    assert best_size(latency, [0.9]) == 1


def test_estimates_in_line_with_the_prior_are_left_alone():
    latency = LatencyModel(prior={1: 1.0, 2: 1.2}, smoothing=0.5)
    latency.record(2, 0.080)  # dearer than the prior's shape, but within its tolerance
    latency.record(1, 0.060)
    assert latency.cost(2) == pytest.approx(0.080)


def test_batch_sizes_are_learned_apart():
    """A forward of many sequences costs more than one sequence's tree of as many rows: measurements of one batch
    size never cap or stand in for another's once that one is measured."""
    latency = LatencyModel({1: 1.0, 16: 1.2, 32: 1.5})
    latency.record(17, 0.012)  # one sequence, a 16-node tree
    latency.record(16, 0.080, sequences=16)  # sixteen sequences, one row each
    assert latency.cost(16, sequences=16) == pytest.approx(0.080)
    assert latency.cost(24, sequences=16) > 0.080  # not capped by the cheap one-sequence 17-row forward
    assert latency.cost(16) < 0.012
    assert latency.cost(12, sequences=12) == pytest.approx(latency.cost(12, sequences=16))  # nearest batch size measured


def test_a_batch_with_drafts_is_priced_from_forwards_with_drafts():
    """Plain decoding of four sequences (four rows) runs a leaner path than any forward verifying drafts: a
    five-row forward is estimated from the measured six-row one, not from the plain step."""
    latency = LatencyModel(prior={1: 1.0, 64: 1.0})
    latency.record(4, 1.0, sequences=4)
    assert latency.cost(5, 4) == 1.0  # nothing with drafts measured yet
    latency.record(6, 2.0, sequences=4)
    assert latency.cost(5, 4) == 2.0
    assert latency.cost(4, 4) == 1.0


def test_plain_batch_steps_do_not_pull_down_the_price_of_steps_with_drafts():
    latency = LatencyModel(prior={1: 1.0, 64: 1.0})
    latency.record(6, 2.0, sequences=4)
    for _ in range(20):
        latency.record(4, 1.0, sequences=4)
    assert latency.cost(6, 4) == 2.0


def two_paths(first, second):
    """Two paths below the root with these scores (each non-increasing with depth)."""
    tokens = tuple(range(1, len(first) + len(second) + 1))
    parents = (-1, *range(len(first) - 1), -1, *range(len(first), len(first) + len(second) - 1))
    return DraftTree(tokens, parents, (*first, *second))


def test_chains_and_trees_are_priced_and_learned_apart():
    latency = LatencyModel(prior={1: 1.0, 8: 2.0}, tree_prior={3: 1.5, 8: 3.0})
    assert latency.cost(8) == 2.0 and latency.cost(8, tree=True) == 3.0
    latency.record(8, 0.020)  # a chain: trees are estimated from it by the priors' ratio until one is measured
    assert latency.cost(8, tree=True) == pytest.approx(0.030)
    latency.record(8, 0.050, tree=True)
    assert latency.cost(8, tree=True) == pytest.approx(0.050)
    assert latency.cost(8) == pytest.approx(0.020)
    latency.record(9, 0.040, sequences=4, tree=True)
    assert latency.cost(8, 4) == pytest.approx(0.020)  # no chains measured at batch 4: batch 1's chains
    assert LatencyModel(prior={1: 1.0, 2: 2.0}).cost(2, tree=True) == 2.0  # no tree prior: trees cost as chains


def test_latency_model_of_a_target_takes_both_measured_curves():
    measured = SimpleNamespace(cost_prior={1: 0.010, 8: 0.020}, tree_cost_prior={3: 0.015, 8: 0.030})
    latency = LatencyModel.of(measured)
    assert latency.cost(8) == 0.020 and latency.cost(8, tree=True) == 0.030
    assert LatencyModel.of(object()).cost(16) == GENERIC_PRIOR[16]


def test_a_tree_gives_way_to_its_best_path_when_branching_costs_more():
    tree = two_paths([0.9, 0.8, 0.7], [0.6, 0.5])
    alike = LatencyModel(prior={1: 1.0, 6: 1.0, 7: 7.0})
    assert size_trees([tree], alike)[0] == tree  # branching costs nothing more: the whole tree
    dear = LatencyModel(prior={1: 1.0, 6: 1.0, 7: 7.0}, tree_prior={3: 1.6, 6: 1.6, 7: 7.0})
    [path] = size_trees([tree], dear)  # (1 + 2.4) / 1.0 beats (1 + 3.5) / 1.6
    assert path.is_chain and path.tokens == (1, 2, 3)
    cheap = LatencyModel(prior={1: 1.0, 6: 1.0, 7: 7.0}, tree_prior={3: 1.2, 6: 1.2, 7: 7.0})
    assert size_trees([tree], cheap)[0] == tree  # (1 + 3.5) / 1.2 beats (1 + 2.4) / 1.0
    # Three nodes of one path first: a kept set that does not branch is priced as a chain.
    few = LatencyModel(prior={1: 1.0, 4: 1.0, 5: 9.0}, tree_prior={3: 9.0})
    assert size_trees([tree], few)[0].tokens == (1, 2, 3)


@pytest.mark.parametrize("curve", [
    {1: 1.0, 2: 1.4, 3: 1.8, 4: 2.2, 8: 3.8},  # every row alike
    {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 1.9},  # the generic shape: early rows nearly free
    {1: 1.0, 2: 1.7, 3: 1.75, 4: 2.3, 8: 4.6},  # uneven steps
])
def test_no_draft_below_the_least_paying_score_is_kept(curve):
    latency = LatencyModel(prior=curve)
    floor = least_paying_score(latency, budget=8)
    averages = [(latency.cost(1 + count) - latency.cost(1)) / count for count in range(1, 9)]
    assert floor == pytest.approx(min(averages) / latency.cost(1))
    for count in (1, 2, 5, 8):  # any number of nodes, each just below the floor: none pays
        assert best_size(latency, [floor * 0.999] * count) == 0
    assert best_size(latency, [floor * 1.2] * 8) > 0  # just above it, some do
    assert least_paying_score(latency, budget=0) == 0.0
    # Of a batch, the plain rate and the extra rows are the batch's.
    latency.record(4, 0.004, sequences=4)
    latency.record(8, 0.010, sequences=4)
    assert least_paying_score(latency, 4, sequences=4) == pytest.approx(4 / 0.004 * (0.010 - 0.004) / 4)
