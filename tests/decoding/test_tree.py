"""DraftTree construction, cutting, ancestor matrices, and the tree attention mask / position ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftwise.backend.rows import attention_mask, position_ids
from draftwise.decoding.tree import ROOT, DraftTree

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------------------------
# helpers


@st.composite
def trees(draw, max_size: int = 20, vocab: int = 6):
    """Random valid trees (parents precede children, no repeated token under one parent)."""
    size = draw(st.integers(0, max_size))
    tokens: list[int] = []
    parents: list[int] = []
    used: set[tuple[int, int]] = set()
    for _ in range(size):
        parent = draw(st.integers(ROOT, len(tokens) - 1))
        token = draw(st.integers(0, vocab - 1))
        if (parent, token) in used:
            continue
        used.add((parent, token))
        tokens.append(token)
        parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


paths_strategy = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=6), min_size=0, max_size=8)


def token_path(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.tokens[n] for n in tree.path_to(node))


def all_token_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [token_path(tree, node) for node in range(len(tree))]


def assert_well_formed(tree: DraftTree) -> None:
    """Re-check the invariants independently of __post_init__."""
    seen = set()
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        assert ROOT <= parent < node
        assert (parent, token) not in seen
        seen.add((parent, token))
        expected_depth = 1 if parent == ROOT else tree.depths[parent] + 1
        assert tree.depths[node] == expected_depth


# ----------------------------------------------------------------------------------------------------------------
# construction


def test_empty_tree():
    tree = DraftTree()
    assert len(tree) == 0
    assert tree.max_depth == 0
    assert tree.depths == ()
    assert tree.ancestor_matrix().tolist() == [[True]]
    assert not tree.has_children(ROOT)
    assert tree.child(ROOT, 3) is None


def test_chain():
    tree = DraftTree.chain([7, 3, 7, 9])
    assert tree.tokens == (7, 3, 7, 9)
    assert tree.parents == (-1, 0, 1, 2)
    assert tree.depths == (1, 2, 3, 4)
    assert tree.max_depth == 4
    assert len(tree) == 4
    assert tree.child(ROOT, 7) == 0
    assert tree.child(0, 3) == 1
    assert tree.child(1, 7) == 2
    assert tree.child(ROOT, 3) is None
    assert tree.path_to(3) == [0, 1, 2, 3]
    assert tree.has_children(2) and not tree.has_children(3)
    assert DraftTree.chain([]) == DraftTree()


def test_chain_converts_token_types():
    tree = DraftTree.chain(torch.tensor([4, 5]))
    assert tree.tokens == (4, 5)
    assert all(type(token) is int for token in tree.tokens)


@pytest.mark.parametrize(
    "tokens, parents",
    [
        ((1, 2), (-1,)),  # lengths differ
        ((1,), (0,)),  # a node is its own parent
        ((1, 2), (-1, 1)),  # parent after (equal to) the child
        ((1, 2, 3), (-1, 2, -1)),  # parent after the child
        ((1,), (-2,)),  # below the root
        ((1, 1), (-1, -1)),  # repeated token under the root
        ((1, 2, 2), (-1, 0, 0)),  # repeated token under node 0
    ],
)
def test_invalid_trees_raise(tokens, parents):
    with pytest.raises(ValueError):
        DraftTree(tokens, parents)


def test_invalid_scores_length_raises():
    with pytest.raises(ValueError):
        DraftTree((1, 2), (-1, 0), scores=(0.5,))


def test_same_token_under_different_parents_is_fine():
    tree = DraftTree((1, 1, 1), (-1, 0, 1))
    assert tree.depths == (1, 2, 3)


def test_hand_built_tree_queries():
    #        root
    #       /    \
    #     a:5    c:6
    #     |   \
    #    b:6  d:7
    #     |
    #    e:5
    tree = DraftTree((5, 6, 6, 7, 5), (-1, 0, -1, 0, 1))
    assert tree.depths == (1, 2, 1, 2, 3)
    assert tree.max_depth == 3
    assert tree.child(ROOT, 5) == 0
    assert tree.child(ROOT, 6) == 2
    assert tree.child(0, 6) == 1
    assert tree.child(0, 7) == 3
    assert tree.child(2, 5) is None
    assert tree.path_to(4) == [0, 1, 4]
    assert tree.path_to(3) == [0, 3]
    assert tree.has_children(ROOT) and tree.has_children(0) and tree.has_children(1)
    assert not tree.has_children(2) and not tree.has_children(3)


# ----------------------------------------------------------------------------------------------------------------
# from_paths


def test_from_paths_merges_into_a_trie():
    tree = DraftTree.from_paths([[1, 2, 3], [1, 2, 4], [5], [1, 6]])
    assert tree.tokens == (1, 2, 3, 4, 5, 6)
    assert tree.parents == (-1, 0, 1, 1, -1, 0)


def test_from_paths_budget_cuts_a_path_where_it_runs_out():
    tree = DraftTree.from_paths([[1, 2, 3], [4, 5, 6], [7]], budget=4)
    assert tree.tokens == (1, 2, 3, 4)
    assert tree.parents == (-1, 0, 1, -1)


def test_from_paths_budget_still_follows_existing_nodes():
    # The second path shares its prefix with the first: no new node is needed for it until the budget is out.
    tree = DraftTree.from_paths([[1, 2], [1, 2, 3], [1, 9]], budget=3)
    assert tree.tokens == (1, 2, 3)
    assert tree.parents == (-1, 0, 1)


def test_from_paths_zero_budget_and_empty_paths():
    assert len(DraftTree.from_paths([[1, 2]], budget=0)) == 0
    assert len(DraftTree.from_paths([])) == 0
    assert len(DraftTree.from_paths([[], []])) == 0


@SETTINGS
@given(paths_strategy, st.one_of(st.none(), st.integers(0, 25)))
def test_from_paths_property(paths, budget):
    tree = DraftTree.from_paths(paths, budget=budget)
    assert_well_formed(tree)
    # Expected: distinct non-empty prefixes in the order they are first met, the first `budget` of them.
    expected: list[tuple[int, ...]] = []
    for path in paths:
        for end in range(1, len(path) + 1):
            prefix = tuple(path[:end])
            if prefix not in expected:
                expected.append(prefix)
    if budget is not None:
        expected = expected[:budget]
    assert all_token_paths(tree) == expected
    if budget is not None:
        assert len(tree) <= budget


# ----------------------------------------------------------------------------------------------------------------
# from_scored_paths / best


def test_from_scored_paths_hand_example():
    # Path A: 1 -> 2 -> 3 with conditional probabilities .9, .5, .5 (reach .9, .45, .225)
    # Path B: 1 -> 4 with .8, .9 (reach .8, .72) -- node 1 keeps the best reach, .9
    # Path C: 7 with .3
    tree = DraftTree.from_scored_paths([([0.9, 0.5, 0.5], [1, 2, 3]), ([0.8, 0.9], [1, 4]), ([0.3], [7])], budget=4)
    assert_well_formed(tree)
    paths = all_token_paths(tree)
    scores = dict(zip(paths, tree.scores))
    assert set(paths) == {(1,), (1, 4), (1, 2), (7,)}
    assert scores[(1,)] == pytest.approx(0.9)
    assert scores[(1, 4)] == pytest.approx(0.72)
    assert scores[(1, 2)] == pytest.approx(0.45)
    assert scores[(7,)] == pytest.approx(0.3)
    # Parents precede children: sorted by depth, then first appearance.
    assert paths == [(1,), (7,), (1, 2), (1, 4)]


def test_from_scored_paths_ties_prefer_shallow_then_earlier():
    tree = DraftTree.from_scored_paths([([1.0, 1.0], [1, 2]), ([1.0], [3])], budget=2)
    assert set(all_token_paths(tree)) == {(1,), (3,)}
    tree = DraftTree.from_scored_paths([([0.5], [4]), ([0.5], [3])], budget=1)
    assert all_token_paths(tree) == [(4,)]


def test_from_scored_paths_no_budget_keeps_everything():
    tree = DraftTree.from_scored_paths([([0.5, 0.5], [1, 2]), ([0.1], [3])])
    assert len(tree) == 3


@st.composite
def scored_paths(draw):
    paths = draw(paths_strategy)
    return [
        (draw(st.lists(st.floats(0.0, 1.0), min_size=len(path), max_size=len(path))), path) for path in paths
    ]


@SETTINGS
@given(scored_paths(), st.integers(0, 25))
def test_from_scored_paths_property(scored, budget):
    tree = DraftTree.from_scored_paths(scored, budget=budget)
    assert_well_formed(tree)
    assert len(tree) <= budget
    # Reference scores: best reach over the paths through each prefix.
    reference: dict[tuple[int, ...], float] = {}
    for probabilities, path in scored:
        reach = 1.0
        for end in range(1, len(path) + 1):
            reach *= probabilities[end - 1]
            prefix = tuple(path[:end])
            reference[prefix] = max(reference.get(prefix, 0.0), reach)
    chosen = all_token_paths(tree)
    assert len(chosen) == min(budget, len(reference))
    assert tree.scores is not None and len(tree.scores) == len(tree)
    for prefix, score in zip(chosen, tree.scores):
        assert score == pytest.approx(reference[prefix])
    # The budget best nodes were taken: nothing left out scores higher than anything kept.
    if chosen:
        worst_kept = min(reference[prefix] for prefix in chosen)
        left_out = [score for prefix, score in reference.items() if prefix not in set(chosen)]
        assert all(score <= worst_kept + 1e-12 for score in left_out)


def test_best_keeps_highest_scores_and_parents():
    tree = DraftTree((1, 2, 3, 4), (-1, 0, -1, 1), scores=(0.9, 0.5, 0.6, 0.4))
    best = tree.best(2)
    assert all_token_paths(best) == [(1,), (3,)]
    assert best.scores == (0.9, 0.6)
    best = tree.best(3)
    assert all_token_paths(best) == [(1,), (1, 2), (3,)]
    assert tree.best(10) is tree
    assert len(tree.best(0)) == 0


def test_best_unscored_is_first_nodes():
    tree = DraftTree.from_paths([[1, 2], [3]])
    assert tree.best(2) == tree.cut(budget=2)


@SETTINGS
@given(scored_paths(), st.integers(0, 25), st.integers(0, 25))
def test_best_of_scored_tree_is_parent_closed(scored, budget, count):
    tree = DraftTree.from_scored_paths(scored, budget=budget)
    best = tree.best(count)
    assert_well_formed(best)
    assert len(best) == min(count, len(tree))
    kept = set(all_token_paths(best))
    assert kept <= set(all_token_paths(tree))


def test_best_path_follows_the_best_child_at_every_level():
    tree = DraftTree((1, 2, 3, 4, 5), (-1, 0, -1, 0, 3), scores=(0.6, 0.2, 0.4, 0.3, 0.1))
    best = tree.best_path()
    assert best.tokens == (1, 4, 5) and best.parents == (-1, 0, 1) and best.scores == (0.6, 0.3, 0.1)
    assert DraftTree.from_paths([[1, 2], [3]]).best_path().tokens == (1, 2)
    assert DraftTree.from_paths([[1], [3, 4, 5]]).best_path().tokens == (3, 4, 5)  # tied siblings: the deeper
    tied = DraftTree((1, 2, 3), (-1, -1, 1), scores=(0.5, 0.5, 0.1))
    assert tied.best_path().tokens == (2, 3)
    chain = DraftTree.chain([7, 8])
    assert chain.best_path() is chain and len(DraftTree().best_path()) == 0


@SETTINGS
@given(scored_paths(), st.integers(0, 25))
def test_best_path_is_a_chain_of_the_tree(scored, budget):
    tree = DraftTree.from_scored_paths(scored, budget=budget)
    best = tree.best_path()
    assert_well_formed(best)
    assert best.parents == tuple(range(-1, len(best) - 1))
    assert len(tree) == 0 or set(all_token_paths(best)) <= set(all_token_paths(tree)) and len(best) >= 1


def test_best_with_non_monotone_scores_is_rejected_or_valid():
    try:
        tree = DraftTree((1, 2), (-1, 0), scores=(0.1, 0.9))
    except ValueError:
        return  # refusing such scores up front is fine
    best = tree.best(1)  # must still be a tree
    assert_well_formed(best)
    assert len(best) == 1


# ----------------------------------------------------------------------------------------------------------------
# cut


def test_cut_hand_example():
    tree = DraftTree((5, 6, 6, 7, 5), (-1, 0, -1, 0, 1))
    assert tree.cut() is tree
    assert tree.cut(budget=10, max_depth=10) is tree
    cut = tree.cut(max_depth=1)
    assert cut.tokens == (5, 6) and cut.parents == (-1, -1)
    cut = tree.cut(budget=3)
    assert cut.tokens == (5, 6, 6) and cut.parents == (-1, 0, -1)
    cut = tree.cut(budget=3, max_depth=2)
    assert cut.tokens == (5, 6, 6)
    cut = tree.cut(budget=4, max_depth=2)
    assert cut.tokens == (5, 6, 6, 7) and cut.parents == (-1, 0, -1, 0)
    assert len(tree.cut(budget=0)) == 0
    assert len(tree.cut(max_depth=0)) == 0


def test_cut_keeps_scores():
    tree = DraftTree((1, 2, 3), (-1, 0, -1), scores=(0.9, 0.2, 0.5))
    assert tree.cut(max_depth=1).scores == (0.9, 0.5)


@SETTINGS
@given(trees(), st.one_of(st.none(), st.integers(0, 22)), st.one_of(st.none(), st.integers(0, 8)))
def test_cut_property(tree, budget, max_depth):
    cut = tree.cut(budget=budget, max_depth=max_depth)
    assert_well_formed(cut)
    expected = [
        token_path(tree, node)
        for node in range(len(tree))
        if max_depth is None or tree.depths[node] <= max_depth
    ]
    if budget is not None:
        expected = expected[:budget]
    assert all_token_paths(cut) == expected
    assert cut.max_depth <= (max_depth if max_depth is not None else tree.max_depth)


# ----------------------------------------------------------------------------------------------------------------
# ancestor matrix


def test_ancestor_matrix_hand_example():
    tree = DraftTree((5, 6, 6, 7, 5), (-1, 0, -1, 0, 1))
    expected = np.array(
        [
            # root a b c d e
            [1, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0],  # a
            [1, 1, 1, 0, 0, 0],  # b (a's child)
            [1, 0, 0, 1, 0, 0],  # c
            [1, 1, 0, 0, 1, 0],  # d (a's child)
            [1, 1, 1, 0, 0, 1],  # e (b's child)
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(tree.ancestor_matrix(), expected)


@SETTINGS
@given(trees())
def test_ancestor_matrix_property(tree):
    matrix = tree.ancestor_matrix()
    rows = len(tree) + 1
    assert matrix.shape == (rows, rows) and matrix.dtype == bool
    for node in range(len(tree)):
        visible = {0, *(n + 1 for n in tree.path_to(node))}
        assert set(np.flatnonzero(matrix[node + 1])) == visible
    assert set(np.flatnonzero(matrix[0])) == {0}
    # Lower triangular: nobody sees a later row.
    assert not np.triu(matrix, 1).any()


# ----------------------------------------------------------------------------------------------------------------
# tree attention mask and position ids (the rows of a verification forward)


def tree_attention_mask(trees, lengths, dtype, device):
    return attention_mask([tree.row_parents for tree in trees], lengths, dtype, device)


def tree_position_ids(trees, lengths, device):
    return position_ids([tree.row_parents for tree in trees], lengths, device)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tree_attention_mask_values(dtype):
    # root -> a(0) -> b(1); root -> c(2)
    tree = DraftTree((10, 11, 12), (-1, 0, -1))
    length = 3
    mask = tree_attention_mask([tree], [length], dtype, "cpu")
    assert mask.shape == (1, 1, 4, length + 4)
    assert mask.dtype == dtype
    low = torch.finfo(dtype).min
    allowed = torch.tensor(
        [
            # committed    root a  b  c
            [1, 1, 1, 1, 0, 0, 0],  # root
            [1, 1, 1, 1, 1, 0, 0],  # a
            [1, 1, 1, 1, 1, 1, 0],  # b
            [1, 1, 1, 1, 0, 0, 1],  # c
        ],
        dtype=torch.bool,
    )
    values = mask[0, 0]
    assert torch.all(values[allowed] == 0)
    assert torch.all(values[~allowed] == low)


def test_tree_attention_mask_empty_tree_is_one_row_seeing_everything():
    mask = tree_attention_mask([DraftTree()], [5], torch.float32, "cpu")
    assert mask.shape == (1, 1, 1, 6)
    assert torch.all(mask == 0)


def test_tree_attention_mask_batch_with_padding():
    small = DraftTree.chain([1])
    big = DraftTree((1, 2, 3), (-1, -1, 1))
    mask = tree_attention_mask([small, big], [2, 4], torch.float32, "cpu")
    rows, width = 4, 4 + 4
    assert mask.shape == (2, 1, rows, width)
    allowed = mask[:, 0] == 0
    # Sequence 0: committed [0, 2), new rows written at 2.
    expected0 = torch.zeros(rows, width, dtype=torch.bool)
    expected0[:, :2] = True
    expected0[0, 2] = True
    expected0[1, 2:4] = True
    expected0[2:, 2] = True  # padding rows see only the committed prefix and the root
    assert torch.equal(allowed[0], expected0)
    # Sequence 1: committed [0, 4), new rows at 4..7.
    expected1 = torch.zeros(rows, width, dtype=torch.bool)
    expected1[:, :4] = True
    expected1[0, 4] = True
    expected1[1, [4, 5]] = True
    expected1[2, [4, 6]] = True
    expected1[3, [4, 6, 7]] = True
    assert torch.equal(allowed[1], expected1)
    # Every row sees at least one slot, so softmax stays finite.
    assert allowed.any(dim=-1).all()


@SETTINGS
@given(trees(max_size=12), st.integers(0, 30))
def test_tree_attention_mask_matches_ancestor_matrix(tree, length):
    mask = tree_attention_mask([tree], [length], torch.float32, "cpu")[0, 0]
    allowed = (mask == 0).numpy()
    assert allowed[:, :length].all()
    np.testing.assert_array_equal(allowed[:, length:], tree.ancestor_matrix())
    assert set(np.unique(mask.numpy())) <= {0.0, float(torch.finfo(torch.float32).min)}


def test_tree_position_ids_hand_example():
    tree = DraftTree((10, 11, 12, 13), (-1, 0, -1, 1))  # depths 1, 2, 1, 3
    positions = tree_position_ids([tree], [7], "cpu")
    assert positions.dtype == torch.long
    assert positions.tolist() == [[7, 8, 9, 8, 10]]


def test_tree_position_ids_batch_padding():
    positions = tree_position_ids([DraftTree.chain([1]), DraftTree.chain([1, 2, 3])], [5, 9], "cpu")
    assert positions.tolist() == [[5, 6, 5, 5], [9, 10, 11, 12]]


@SETTINGS
@given(trees(max_size=12), st.integers(0, 100))
def test_tree_position_ids_property(tree, length):
    positions = tree_position_ids([tree], [length], "cpu")[0].tolist()
    assert positions[0] == length
    assert positions[1:] == [length + depth for depth in tree.depths]


def test_is_chain():
    assert DraftTree().is_chain and DraftTree.chain([4, 5, 6]).is_chain
    assert not DraftTree((4, 5), (-1, -1)).is_chain
    assert not DraftTree((4, 5, 6), (-1, 0, 0)).is_chain
