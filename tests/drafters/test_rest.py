"""REST: the retrieval drafter (exactness, budget, no datastore) and ``draftwise datastore build``."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from equivalence import ar_token_ids, assert_same_ids_as_ar
from hypothesis import strategies as st
from tiny import VOCAB, TextTokenizer, repetitive_prompt

import draftwise
from draftwise import cli
from draftwise.bench.prompts import spec_bench_path
from draftwise.drafters.rest import RestDrafter
from draftwise.drafters.stores.acceptance import PRIOR_MEANS
from draftwise.drafters.stores.datastore import (
    Datastore,
)
from draftwise.errors import DraftwiseError, UnsupportedOptionError

# (tiny models passed as they are draft on the transformers backend: see conftest.transformers_rows_trusted)
pytestmark = pytest.mark.usefixtures("transformers_rows_trusted")

documents_strategy = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=25), min_size=1, max_size=5)


def occurrences(tokens: np.ndarray, pattern: list[int]) -> list[int]:
    """Start positions of ``pattern`` followed by a token (not a separator)."""
    size = len(pattern)
    return [
        start
        for start in range(len(tokens) - size)
        if tokens[start : start + size].tolist() == pattern and tokens[start + size] >= 0
    ]


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
    from draftwise.decoding.drafter import StepOutcome
    from draftwise.decoding.tree import DraftTree
    from draftwise.decoding.verify import Verification
    from draftwise.drafters.rest import match_length_bucket

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
    prompts, lengths = zip(*cases)
    outputs = ar_token_ids(model, None, prompts, max_new_tokens=lengths)
    corpus = [np.array(prompt + output, dtype=np.int32) for prompt, output in zip(prompts, outputs)]
    return Datastore.from_documents(corpus, vocab_size=VOCAB), cases


@pytest.mark.parametrize("context", [False, True])
def test_greedy_ids_equal_ar(tiny_model, context):
    store, cases = _reference_store(tiny_model, seed=11)
    drafter = RestDrafter(store, context=context)
    rng = random.Random(5)
    prompts, lengths = zip(*(cases + [(repetitive_prompt(rng), 30) for _ in range(4)]))
    results = assert_same_ids_as_ar(tiny_model, None, prompts, drafter, max_new_tokens=lengths)
    steps = sum(result.stats.steps for result in results)
    tokens = sum(result.stats.new_tokens for result in results)
    assert steps < tokens / 2, "the datastore holds these continuations: most should be drafted"


def test_datastore_path_through_the_method_spec(tmp_path, tiny_llama):
    store, cases = _reference_store(tiny_llama, seed=12)
    path = tmp_path / "store.npz"
    store.save(path)
    prompt, max_new_tokens = cases[0]
    assert_same_ids_as_ar(tiny_llama, None, [prompt], f"rest:datastore={path},context=false",
                          max_new_tokens=max_new_tokens)


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
    monkeypatch.setattr(cli.common, "load", lambda args, options=None: (tiny_llama, TextTokenizer()))


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
    spec_bench = spec_bench_path()
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
