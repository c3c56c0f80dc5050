"""REST: the suffix-array datastore (look-ups and continuation counts against brute force, files, tokenizer checks),
the retrieval drafter (exactness, budget, no datastore) and ``draftwise datastore build``."""

from __future__ import annotations

import random
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import draftwise
from draftwise.acceptance import PRIOR_MEANS
from draftwise import cli
from draftwise.data import default_spec_bench_path
from draftwise.datastore import (
    SEPARATOR,
    Datastore,
    build_datastore,
    context_continuations,
    continuation_trie,
    suffix_array,
)
from draftwise.drafters.rest import RestDrafter
from draftwise.errors import DraftwiseError, InvalidRequestError, UnsupportedOptionError

from tiny import VOCAB, CharTokenizer, repetitive_prompt


class TextTokenizer(CharTokenizer):
    """A character tokenizer with the parts of the transformers interface a datastore build uses."""

    name_or_path = "text-chars"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encode_text(text)

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return {chr(self.OFFSET + token): token for token in range(self.vocab_size)}


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


# ------------------------------------------------------------------------------------------------ datastore


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
    store = Datastore.from_tokens(context)
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
    single = Datastore.from_tokens([4, 4, 4, 4])
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
    with pytest.raises(InvalidRequestError, match="not a draftwise datastore"):
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


def test_build_respects_the_token_bound():
    store = build_datastore(TextTokenizer(), ["x" * 500, "y" * 500], max_tokens=300)
    assert len(store) == 300
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        build_datastore(TextTokenizer(), ["abc"], max_tokens=0)
    with pytest.raises(InvalidRequestError, match="no text"):
        build_datastore(TextTokenizer(), ["", ""], max_tokens=10)


# -------------------------------------------------------------------------------------------------- drafter


def test_no_datastore_retrieves_from_the_context_only():
    drafter = draftwise.make_drafter("rest")
    assert isinstance(drafter, RestDrafter) and drafter.datastore is None
    assert len(drafter.propose((1, 2, 3, 4, 5), 16)) == 0  # nothing repeats
    tree = drafter.propose((1, 2, 3, 4, 1, 2), 16)
    assert tree.tokens == (3, 4, 1, 2)
    with pytest.raises(UnsupportedOptionError, match="datastore is needed"):
        draftwise.make_drafter("rest:context=false")
    with pytest.raises(UnsupportedOptionError, match="min_suffix"):
        draftwise.make_drafter("rest:min_suffix=5,max_suffix=3")


def test_tree_is_the_most_frequent_continuations_with_scores():
    document = np.array([9, 8, 1, 2, 3] * 6 + [9, 8, 1, 5] * 2 + [9, 8, 6], dtype=np.int32)
    drafter = RestDrafter(Datastore.from_documents([document]), context=False, depth=3)
    tree = drafter.propose((4, 9, 8), 64)
    paths = {tuple(tree.tokens[node] for node in tree.path_to(index)): tree.scores[index] for index in range(len(tree))}
    assert (1, 2, 3) in paths and (1, 5, 9) in paths and (6,) in paths
    # Scores follow the continuation shares: "1" continues 8 of 9 occurrences, "6" one; "1 2" 6 of those 8.
    first, second = PRIOR_MEANS[:2]  # nothing learned yet: the acceptance prior
    assert paths[(1,)] == pytest.approx(8 / 9 * first) and paths[(6,)] == pytest.approx(1 / 9 * first)
    assert paths[(1, 2)] == pytest.approx(paths[(1,)] * 6 / 8 * second)
    small = drafter.propose((4, 9, 8), 3)
    assert len(small) == 3 and small.scores == tuple(sorted(small.scores, reverse=True))


def test_learns_from_emitted_tokens_even_when_nothing_was_verified():
    """The trie is checked against the model's emitted tokens, so estimates keep learning when the engine verified
    none of it (a drafter whose scores fell below the cost of verifying must be able to recover)."""
    from draftwise.drafters.base import StepOutcome
    from draftwise.drafters.rest import match_length_bucket
    from draftwise.tree import DraftTree
    from draftwise.verify import Verification

    document = np.array([9, 8, 1, 2, 3] * 6, dtype=np.int32)
    drafter = RestDrafter(Datastore.from_documents([document]), context=False, depth=3)
    kind = ("datastore", match_length_bucket(2))
    before = drafter.acceptance.rate(kind, 1)
    for _ in range(5):
        assert len(drafter.propose((4, 9, 8), 16)) == 3
        drafter.observe(StepOutcome(DraftTree(), Verification((), (1,), 0), None, (4, 9, 8, 1)))
    assert drafter.acceptance.rate(kind, 1) > before  # the model's token was the trie's
    assert (kind, 2) not in drafter.acceptance._counts  # depth 2 was never reached: nothing recorded there
    learned = drafter.acceptance.rate(kind, 1)
    drafter.propose((4, 9, 8), 16)
    drafter.observe(StepOutcome(DraftTree(), Verification((), (7,), 0), None, (4, 9, 8, 7)))
    missed = drafter.acceptance.rate(kind, 1)
    assert missed < learned  # a token the trie did not hold
    drafter.observe(StepOutcome(DraftTree(), Verification((), (1,), 0), None, (4, 9, 8, 7)))
    assert drafter.acceptance.rate(kind, 1) == missed  # no proposal since the last observation: nothing to learn


@pytest.mark.parametrize("budget", [0, 1, 3, 16])
def test_budget_respected(budget):
    rng = random.Random(budget)
    document = np.array([rng.randrange(6) for _ in range(2000)], dtype=np.int32)
    drafter = RestDrafter(Datastore.from_documents([document]), max_nodes=64)
    for _ in range(20):
        context = tuple(rng.randrange(6) for _ in range(rng.randint(1, 30)))
        tree = drafter.propose(context, budget)
        assert len(tree) <= budget
        assert tree.max_depth <= drafter.depth


def _reference_store(model, seed: int) -> tuple[Datastore, list[tuple[list[int], int]]]:
    """Prompts, and a datastore of what the model generates after prompts like them (same segments, other
    prompts): the retrieval a corpus gives on text like the one being generated."""
    rng = random.Random(seed)
    cases = [(repetitive_prompt(rng), rng.randint(24, 40)) for _ in range(8)]
    corpus = []
    for prompt, max_new_tokens in cases:
        result = draftwise.generate(model, None, prompt_ids=prompt, method="ar", max_new_tokens=max_new_tokens)
        corpus.append(np.array(prompt + result.token_ids, dtype=np.int32))
    return Datastore.from_documents(corpus, vocab_size=VOCAB), cases


@pytest.mark.parametrize("context", [False, True])
def test_greedy_ids_equal_ar(tiny_model, context):
    store, cases = _reference_store(tiny_model, seed=11)
    drafter = RestDrafter(store, context=context)
    steps = tokens = 0
    rng = random.Random(5)
    for prompt, max_new_tokens in cases + [(repetitive_prompt(rng), 30) for _ in range(4)]:
        expected = draftwise.generate(tiny_model, None, prompt_ids=prompt, method="ar", max_new_tokens=max_new_tokens)
        result = draftwise.generate(tiny_model, None, prompt_ids=prompt, method=drafter, max_new_tokens=max_new_tokens)
        assert result.token_ids == expected.token_ids
        steps += result.stats.steps
        tokens += result.stats.new_tokens
    assert steps < tokens / 2, "the datastore holds these continuations: most should be drafted"


def test_datastore_path_through_the_method_spec(tmp_path, tiny_llama):
    store, cases = _reference_store(tiny_llama, seed=12)
    path = tmp_path / "store.npz"
    store.save(path)
    prompt, max_new_tokens = cases[0]
    expected = draftwise.generate(tiny_llama, None, prompt_ids=prompt, method="ar", max_new_tokens=max_new_tokens)
    result = draftwise.generate(
        tiny_llama, None, prompt_ids=prompt, method=f"rest:datastore={path},context=false", max_new_tokens=max_new_tokens
    )
    assert result.token_ids == expected.token_ids
    assert result.stats.steps < result.stats.new_tokens


def test_drafting_is_fast():
    """A step's look-ups and trie stay in milliseconds on a million-token datastore."""
    rng = np.random.default_rng(0)
    phrases = rng.integers(0, 5000, size=(2000, 12))
    document = phrases[rng.integers(0, 2000, size=80_000)].reshape(-1).astype(np.int32)
    drafter = RestDrafter(Datastore.from_documents([document]), max_matches=256)
    context = tuple(int(token) for token in document[5000:5400])
    drafter.propose(context, 16)
    started = time.perf_counter()
    for end in range(5300, 5400):
        drafter.propose(context[: end - 5000], 16)
    assert (time.perf_counter() - started) / 100 < 0.02


# ------------------------------------------------------------------------------------------------------ CLI


@pytest.fixture
def tiny_cli(monkeypatch, tiny_llama):
    monkeypatch.setattr(cli, "_load", lambda args: (tiny_llama, TextTokenizer()))


def test_cli_builds_a_datastore(tiny_cli, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the cat sat on the mat. " * 20)
    (corpus / "b.jsonl").write_text('{"text": "the dog sat on the log."}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abcabc\nxyzxyz\n")
    out = tmp_path / "store.npz"
    argv = ["datastore", "build", "--out", str(out), "--max-tokens", "400", "--self-generate", str(prompts),
            "--max-new-tokens", "8", str(corpus)]
    assert cli.main(argv) == 0
    assert "400 tokens" in capsys.readouterr().err
    store = Datastore.load(out, tokenizer=TextTokenizer())
    assert len(store) == 400
    assert store.match_range(TextTokenizer().encode("the cat sat"))[1] > 0


def test_cli_refuses_benchmark_data_and_bad_input(tiny_cli, tmp_path, capsys):
    spec_bench = default_spec_bench_path()
    if spec_bench is not None:
        assert cli.main(["datastore", "build", "--out", str(tmp_path / "s.npz"), str(spec_bench)]) == 2
        assert "benchmark prompts" in capsys.readouterr().err
        assert cli.main(["datastore", "build", "--out", str(tmp_path / "s.npz"), str(spec_bench.parent)]) == 2
    assert cli.main(["datastore", "build", "--out", str(tmp_path / "s.npz")]) == 2
    assert "at least one source" in capsys.readouterr().err
    assert cli.main(["datastore", "build", "--out", str(tmp_path / "s.npz"), "no-such-source"]) == 2
    assert "unknown source" in capsys.readouterr().err
    assert cli.main(["datastore", "build", "--out", str(tmp_path / "s.npz"), "--max-tokens", "0", "stdlib"]) == 2
    assert not (tmp_path / "s.npz").exists()
    with pytest.raises(DraftwiseError):
        Datastore.load(tmp_path / "s.npz")


@pytest.mark.slow
def test_real_model_rest_matches_ar(tmp_path):
    """SmolLM2 with a small datastore of package documentation: same ids as plain greedy decoding."""
    from draftwise.sources import documents

    model, tokenizer = draftwise.load_model("smollm2-135m")
    store = build_datastore(tokenizer, documents(["package-docs"]), max_tokens=300_000)
    drafter = RestDrafter(store)
    for prompt in ("Explain what a Python virtual environment is.", "Write a function that reverses a list."):
        messages = [{"role": "user", "content": prompt}]
        expected = draftwise.generate(model, tokenizer, messages, method="ar", max_new_tokens=64)
        result = draftwise.generate(model, tokenizer, messages, method=drafter, max_new_tokens=64)
        assert result.token_ids == expected.token_ids
