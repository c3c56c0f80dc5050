"""Token Recycling: template, matrix updates, hot start, saved state."""

from __future__ import annotations

import numpy as np

import draftwise
from draftwise.drafters.token_recycling import EMPTY, TokenRecyclingDrafter, rank_template

PROMPT = [3, 9, 4, 9, 4, 3, 9, 4, 7]


def test_template_is_parent_closed_and_bounded():
    template = rank_template(depth=4, rank_budget=3, width=8)
    assert len(set(template)) == len(template)
    seen = set()
    for path in template:
        assert len(path) <= 4 and sum(path) <= 3 and all(rank < 8 for rank in path)
        assert len(path) == 1 or path[:-1] in seen
        seen.add(path)
    assert len(rank_template(6, 2, 8)) == 83  # about the published 80-node, depth-6 template


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
    tree = drafter.propose(PROMPT, 5)
    assert 0 < len(tree) <= 5
    assert tree.scores is not None and all(0 < score <= 1 for score in tree.scores)
    # The root's children come from the recycled top-k of the last token (which ranks, the learned rates decide).
    children = [tree.tokens[node] for node, parent in enumerate(tree.parents) if parent == -1]
    assert children and set(children) <= {int(token) for token in drafter.matrix[PROMPT[-1]]}


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
