"""NGramIndex: continuations against brute force, incremental extension, validation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import brute_force_continuations

from draftwise.drafters.stores.ngram import NGramIndex

SETTINGS = settings(max_examples=150, deadline=None)
sequences = st.lists(st.integers(0, 3), min_size=0, max_size=40)


def test_continuations_most_recent_first():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    index = NGramIndex(1, 3)
    index.extend(tokens)
    assert index.continuations(tokens, 2) == [5, 2]
    assert index.continuations(tokens, 1) == [5, 2]
    assert index.continuations(tokens, 3) == []  # (4, 1, 2) never occurred before


def test_no_self_match_of_the_suffix():
    index = NGramIndex(1, 2)
    index.extend([7])
    assert index.continuations([7], 1) == []
    tokens = [7, 7]
    index.extend(tokens)
    # The suffix (7,) occurs at the end, where it has no continuation yet; only the first 7 matches.
    assert index.continuations(tokens, 1) == [1]
    assert index.continuations(tokens, 2) == []
    tokens = [5, 6, 5, 6]
    index.reset()
    index.extend(tokens)
    assert index.continuations(tokens, 2) == [2]
    assert all(position < len(tokens) for position in index.continuations(tokens, 1))


def test_continuations_outside_n_range():
    index = NGramIndex(2, 3)
    tokens = [1, 2, 1, 2]
    index.extend(tokens)
    assert index.continuations(tokens, 1) == []
    assert index.continuations(tokens, 4) == []
    assert index.continuations([2], 2) == []


def test_index_validation():
    with pytest.raises(ValueError):
        NGramIndex(0, 2)
    with pytest.raises(ValueError):
        NGramIndex(3, 2)
    index = NGramIndex(1, 2)
    index.extend([1, 2, 3])
    with pytest.raises(ValueError):
        index.extend([1, 2])
    index.reset()
    index.extend([1, 2])
    assert index.continuations([1, 2, 1], 1) == [1]


@SETTINGS
@given(sequences, st.integers(1, 3), st.integers(0, 3))
def test_continuations_match_brute_force(tokens, min_n, extra):
    max_n = min_n + extra
    index = NGramIndex(min_n, max_n)
    index.extend(tokens)
    for n in range(min_n, max_n + 1):
        assert index.continuations(tokens, n) == brute_force_continuations(tokens, n)


@SETTINGS
@given(sequences, st.lists(st.integers(0, 40), max_size=5))
def test_incremental_extend_equals_building_at_once(tokens, cuts):
    at_once = NGramIndex(1, 4)
    at_once.extend(tokens)
    incremental = NGramIndex(1, 4)
    for cut in sorted(cuts):
        incremental.extend(tokens[: min(cut, len(tokens))])
    incremental.extend(tokens)
    incremental.extend(tokens)  # no-op
    # Same answers for every n-gram of the sequence, and for the sequence's own suffix at every prefix.
    for n in range(1, 5):
        for end in range(n, len(tokens) + 1):
            query = tokens[end - n : end]
            assert incremental.continuations(query, n) == at_once.continuations(query, n)
        assert incremental.continuations(tokens, n) == brute_force_continuations(tokens, n)


@SETTINGS
@given(sequences)
def test_growing_index_answers_for_every_prefix(tokens):
    """As the drafter uses it: extend with each longer prefix, ask about that prefix's suffix."""
    index = NGramIndex(1, 3)
    for end in range(len(tokens) + 1):
        prefix = tokens[:end]
        index.extend(prefix)
        for n in range(1, 4):
            assert index.continuations(prefix, n) == brute_force_continuations(prefix, n)
