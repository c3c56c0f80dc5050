"""Corpus builders: the tri-gram counter and the datastore build."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import TextTokenizer

from draftwise.corpus.build import TrigramCounter, build_datastore
from draftwise.drafters.stores.trigram import BACKOFF, pack_pair
from draftwise.errors import InvalidRequestError


def brute_trigram_counts(documents: list[list[int]]) -> Counter:
    counts: Counter = Counter()
    for document in documents:
        for index in range(len(document) - 1):
            counts[(BACKOFF, document[index], document[index + 1])] += 1
        for index in range(len(document) - 2):
            counts[tuple(document[index : index + 3])] += 1
    return counts


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), max_size=14), max_size=8), st.integers(1, 20))
def test_counter_matches_brute_force_across_flushes(documents, batch_tokens):
    counter = TrigramCounter(batch_tokens=batch_tokens)
    for document in documents:
        counter.add(np.array(document, dtype=np.int32))
    pairs, successors, counts = counter.counts()
    found = {
        (int(pair) >> 32, int(pair) & 0xFFFFFFFF, int(successor)): int(count)
        for pair, successor, count in zip(pairs, successors, counts)
    }
    assert len(found) == len(pairs)  # unique
    assert found == dict(brute_trigram_counts(documents))
    assert counter.tokens_seen == sum(len(document) for document in documents)
    assert pairs.tolist() == sorted(pairs.tolist())


def test_counting_never_spans_documents():
    store = TrigramCounter.of([np.array([1, 2]), np.array([3, 4, 5]), np.array([6])]).store(top_k=4)
    assert store.row(1, 2) == ([], [])  # nothing follows 2: the document ended
    assert store.row(9, 3) == ([4], [1.0])  # back-off to the bi-gram of 3
    assert store.row(3, 4) == ([5], [1.0])
    assert store.row(9, 6) == ([], []) and store.row(9, 5) == ([], [])
    assert sorted(store.keys.tolist()) == sorted(
        [pack_pair(3, 4), pack_pair(BACKOFF, 1), pack_pair(BACKOFF, 3), pack_pair(BACKOFF, 4)]
    )


def test_build_respects_the_token_bound():
    store = build_datastore(TextTokenizer(), ["x" * 500, "y" * 500], max_tokens=300)
    assert len(store) == 300
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        build_datastore(TextTokenizer(), ["abc"], max_tokens=0)
    with pytest.raises(InvalidRequestError, match="no text"):
        build_datastore(TextTokenizer(), ["", ""], max_tokens=10)
