"""TrigramStore: rows, online additions, merges, eviction, files (checked against a dictionary model)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draftwise.drafters.stores.trigram import BACKOFF, EMPTY, TrigramStore, pack_pair, pack_pairs


class DictTrigramModel:
    """The store's documented behaviour with nothing bounded or batched: a plain dictionary of rows."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.rows: dict[tuple[int, int], tuple[list[int], list[float]]] = {}

    def add(self, a: int, b: int, c: int, amount: float, cap: float) -> None:
        for key in ((a, b), (BACKOFF, b)):
            tokens, weights = self.rows.setdefault(key, ([], []))
            if c in tokens:
                weights[tokens.index(c)] = min(cap, weights[tokens.index(c)] + amount)
            elif len(tokens) < self.top_k:
                tokens.append(c)
                weights.append(min(cap, amount))
            else:
                weakest = weights.index(min(weights))
                if weights[weakest] < amount:
                    tokens[weakest], weights[weakest] = c, min(cap, amount)

    def row(self, a: int, b: int) -> tuple[list[int], list[float]]:
        tokens, weights = self.rows.get((a, b)) or self.rows.get((BACKOFF, b)) or ([], [])
        order = sorted(range(len(tokens)), key=lambda i: -weights[i])
        total = sum(weights)
        return [tokens[i] for i in order], [weights[i] / total for i in order]


def assert_same_rows(store: TrigramStore, model: DictTrigramModel, alphabet: int) -> None:
    for a in range(alphabet):
        for b in range(alphabet):
            tokens, probabilities = store.row(a, b)
            expected_tokens, expected_probabilities = model.row(a, b)
            assert tokens == expected_tokens, (a, b)
            assert probabilities == pytest.approx(expected_probabilities)


def store_from_sequences(rng: random.Random, count: int = 30, alphabet: int = 12, **options) -> TrigramStore:
    store = TrigramStore(**options)
    for _ in range(count):
        store.add_sequence([rng.randrange(alphabet) for _ in range(rng.randint(3, 15))], amount=0.5)
    return store


def test_row_is_normalised_strongest_first_and_backs_off():
    store = TrigramStore(top_k=4)
    store.add(1, 2, 7, 0.5)
    store.add(1, 2, 8, 1.5)
    store.add(1, 2, 9, 1.0)
    store.add(5, 2, 6, 2.0)
    tokens, probabilities = store.row(1, 2)
    assert tokens == [8, 9, 7]
    assert probabilities == pytest.approx([0.5, 1 / 3, 1 / 6])
    assert sum(probabilities) == pytest.approx(1.0)
    # (4, 2) is unknown: the bi-gram row of 2 holds every successor ever seen after 2.
    tokens, probabilities = store.row(4, 2)
    assert tokens == [6, 8, 9, 7]
    assert probabilities == pytest.approx([2 / 5, 1.5 / 5, 1 / 5, 0.5 / 5])
    assert store.row(1, 3) == ([], [])
    store.merge()  # the same answers from the arrays
    assert store.row(1, 2)[0] == [8, 9, 7] and store.row(4, 2)[0] == [6, 8, 9, 7]


def test_add_caps_inserts_and_displaces_only_weaker_successors():
    store = TrigramStore(top_k=2)
    for _ in range(10):
        store.add(1, 2, 3, 1.0, cap=2.5)
    store.add(1, 2, 4, 0.5, cap=2.5)
    store.merge()
    index = int(np.searchsorted(store.keys, pack_pair(1, 2)))
    assert store.tokens[index].tolist() == [3, 4] and store.weights[index].tolist() == [2.5, 0.5]
    store.add(1, 2, 5, 0.5, cap=2.5)  # not stronger than the weakest (0.5): refused
    assert store.row(1, 2)[0] == [3, 4]
    store.add(1, 2, 5, 0.75, cap=2.5)  # stronger: takes the weakest's place
    assert store.row(1, 2)[0] == [3, 5]
    store.add(1, 2, 6, 9.0, cap=2.5)  # a new successor is capped too
    tokens, probabilities = store.row(1, 2)
    assert sorted(tokens) == [3, 6] and probabilities == pytest.approx([0.5, 0.5])


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 5), st.sampled_from([0.25, 0.5, 1.0, 2.0])),
        max_size=60,
    ),
    st.integers(1, 3),
    st.integers(1, 4),
    st.sampled_from([1.5, 3.0]),
)
def test_online_rows_and_merges_match_a_dictionary(additions, top_k, merge_every, cap):
    """Rows survive any interleaving of online updates and merges (amounts are exact in float32, so the
    displacement decisions of the two models agree)."""
    store = TrigramStore(top_k=top_k, merge_every=merge_every)
    queued = TrigramStore(top_k=top_k, merge_every=merge_every)  # (updates applied at its next read)
    model = DictTrigramModel(top_k)
    for step, (a, b, c, amount) in enumerate(additions):
        store.add(a, b, c, amount, cap)
        queued.queue(a, b, c, amount, cap)
        model.add(a, b, c, amount, cap)
        if step % 7 == 0:
            assert_same_rows(store, model, 6)
            assert_same_rows(queued, model, 6)
    for checked in (store, queued):
        assert len(checked) == len(model.rows)
        assert_same_rows(checked, model, 6)
        checked.merge()
        assert len(checked) == len(checked.keys) == len(model.rows)
        assert checked.keys.tolist() == sorted(checked.keys.tolist())
        assert_same_rows(checked, model, 6)


def test_merge_evicts_the_weakest_rows():
    pairs = pack_pairs(np.array([1, 2, 3]), np.array([1, 2, 3]))
    # One successor per pair: weights n / (n + 1) = 0.5, 0.75 and 0.9.
    store = TrigramStore.from_counts(pairs, np.array([5, 6, 7]), np.array([1, 3, 9]), top_k=2, max_pairs=3)
    assert len(store) == 3
    store.add(7, 8, 9, 0.8)  # two new rows, (7, 8) and (BACKOFF, 8), of strength 0.8
    assert len(store) == 5  # the bound applies when merging
    store.merge()
    assert len(store) == 3
    assert sorted(store.keys.tolist()) == sorted([pack_pair(3, 3), pack_pair(7, 8), pack_pair(BACKOFF, 8)])
    assert store.row(3, 3) == ([7], [1.0]) and store.row(7, 8) == ([9], [1.0])
    assert store.row(1, 1) == ([], []) and store.row(2, 2) == ([], [])


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 6)), min_size=1, max_size=80),
    st.integers(1, 4),
    st.integers(1, 20),
)
def test_from_counts_keeps_the_top_successors(triples, top_k, max_pairs):
    counts = Counter(triples)
    unique = sorted(counts)
    store = TrigramStore.from_counts(
        pack_pairs(np.array([a for a, _, _ in unique]), np.array([b for _, b, _ in unique])),
        np.array([c for _, _, c in unique]),
        np.array([counts[key] for key in unique]),
        top_k=top_k,
        max_pairs=max_pairs,
    )
    by_pair: dict[tuple[int, int], Counter] = {}
    for (a, b, c), count in counts.items():
        by_pair.setdefault((a, b), Counter())[c] = count
    strength = {}
    for (a, b), successors in by_pair.items():
        total = sum(successors.values())
        ranked = sorted(successors.values(), reverse=True)
        strength[pack_pair(a, b)] = sum(ranked[:top_k]) / (total + 1.0)
    assert store.keys.tolist() == sorted(store.keys.tolist())
    assert len(store) == min(max_pairs, len(by_pair))
    kept = set(store.keys.tolist())
    evicted = set(strength) - kept
    if evicted:
        assert min(strength[key] for key in kept) >= max(strength[key] for key in evicted) - 1e-6
    for index, key in enumerate(store.keys.tolist()):
        a, b = key >> 32, key & 0xFFFFFFFF
        successors = by_pair[(a, b)]
        total = sum(successors.values())
        row_tokens = store.tokens[index].tolist()
        filled = [token for token in row_tokens if token != EMPTY]
        assert row_tokens == filled + [EMPTY] * (top_k - len(filled))  # successors first, padding after
        assert len(filled) == min(top_k, len(successors))
        kept_counts = [successors[token] for token in filled]
        assert kept_counts == sorted(kept_counts, reverse=True)
        dropped = [count for token, count in successors.items() if token not in filled]
        assert not dropped or min(kept_counts) >= max(dropped)
        weights = store.weights[index][: len(filled)].tolist()
        assert weights == pytest.approx([count / (total + 1.0) for count in kept_counts])
        assert store.row(a, b)[1] == pytest.approx([count / sum(kept_counts) for count in kept_counts])


def test_from_counts_of_nothing_is_empty():
    empty = np.empty(0, dtype=np.int64)
    store = TrigramStore.from_counts(empty, empty, empty)
    assert len(store) == 0 and store.row(1, 2) == ([], [])


def test_save_load_round_trip_with_online_rows(tmp_path):
    store = store_from_sequences(random.Random(1), top_k=3, max_pairs=500)
    store.merge()
    store.add_sequence([1, 2, 3, 4, 1, 2, 5], amount=1.0)  # online rows, some over array rows, not merged yet
    assert store._online
    expected = {(a, b): store.row(a, b) for a in range(13) for b in range(13)}
    path = tmp_path / "store.npz"
    store.save(path, tokenizer="chars", tokens=1234)
    loaded, metadata = TrigramStore.load(path)
    assert metadata == {"tokenizer": "chars", "tokens": "1234"}
    assert (loaded.top_k, loaded.max_pairs, len(loaded)) == (3, 500, len(store))
    assert {(a, b): loaded.row(a, b) for a in range(13) for b in range(13)} == expected
    assert {3, 5} <= set(loaded.row(1, 2)[0])  # the online row made it into the file


def test_files_that_are_not_stores_are_refused(tmp_path):
    other = tmp_path / "other.npz"
    np.savez(other, weights=np.zeros(3))
    with pytest.raises(ValueError, match="not a draftwise tri-gram store"):
        TrigramStore.load(other)
    garbage = tmp_path / "garbage.npz"
    garbage.write_text("not a store at all")
    with pytest.raises(ValueError):
        TrigramStore.load(garbage)
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.npz is empty"):
        TrigramStore.load(empty)
    with pytest.raises(ValueError, match="missing.npz does not exist"):
        TrigramStore.load(tmp_path / "missing.npz")
    # A store file whose arrays disagree.
    corrupt = tmp_path / "corrupt.npz"
    store = store_from_sequences(random.Random(2), top_k=2)
    store.save(corrupt)
    with np.load(corrupt) as data:
        arrays = dict(data)
    arrays["tokens"] = arrays["tokens"][:, :1]
    np.savez(corrupt, **arrays)
    with pytest.raises(ValueError, match="corrupt"):
        TrigramStore.load(corrupt)
    with pytest.raises(ValueError):
        TrigramStore(top_k=0)


def test_non_npz_files_are_refused_with_the_store_error(tmp_path):
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(ValueError, match="tri-gram store"):
        TrigramStore.load(single)
    garbage = tmp_path / "garbage.npz"
    garbage.write_text("not a store at all")
    with pytest.raises(ValueError, match="tri-gram store"):
        TrigramStore.load(garbage)
