"""Datastore: suffix array, longest matches and continuation tries against brute force, files and refusals."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import VOCAB, TextTokenizer

import draftwise
from draftwise.corpus.build import build_datastore
from draftwise.drafters.rest import RestDrafter
from draftwise.drafters.stores.datastore import (
    SEPARATOR,
    Datastore,
    context_continuations,
    continuation_trie,
    suffix_array,
)
from draftwise.errors import InvalidRequestError, UnsupportedOptionError

documents_strategy = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=25), min_size=1, max_size=5)


def brute_suffix_order(tokens: np.ndarray) -> list[int]:
    # A separator sorts below every token; the end of the corpus below everything.
    positions = [position for position in range(len(tokens)) if tokens[position] >= 0]
    return sorted(positions, key=lambda position: tokens[position:].tolist())


def occurrences(tokens: np.ndarray, pattern: list[int]) -> list[int]:
    """Start positions of ``pattern`` followed by a token (not a separator)."""
    size = len(pattern)
    return [
        start
        for start in range(len(tokens) - size)
        if tokens[start : start + size].tolist() == pattern and tokens[start + size] >= 0
    ]


def brute_continuation_counts(tokens: np.ndarray, starts: list[int], depth: int) -> Counter:
    """How many occurrences continue with each token path (up to ``depth`` tokens, stopping at a separator)."""
    counts: Counter = Counter()
    for start in starts:
        path: tuple[int, ...] = ()
        for position in range(start, min(start + depth, len(tokens))):
            if tokens[position] < 0:
                break
            path = (*path, int(tokens[position]))
            counts[path] += 1
    return counts


def trie_counts(rows: np.ndarray) -> Counter:
    tokens, parents, counts, depths = continuation_trie(rows)
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens.tolist(), parents.tolist()):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    assert all(depth == len(path) for depth, path in zip(depths.tolist(), paths))
    return Counter(dict(zip(paths, counts.tolist())))


@settings(max_examples=60, deadline=None)
@given(documents_strategy)
def test_suffix_array_matches_brute_force(documents):
    tokens = Datastore.from_documents([np.array(d, dtype=np.int32) for d in documents]).tokens
    assert suffix_array(tokens).tolist() == brute_suffix_order(tokens)


@settings(max_examples=80, deadline=None)
@given(documents_strategy, st.lists(st.integers(0, 3), min_size=1, max_size=8), st.integers(1, 4))
def test_longest_match_and_continuation_counts_match_brute_force(documents, context, depth):
    store = Datastore.from_documents([np.array(d, dtype=np.int32) for d in documents])
    length, low, high = store.longest_match(context, 1, 6)
    expected_length = next(
        (size for size in range(min(6, len(context)), 0, -1) if occurrences(store.tokens, context[-size:])),
        0,
    )
    assert length == expected_length
    if not length:
        assert (low, high) == (0, 0)
        return
    starts = occurrences(store.tokens, context[-length:])
    assert high - low == len(starts)
    rows = store.continuations(low, high, length, depth, max_matches=1000)
    assert rows.tolist() == sorted(rows.tolist())
    expected = brute_continuation_counts(store.tokens, [start + length for start in starts], depth)
    assert trie_counts(rows) == expected


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.integers(1, 3), st.integers(1, 5))
def test_context_scan_equals_the_suffix_array_look_up(context, min_length, depth):
    """Retrieval from the context by scanning gives what an index of the context gives (its own end excluded)."""
    length, rows = context_continuations(context, min_length, 6, depth, max_matches=1000)
    store = Datastore.from_documents([np.asarray(context, dtype=np.int32)])
    expected_length, low, high = store.longest_match(context, min_length, 6)
    assert length == expected_length
    if length:
        assert rows.tolist() == store.continuations(low, high, length, depth, 1000).tolist()
    else:
        assert rows.shape == (0, depth)
    few = context_continuations(context, min_length, 6, depth, max_matches=2)[1]
    assert len(few) <= 2 and few.tolist() == sorted(few.tolist())


def test_match_range_counts_every_occurrence():
    rng = random.Random(3)
    documents = [np.array([rng.randrange(5) for _ in range(200)], dtype=np.int32) for _ in range(3)]
    store = Datastore.from_documents(documents)
    for size in range(1, 5):
        for _ in range(20):
            pattern = [rng.randrange(5) for _ in range(size)]
            low, high = store.match_range(pattern)
            found = sorted(store.suffixes[low:high].tolist())
            brute = [s for s in range(len(store.tokens) - size + 1) if store.tokens[s : s + size].tolist() == pattern]
            assert found == brute
    assert store.match_range([]) == (0, 0)
    assert store.match_range([99]) == (0, 0)


def test_many_occurrences_are_sampled_evenly():
    """With more occurrences than ``max_matches``, the sample keeps each continuation's share."""
    document = np.array([7, 1] * 300 + [7, 2] * 100, dtype=np.int32)
    store = Datastore.from_documents([document])
    length, low, high = store.longest_match([7], 1, 1)
    assert (length, high - low) == (1, 400)
    rows = store.continuations(low, high, length, 1, max_matches=40)
    assert len(rows) == 40
    assert Counter(rows[:, 0].tolist()) == {1: 30, 2: 10}


def test_continuations_stop_at_document_ends():
    store = Datastore.from_documents([np.array([1, 2, 3], dtype=np.int32), np.array([1, 2], dtype=np.int32)])
    length, low, high = store.longest_match([5, 1, 2], 1, 3)
    assert (length, high - low) == (2, 1)  # "1 2" ends the second document: not a match with a continuation
    assert store.continuations(low, high, length, 3, 10).tolist() == [[3, SEPARATOR, SEPARATOR]]


def test_empty_and_degenerate_datastores():
    empty = Datastore.from_documents([])
    assert len(empty) == 0 and empty.longest_match([1, 2], 1, 2) == (0, 0, 0)
    single = Datastore.from_documents([np.array([4, 4, 4, 4], dtype=np.int32)])
    assert single.longest_match([4, 4, 4, 4], 1, 8)[0] == 3
    tokens, parents, counts, depths = continuation_trie(np.zeros((0, 3), dtype=np.int32))
    assert len(tokens) == len(parents) == len(counts) == len(depths) == 0


def test_save_load_round_trip(tmp_path):
    tokenizer = TextTokenizer()
    store = build_datastore(tokenizer, ["hello world, hello there", "another document"], max_tokens=1000)
    path = tmp_path / "store.npz"
    store.save(path)
    loaded = Datastore.load(path, tokenizer=tokenizer)
    assert np.array_equal(loaded.tokens, store.tokens)
    assert np.array_equal(loaded.suffixes, store.suffixes)
    assert (loaded.vocab_size, loaded.tokenizer_name) == (VOCAB, "text-chars")
    assert loaded.tokenizer_fingerprint == store.tokenizer_fingerprint != ""
    assert loaded.longest_match(tokenizer.encode("say hello"), 2, 8)[0] == 6


def test_tokenizer_mismatch_is_refused(tmp_path):
    store = build_datastore(TextTokenizer(), ["some text to index"], max_tokens=100)
    path = tmp_path / "store.npz"
    store.save(path)
    with pytest.raises(InvalidRequestError, match="built with tokenizer text-chars"):
        Datastore.load(path, tokenizer=TextTokenizer(vocab_size=VOCAB + 1))

    class Renamed(TextTokenizer):
        def get_vocab(self):
            return {f"<{token}>": token for token in range(self.vocab_size)}

    with pytest.raises(InvalidRequestError, match="datastore build"):
        Datastore.load(path, tokenizer=Renamed())
    drafter = RestDrafter(str(path))
    with pytest.raises(InvalidRequestError, match="outside the datastore's vocabulary"):
        drafter.reset([1, 2, VOCAB + 5])


def test_bad_datastore_files_are_refused(tmp_path):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        Datastore.load(tmp_path / "missing.npz")
    text = tmp_path / "text.npz"
    text.write_text("not a datastore")
    with pytest.raises(InvalidRequestError, match="text.npz is not a numpy .npz archive"):
        Datastore.load(text)
    other = tmp_path / "other.npz"
    np.savez(other, weights=np.zeros(3))
    with pytest.raises(InvalidRequestError, match="no format_version"):
        Datastore.load(other)
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(InvalidRequestError, match="not an .npz"):
        Datastore.load(single)
    with pytest.raises(UnsupportedOptionError, match="does not exist"):
        draftwise.make_drafter(f"rest:datastore={tmp_path / 'missing.npz'}")
