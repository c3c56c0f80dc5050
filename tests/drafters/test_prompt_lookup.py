"""The prompt lookup drafter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import brute_force_continuations

from draftwise.decoding.tree import DraftTree
from draftwise.decoding.verify import verify_greedy
from draftwise.drafters import PromptLookupDrafter, StepOutcome

SETTINGS = settings(max_examples=150, deadline=None)
sequences = st.lists(st.integers(0, 3), min_size=0, max_size=40)


def token_paths(tree: DraftTree):
    return {tuple(tree.tokens[n] for n in tree.path_to(node)) for node in range(len(tree))}


def leaf_paths(tree: DraftTree):
    return {
        tuple(tree.tokens[n] for n in tree.path_to(node)) for node in range(len(tree)) if not tree.has_children(node)
    }


def test_proposes_the_copied_continuation():
    drafter = PromptLookupDrafter()
    context = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    drafter.reset(context)
    tree = drafter.propose(context, 16)
    assert leaf_paths(tree) == {(4, 5, 9, 9, 1, 2, 3)}
    assert tree.parents == tuple(range(-1, 6))  # a chain


def test_copy_length_is_draft_length():
    drafter = PromptLookupDrafter(draft_length=3)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    drafter.reset(context)
    tree = drafter.propose(context, 16)
    assert leaf_paths(tree) == {(3, 4, 5)}


def test_no_match_gives_an_empty_tree():
    drafter = PromptLookupDrafter()
    context = [1, 2, 3, 4, 5, 6]
    drafter.reset(context)
    assert len(drafter.propose(context, 16)) == 0


def test_merges_several_matches():
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1, draft_length=3)
    context = [1, 2, 5, 6, 0, 9, 2, 7, 8, 0, 3, 2]
    drafter.reset(context)
    tree = drafter.propose(context, 16)
    # (2,) occurred three times: continuations (7, 8, 0), (5, 6, 0) -- most recent first. (3, 2) never occurred.
    assert leaf_paths(tree) == {(7, 8, 0), (5, 6, 0)}
    root_children = [tree.tokens[node] for node in range(len(tree)) if tree.parents[node] == -1]
    assert sorted(root_children) == [5, 7]


def test_merged_matches_share_prefixes():
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=1, draft_length=3)
    context = [1, 4, 5, 6, 0, 1, 4, 5, 7, 0, 1]
    drafter.reset(context)
    tree = drafter.propose(context, 16)
    assert leaf_paths(tree) == {(4, 5, 7), (4, 5, 6)}
    assert len(tree) == 4  # 4 -> 5 -> {7, 6}


def test_longer_ngram_matches_come_first():
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1, max_matches=1, draft_length=2)
    # The last 3-gram (1, 2, 3) occurred at the start; the 1-gram (3,) occurred more recently too.
    context = [1, 2, 3, 8, 8, 0, 3, 9, 9, 1, 2, 3]
    drafter.reset(context)
    assert leaf_paths(drafter.propose(context, 16)) == {(8, 8)}


def test_max_matches_limits_the_alternatives():
    context = [1, 2, 3, 1, 4, 5, 1, 6, 7, 1, 8, 9, 1]
    wide = PromptLookupDrafter(max_ngram=1, min_ngram=1, max_matches=3, draft_length=2)
    wide.reset(context)
    assert leaf_paths(wide.propose(context, 16)) == {(8, 9), (6, 7), (4, 5)}
    narrow = PromptLookupDrafter(max_ngram=1, min_ngram=1, max_matches=1, draft_length=2)
    narrow.reset(context)
    assert leaf_paths(narrow.propose(context, 16)) == {(8, 9)}


@pytest.mark.parametrize("budget", [0, 1, 2, 3, 5, 16])
def test_respects_budget(budget):
    drafter = PromptLookupDrafter(max_ngram=1, min_ngram=1, max_matches=3, draft_length=8)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 5, 4, 3, 2, 1, 0, 0, 0, 1]
    drafter.reset(context)
    tree = drafter.propose(context, budget)
    assert len(tree) <= budget
    full = drafter.propose(context, 100)
    assert token_paths(tree) <= token_paths(full)
    if budget:
        assert len(tree) == min(budget, len(full))


def test_scores_are_probabilities_falling_along_paths():
    drafter = PromptLookupDrafter(max_ngram=1, min_ngram=1)
    context = [1, 2, 3, 4, 1, 5, 6, 7, 1]
    drafter.reset(context)
    tree = drafter.propose(context, 16)
    assert tree.scores is not None
    assert all(0.0 <= score <= 1.0 for score in tree.scores)
    for node, parent in enumerate(tree.parents):
        if parent != -1:
            assert tree.scores[node] <= tree.scores[parent]
    # The most recent match is preferred over the older alternative.
    first = {tree.tokens[node]: tree.scores[node] for node in range(len(tree)) if tree.parents[node] == -1}
    assert first[5] > first[2]


def _full_acceptance(tree: DraftTree, context):
    """The StepOutcome of a step in which the target accepted the tree's first root-to-leaf path."""
    node = next(n for n in range(len(tree)) if tree.parents[n] == -1)
    path = [node]
    while tree.has_children(path[-1]):
        path.append(next(n for n in range(len(tree)) if tree.parents[n] == path[-1]))
    choices = [0] * (len(tree) + 1)
    choices[0] = tree.tokens[path[0]]
    for parent, child in zip(path, path[1:]):
        choices[parent + 1] = tree.tokens[child]
    choices[path[-1] + 1] = 99
    verification = verify_greedy(tree, choices)
    assert verification.accepted == tree.max_depth
    return StepOutcome(tree, verification, torch.zeros(len(tree) + 1, 100), context)


def _rejection(tree: DraftTree, context):
    verification = verify_greedy(tree, [99] * (len(tree) + 1))
    return StepOutcome(tree, verification, torch.zeros(len(tree) + 1, 100), context)


def test_copy_length_grows_after_full_acceptance_and_resets_after_rejection():
    drafter = PromptLookupDrafter(draft_length=4, max_copy_length=16)
    context = list(range(50, 90)) + [50, 51, 52]
    drafter.reset(context)
    lengths = []
    for _ in range(4):
        tree = drafter.propose(context, 64)
        lengths.append(tree.max_depth)
        drafter.observe(_full_acceptance(tree, context))
    assert lengths == [4, 8, 16, 16]
    tree = drafter.propose(context, 64)
    assert tree.max_depth == 16
    drafter.observe(_rejection(tree, context))
    assert drafter.propose(context, 64).max_depth == 4


def test_partial_acceptance_resets_copy_length():
    drafter = PromptLookupDrafter(draft_length=4, max_copy_length=16)
    context = list(range(50, 90)) + [50, 51, 52]
    drafter.reset(context)
    tree = drafter.propose(context, 64)
    drafter.observe(_full_acceptance(tree, context))
    tree = drafter.propose(context, 64)
    assert tree.max_depth == 8
    verification = verify_greedy(tree, [*tree.tokens[:3], 99, 99, 99, 99, 99, 99])
    assert verification.accepted == 3
    drafter.observe(StepOutcome(tree, verification, torch.zeros(9, 100), context))
    assert drafter.propose(context, 64).max_depth == 4


def test_empty_draft_resets_copy_length_and_reset_clears_state():
    drafter = PromptLookupDrafter(draft_length=2, max_copy_length=8)
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    drafter.reset(context)
    tree = drafter.propose(context, 16)
    drafter.observe(_full_acceptance(tree, context))
    assert drafter.propose(context, 16).max_depth == 4
    drafter.reset([9, 9])
    other = [7, 8, 3, 7, 8]
    assert drafter.propose(other, 16).tokens == (3, 7)  # index rebuilt from scratch, copy length back to 2
    drafter.observe(StepOutcome(DraftTree(), verify_greedy(DraftTree(), [1]), torch.zeros(1, 10), other))


def test_drafter_options_are_validated():
    with pytest.raises(ValueError):
        PromptLookupDrafter(max_matches=0)
    with pytest.raises(ValueError):
        PromptLookupDrafter(draft_length=0)
    with pytest.raises(ValueError):
        PromptLookupDrafter(draft_length=8, max_copy_length=4)
    with pytest.raises(ValueError):
        PromptLookupDrafter(min_ngram=3, max_ngram=2)


@SETTINGS
@given(st.lists(st.integers(0, 4), min_size=1, max_size=50), st.integers(0, 20))
def test_pld_trees_copy_from_the_context(context, budget):
    """Every path of the tree is a stretch of the context that follows an earlier occurrence of a suffix n-gram."""
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    drafter.reset(context)
    tree = drafter.propose(context, budget)
    assert len(tree) <= budget
    for path in leaf_paths(tree):
        starts = [
            p
            for n in range(1, 4)
            for p in brute_force_continuations(context, n)
            if tuple(context[p : p + len(path)]) == path
        ]
        assert starts, path
