"""SuccessorMatrix and the rank template: fills, pair rows, state round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftwise.drafters.stores.successors import EMPTY, SuccessorMatrix, rank_template


def distinct_successors(successors: SuccessorMatrix, token: int) -> list[int]:
    """The distinct known successors of ``token`` in the matrix, best first."""
    return list(dict.fromkeys(int(successor) for successor in successors.matrix[token] if successor != EMPTY))


def test_template_is_parent_closed_and_bounded():
    template = rank_template(depth=4, rank_budget=3, width=8)
    assert len(set(template)) == len(template)
    seen = set()
    for path in template:
        assert len(path) <= 4 and sum(path) <= 3 and all(rank < 8 for rank in path)
        assert len(path) == 1 or path[:-1] in seen
        seen.add(path)
    assert len(rank_template(6, 2, 8)) == 83  # about the published 80-node, depth-6 template


def test_successor_matrix_fill_skips_empty_and_repeated_slots():
    successors = SuccessorMatrix(top_k=3)
    successors.record([5, 6], np.array([[6, 7, 6], [8, 9, 8]]), vocab_size=12)
    assert successors.matrix.shape == (12, 3)
    assert distinct_successors(successors, 5) == [6, 7]  # the repeated 6 is one successor
    nodes = successors.fill(5, rank_template(depth=3, rank_budget=2, width=3))
    # 5 -> 6 -> {8, 9} (8 repeats at rank 2: skipped) ; 5 -> 7 (no successors of 7 known)
    assert [(token, parent) for _, token, parent in nodes] == [(6, -1), (7, -1), (8, 0), (9, 0)]
    for index, (ranks, token, parent) in enumerate(nodes):
        assert parent < index
    assert successors.fill(11, rank_template(3, 2, 3)) == []  # nothing seen after 11
    assert successors.fill(400, rank_template(3, 2, 3)) == []  # beyond the matrix
    # Later observations replace earlier ones: the model's latest predictions win.
    successors.record([5], np.array([[1, 2, 3]]))
    assert distinct_successors(successors, 5) == [1, 2, 3]
    with pytest.raises(ValueError):
        successors.load_matrix(np.zeros((4, 2), dtype=np.int32))


def test_pair_rows_are_preferred_and_bounded():
    successors = SuccessorMatrix(top_k=2, pair_capacity=2)
    # After "1 5" the model predicted 6; after "2 5" it predicted 7 (recorded last, so the single-token row says 7).
    successors.record([5, 5], np.array([[6, 0], [7, 0]]), previous_tokens=[1, 2])
    template = rank_template(depth=1, rank_budget=0, width=2)
    assert [token for _, token, _ in successors.fill(5, template, before=1)] == [6]
    assert [token for _, token, _ in successors.fill(5, template, before=2)] == [7]
    assert [token for _, token, _ in successors.fill(5, template, before=3)] == [7]  # unseen pair: the token's row
    assert [token for _, token, _ in successors.fill(5, template)] == [7]
    # Deeper nodes are looked up by their own pair (parent token, node token).
    successors.record([6], np.array([[8, 0]]), previous_tokens=[5])
    successors.record([6], np.array([[9, 0]]), previous_tokens=[4])  # evicts the oldest pair, (1, 5)
    assert len(successors.pairs) == 2 and (1, 5) not in successors.pairs
    nodes = successors.fill(5, rank_template(depth=2, rank_budget=0, width=2), before=2)
    assert [token for _, token, _ in nodes] == [7]  # nothing known after 7
    successors.record([5], np.array([[6, 0]]), previous_tokens=[2])
    nodes = successors.fill(5, rank_template(depth=2, rank_budget=0, width=2), before=2)
    assert [token for _, token, _ in nodes] == [6, 9]  # after (2, 5) -> 6; after (5, 6) the pair row is gone: M[6]
    restored = SuccessorMatrix(top_k=2, pair_capacity=2)
    restored.load_state(successors.state())
    assert restored.pairs == successors.pairs and np.array_equal(restored.matrix, successors.matrix)
    published = SuccessorMatrix(top_k=2)  # pair_capacity=0: single-token rows only, pairs in a file are dropped
    published.load_state(successors.state())
    assert published.pairs == {}


def test_observations_written_later_read_as_if_written_at_once():
    """observe() keeps a step's top-k rows until something reads them: every read, and record(), sees them all, in
    the order they were made; PENDING_LIMIT of them are written without waiting for a read."""
    logits = torch.full((2, 10), -1.0)
    logits[0, [3, 4]] = torch.tensor([2.0, 1.0])
    logits[1, [6, 5]] = torch.tensor([2.0, 1.0])
    successors = SuccessorMatrix(top_k=2, pair_capacity=8)
    top = successors.observe([1, 2], [7, 1], logits)
    assert top.tolist() == [[3, 4], [6, 5]] and successors._pending  # returned now, written on the next read
    assert successors.row(7, 1) == ((3, 4), True) and not successors._pending
    successors.observe([1], [7], logits[1:])
    successors.record([1], np.array([[9, 8]]), previous_tokens=[7])  # after the observation: it wins
    assert successors.row(7, 1) == ((9, 8), True) and successors.matrix[1].tolist() == [9, 8]
    successors.observe([2], [None], logits[:1])
    state = successors.state()
    assert state["matrix"][2].tolist() == [3, 4] and (7, 1) in successors.pairs
    for _ in range(SuccessorMatrix.PENDING_LIMIT):
        successors.observe([3], [None], logits[:1])
    assert not successors._pending


def full_fill_scores(successors, root, template, rate, before=None):
    """Every node of the whole template with its score (its parent's times ``rate(rank, paired, depth)``), worked out
    from :meth:`SuccessorMatrix.fill` and :meth:`SuccessorMatrix.row` by hand."""
    nodes = successors.fill(root, template, before)
    scores, paired_rows = [], []
    for ranks, token, parent in nodes:
        if parent == -1:  # read from the row of (before, root)
            paired = successors.row(before, root)[1]
        else:  # from the row of (the parent's parent's token, the parent's token)
            grandparent = nodes[parent][2]
            paired = successors.row(root if grandparent == -1 else nodes[grandparent][1], nodes[parent][1])[1]
        score = (1.0 if parent == -1 else scores[parent]) * rate(ranks[-1], paired, len(ranks))
        scores.append(score)
        paired_rows.append(paired)
    return nodes, scores, paired_rows


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), count=st.integers(1, 40))
def test_best_first_fill_gives_the_best_nodes_of_the_whole_template(seed, count):
    rng = np.random.default_rng(seed)
    vocab, top_k = 12, 4
    successors = SuccessorMatrix(top_k=top_k, pair_capacity=50)
    for token in range(vocab):  # distinct successors per row, as a model's top-k are
        successors.record([token], rng.permutation(vocab)[None, :top_k], vocab_size=vocab)
    for _ in range(20):
        before, token = (int(value) for value in rng.integers(0, vocab, 2))
        successors.record([token], rng.permutation(vocab)[None, :top_k], previous_tokens=[before])
    rates = rng.uniform(0.05, 1.0, size=(top_k, 2, 8))  # by rank, paired, depth: distinct, so no ties
    rate = lambda rank, paired, depth: float(rates[rank, int(paired), depth])  # noqa: E731
    template = rank_template(depth=4, rank_budget=3, width=top_k)
    nodes, scores, paired = full_fill_scores(successors, 3, template, rate, before=5)
    best = successors.fill_best(3, template, rate, count, before=5)
    expected = sorted(range(len(nodes)), key=lambda node: -scores[node])[:count]
    assert len(best) == len(expected)
    # The same nodes (as token paths), scores and pair flags, best first, parents before children.
    def path(found, node):
        return () if node == -1 else (*path(found, found[node][2]), found[node][1])
    assert [path(best, node) for node in range(len(best))] == [path(nodes, node) for node in expected]
    assert [entry[3] for entry in best] == pytest.approx([scores[node] for node in expected])
    assert [entry[4] for entry in best] == [paired[node] for node in expected]
    assert all(parent < node for node, (_, _, parent, _, _) in enumerate(best))
    # A floor leaves out the nodes scored below it, but never the best one.
    floor = float(np.median(scores))
    above = successors.fill_best(3, template, rate, len(template), floor=floor, before=5)
    assert [entry[3] for entry in above] == pytest.approx(sorted((s for s in scores if s >= floor), reverse=True))
    assert len(successors.fill_best(3, template, rate, 5, floor=2.0, before=5)) == 1
