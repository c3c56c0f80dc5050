"""Greedy verification of draft trees against the target's choices at every row."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftwise.decoding.tree import ROOT, DraftTree
from draftwise.decoding.verify import greedy_choice, verify_greedy


def test_greedy_choice_breaks_ties_to_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -3.0]])
    assert greedy_choice(logits).tolist() == [1, 0, 2]
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert greedy_choice(logits.to(dtype)).tolist() == [1, 0, 2]
    close = torch.tensor([[1.0, 1.0 + 2**-20]], dtype=torch.float64)  # equal once narrowed to float32
    assert greedy_choice(close).tolist() == [1]
    wide = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(greedy_choice(wide), torch.argmax(wide, dim=-1))


def test_empty_tree_emits_the_root_choice():
    result = verify_greedy(DraftTree(), [42])
    assert result.accepted_nodes == ()
    assert result.accepted == 0
    assert result.tokens == (42,)
    assert result.attempted == 0
    assert result.kept_rows == [0]


def test_chain_fully_accepted():
    tree = DraftTree.chain([5, 6, 7])
    # Rows: root -> 5, node0 (5) -> 6, node1 (6) -> 7, node2 (7) -> 9 (bonus)
    result = verify_greedy(tree, [5, 6, 7, 9])
    assert result.accepted_nodes == (0, 1, 2)
    assert result.accepted == 3
    assert result.tokens == (5, 6, 7, 9)
    assert result.attempted == 3
    assert result.kept_rows == [0, 1, 2, 3]


def test_chain_rejected_at_root():
    tree = DraftTree.chain([5, 6, 7])
    result = verify_greedy(tree, [8, 6, 7, 9])
    assert result.accepted_nodes == ()
    assert result.tokens == (8,)
    assert result.attempted == 1
    assert result.kept_rows == [0]


def test_chain_partially_accepted():
    tree = DraftTree.chain([5, 6, 7])
    result = verify_greedy(tree, [5, 6, 1, 9])
    assert result.accepted_nodes == (0, 1)
    assert result.tokens == (5, 6, 1)
    assert result.attempted == 3
    assert result.kept_rows == [0, 1, 2]


def test_choices_after_rejection_are_ignored():
    tree = DraftTree.chain([5, 6])
    # Row 2 (node 1) would say 6 again but it is never reached.
    assert verify_greedy(tree, [5, 3, 6]).tokens == (5, 3)


def test_tree_branch_selection():
    #          root
    #        /   |   \
    #     a:1  b:2   c:3
    #      |    |  \
    #    d:4  e:5  f:6
    #               |
    #              g:7
    tree = DraftTree((1, 2, 3, 4, 5, 6, 7), (-1, -1, -1, 0, 1, 1, 5))
    # Target: root -> 2 (node b), b -> 6 (node f), f -> 7 (node g), g -> 0 (bonus).
    choices = [2, 4, 6, 0, 0, 0, 7, 0]
    result = verify_greedy(tree, choices)
    assert result.accepted_nodes == (1, 5, 6)
    assert result.tokens == (2, 6, 7, 0)
    assert result.accepted == 3
    assert result.attempted == 3  # root, b and f had children; g has none
    assert result.kept_rows == [0, 2, 6, 7]


def test_tree_branch_selection_stops_at_a_leaf():
    tree = DraftTree((1, 2, 3, 4, 5, 6, 7), (-1, -1, -1, 0, 1, 1, 5))
    # root -> 1 (a), a -> 4 (d), d is a leaf: bonus = choice at row of d.
    choices = [1, 4, 9, 9, 11, 9, 9, 9]
    result = verify_greedy(tree, choices)
    assert result.accepted_nodes == (0, 3)
    assert result.tokens == (1, 4, 11)
    assert result.attempted == 2
    assert result.kept_rows == [0, 1, 4]


def test_tree_rejected_below_first_level():
    tree = DraftTree((1, 2, 3, 4), (-1, -1, 0, 0))
    result = verify_greedy(tree, [1, 9, 0, 0, 0])
    assert result.accepted_nodes == (0,)
    assert result.tokens == (1, 9)
    assert result.attempted == 2
    assert result.kept_rows == [0, 1]


def test_accepts_tensor_choices():
    tree = DraftTree.chain([5, 6])
    result = verify_greedy(tree, torch.tensor([5, 6, 1]))
    assert result.tokens == (5, 6, 1)
    assert all(type(token) is int for token in result.tokens)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000))
def test_verify_property_against_sequential_walk(seed):
    """Emitted tokens are what plain greedy decoding would emit if the target's choice at a context is the choice
    of the tree row for that context; kept rows are the root and the accepted path."""
    rng = random.Random(seed)
    vocab = 4
    size = rng.randint(0, 15)
    tokens, parents, used = [], [], set()
    for _ in range(size):
        parent = rng.randrange(-1, len(tokens))
        token = rng.randrange(vocab)
        if (parent, token) not in used:
            used.add((parent, token))
            tokens.append(token)
            parents.append(parent)
    tree = DraftTree(tuple(tokens), tuple(parents))
    choices = [rng.randrange(vocab) for _ in range(len(tree) + 1)]
    result = verify_greedy(tree, choices)

    # Independent reference walk.
    node, emitted, path, attempted = ROOT, [], [], 0
    while True:
        choice = choices[node + 1]
        emitted.append(choice)
        children = [n for n, p in enumerate(tree.parents) if p == node]
        attempted += bool(children)
        match = [n for n in children if tree.tokens[n] == choice]
        if not match:
            break
        node = match[0]
        path.append(node)
    assert list(result.tokens) == emitted
    assert list(result.accepted_nodes) == path
    assert result.attempted == attempted
    assert result.kept_rows == [0, *(n + 1 for n in path)]
    assert len(result.tokens) == result.accepted + 1
    assert result.accepted <= result.attempted <= result.accepted + 1
    # The accepted tokens are the tokens on the path.
    assert list(result.tokens[:-1]) == [tree.tokens[n] for n in path]


@pytest.mark.parametrize("chain_length", [0, 1, 4])
def test_attempted_counts_levels_with_a_draft_on_offer(chain_length):
    tree = DraftTree.chain(range(1, chain_length + 1))
    choices = list(range(1, chain_length + 1)) + [99]
    result = verify_greedy(tree, choices)
    assert result.accepted == chain_length
    assert result.attempted == chain_length
