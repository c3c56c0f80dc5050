"""Drafters' scores scaled by how they measured up: the ratio, its bounds, and the engine verifying fewer nodes of
an overconfident drafter while its tokens stay plain decoding's."""

from __future__ import annotations

import pytest
from test_engine import PROMPT, FixedCosts, greedy_ids

from draftwise.decoding.calibration import ScoreCalibration
from draftwise.decoding.drafter import Drafter
from draftwise.decoding.engine import Decoder
from draftwise.decoding.tree import DraftTree


def test_the_ratio_starts_at_one_and_follows_what_was_accepted():
    calibration = ScoreCalibration()
    assert calibration.factor == 1.0
    tree = DraftTree((1, 2, 3), (-1, 0, 1), (0.9, 0.8, 0.7))
    for _ in range(40):
        calibration.learn(tree, 1.0, 0)  # 2.4 tokens promised a step, none accepted
    assert calibration.factor == ScoreCalibration.LOWEST
    for _ in range(400):
        calibration.learn(tree, 1.0, 3)  # every node accepted: 3 for 2.4 promised
    assert calibration.factor == pytest.approx(3 / 2.4, rel=0.02)
    modest = ScoreCalibration()
    for _ in range(400):
        modest.learn(DraftTree((1, 2), (-1, 0), (0.5, 0.25)), 1.0, 1)
    assert modest.factor == pytest.approx(1 / 0.75, rel=0.02)


def test_scores_are_learned_unscaled():
    """What a step promised is the drafter's own scores: those the engine verified divided by the factor it applied."""
    calibration = ScoreCalibration()
    calibration.learn(DraftTree((1,), (-1,), (0.25,)), 0.5, 1)
    assert calibration.promised == pytest.approx(0.5) and calibration.accepted == 1


def test_scaled_trees_keep_their_shape_and_unscored_trees_stay():
    calibration = ScoreCalibration(accepted=0.0, promised=2.0)  # factor (0 + 2) / (2 + 2) = 0.5
    tree = DraftTree((4, 5, 6), (-1, 0, -1), (0.8, 0.4, 0.2))
    scaled = calibration.scaled(tree)
    assert scaled.tokens == tree.tokens and scaled.parents == tree.parents
    assert scaled.scores == pytest.approx((0.4, 0.2, 0.1))
    unscored = DraftTree.chain([1, 2])
    assert calibration.scaled(unscored) is unscored and calibration.scaled(DraftTree()) == DraftTree()
    assert ScoreCalibration(accepted=100.0, promised=0.0).factor == ScoreCalibration.HIGHEST


class OverconfidentDrafter(Drafter):
    """Wrong tokens (none is ever the model's), each scored a near-certain 0.95."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def propose(self, context, budget):
        return DraftTree((7, 7, 7), (-1, 0, 1), (0.95, 0.9, 0.85))

    def observe(self, outcome):
        self.sizes.append(len(outcome.tree))


def test_an_overconfident_drafter_is_soon_verified_less(tiny_llama):
    """Scores that promise far more than is ever accepted are scaled down until the cost rule stops verifying
    them (but for exploration's lone nodes); the output is plain decoding's throughout."""
    count = 60
    reference = greedy_ids(tiny_llama, PROMPT, count)
    assert 7 not in reference
    drafter = OverconfidentDrafter()
    decoder = Decoder(tiny_llama, budget=8, latency=FixedCosts(prior={1: 1.0, 2: 1.3, 4: 1.6, 64: 20.0}))
    state = decoder.start(PROMPT, drafter, max_new_tokens=count)
    decoder.prefill([state])
    while not state.finished:
        decoder.step([state])
    assert state.output == reference
    assert drafter.sizes[0] == 3  # believed at first
    late = drafter.sizes[20:]
    assert sum(late) <= len(late) // Decoder.EXPLORE_EVERY + 1  # then only the explored single nodes
    assert state.calibration.factor < 0.2
