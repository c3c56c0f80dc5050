"""Token Recycling: matrix updates, hot start, saved state."""

from __future__ import annotations

import numpy as np
import pytest

import draftwise
from draftwise.drafters.token_recycling import EMPTY, TokenRecyclingDrafter

# (tiny models passed as they are draft on the transformers backend: see conftest.transformers_rows_trusted)
pytestmark = pytest.mark.usefixtures("transformers_rows_trusted")

PROMPT = [3, 9, 4, 9, 4, 3, 9, 4, 7]


def test_empty_matrix_drafts_nothing_then_learns(tiny_llama):
    drafter = TokenRecyclingDrafter()
    assert len(drafter.propose(PROMPT, 16)) == 0
    first = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=30)
    assert (drafter.matrix != EMPTY).any()
    # Hot start: the same request again is drafted from what the first one recycled.
    second = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=30)
    assert second.token_ids == first.token_ids
    assert second.stats.mean_accepted_tokens > first.stats.mean_accepted_tokens
    assert second.stats.mean_accepted_tokens > 1.5


def test_proposals_respect_budget_and_scores(tiny_llama):
    drafter = TokenRecyclingDrafter()
    draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=30)
    last = min(token for token in range(len(drafter.matrix)) if (drafter.matrix[token] != EMPTY).any())
    context = [*PROMPT, last]  # ending in a token whose successors were seen
    tree = drafter.propose(context, 5)
    assert 0 < len(tree) <= 5
    assert tree.scores is not None and all(0 < score <= 1 for score in tree.scores)
    # The root's children come from the recycled top-k of the last token (which ranks, the learned rates decide).
    children = [tree.tokens[node] for node, parent in enumerate(tree.parents) if parent == -1]
    assert children and set(children) <= {int(token) for token in drafter.matrix[last]}


def test_state_round_trip(tiny_llama, tmp_path):
    drafter = TokenRecyclingDrafter()
    result = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=30)
    path = tmp_path / "recycling.npz"
    drafter.save(path)
    restored = TokenRecyclingDrafter()
    restored.load(path)
    assert np.array_equal(restored.matrix, drafter.matrix)
    again = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=restored, max_new_tokens=30)
    assert again.token_ids == result.token_ids
    assert again.stats.mean_accepted_tokens > 1.5


def test_pair_rows_and_token_rows_are_scored_by_their_own_acceptance():
    drafter = TokenRecyclingDrafter(top_k=2, depth=1, rank_budget=1)
    drafter.successors.record([5], np.array([[6, 7]]), vocab_size=10, previous_tokens=[1])  # after (1, 5): 6, 7
    for _ in range(50):  # a pair's first prediction is usually right, a lone token's seldom
        drafter.acceptance.update_one((0, True), 1, True)
        drafter.acceptance.update_one((0, False), 1, False)
    paired = drafter.propose([1, 5], 4)
    alone = drafter.propose([2, 5], 4)  # (2, 5) never seen: the token's row, the same candidates
    score = {name: dict(zip(tree.tokens, tree.scores))[6] for name, tree in (("paired", paired), ("alone", alone))}
    assert paired.tokens[0] == 6 and score["paired"] > 0.9
    assert score["alone"] < 0.1 and alone.tokens[0] == 7  # the lone token's second candidate now ranks first
