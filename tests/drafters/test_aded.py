"""ADED: the Monte-Carlo tree search, the drafter (budget, scores, online learning, saved state, options) and its
exactness against plain greedy decoding."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from equivalence import ar_token_ids, assert_same_ids_as_ar
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import repetitive_prompt

import draftwise
from draftwise.corpus.build import TrigramCounter
from draftwise.decoding.drafter import StepOutcome
from draftwise.decoding.tree import DraftTree
from draftwise.decoding.verify import verify_greedy
from draftwise.drafters import make_drafter
from draftwise.drafters.aded import AdedDrafter, SearchTree, probability_bucket, search
from draftwise.drafters.stores.trigram import TrigramStore, pack_pair
from draftwise.errors import UnsupportedOptionError

# (tiny models passed as they are draft on the transformers backend: see conftest.transformers_rows_trusted)
pytestmark = pytest.mark.usefixtures("transformers_rows_trusted")

PROMPT = [3, 9, 4, 9, 4, 3, 9, 4, 7]


def store_from_sequences(rng: random.Random, count: int = 30, alphabet: int = 12, **options) -> TrigramStore:
    store = TrigramStore(**options)
    for _ in range(count):
        store.add_sequence([rng.randrange(alphabet) for _ in range(rng.randint(3, 15))], amount=0.5)
    return store


# ------------------------------------------------------------------------------------------------------ search


def toy_lookup(a: int, b: int) -> tuple[list[int], list[float]]:
    """Three successors of every pair; the most probable continues counting."""
    return [(b + 1) % 50, (b + 7) % 50, (b + 13) % 50], [0.6, 0.25, 0.15]


def random_lookup(seed: int, alphabet: int = 8):
    """A fixed random tri-gram model: up to four successors per pair (some pairs have none)."""

    def lookup(a: int, b: int) -> tuple[list[int], list[float]]:
        rng = random.Random(seed * 1_000_003 + a * 1009 + b)
        successors = rng.sample(range(alphabet), rng.randint(0, 4))
        weights = sorted((rng.random() + 0.01 for _ in successors), reverse=True)
        return successors, [weight / sum(weights) for weight in weights]

    return lookup


def search_with(lookup, iterations: int = 48, max_depth: int = 5, rollout_depth: int = 4, seed: int = 0) -> SearchTree:
    return search(lookup, (1, 2), iterations, max_depth, rollout_depth, 32.0, 8.0, random.Random(seed))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 80), st.integers(1, 6), st.integers(0, 4))
def test_search_invariants(seed, iterations, max_depth, rollout_depth):
    lookup = random_lookup(seed)
    tree = search_with(lookup, iterations, max_depth, rollout_depth, seed)
    again = search_with(lookup, iterations, max_depth, rollout_depth, seed)
    assert (again.tokens, again.parents, again.visits) == (tree.tokens, tree.parents, tree.visits)
    assert again.value == tree.value
    assert tree.visits[0] == iterations
    assert max(tree.depths) <= max_depth
    for node, children in enumerate(tree.children):
        assert tree.visits[node] >= sum(tree.visits[child] for child in children or ())
        for child in children or ():
            assert tree.parents[child] == node and tree.depths[child] == tree.depths[node] + 1
            assert tree.pairs[child] == (tree.tokens[node], tree.tokens[child])
            assert tree.path_probability[child] == pytest.approx(tree.path_probability[node] * tree.priors[child])
        if children:  # expanded nodes hold exactly their lookup row
            successors, probabilities = lookup(*tree.pairs[node])
            assert [tree.tokens[child] for child in children] == successors
            assert [tree.priors[child] for child in children] == probabilities
    assert tree.pairs[0] == (1, 2)


def test_search_prefers_the_most_probable_path():
    tree = search_with(toy_lookup, iterations=200, max_depth=6)
    node, path = 0, []
    while tree.children[node]:
        children = tree.children[node]
        visits = [tree.visits[child] for child in children]
        node = children[visits.index(max(visits))]
        path.append(tree.tokens[node])
    assert len(path) >= 3
    assert path == list(range(3, 3 + len(path)))  # 2 -> 3 -> 4 -> ...
    first_level = sorted(tree.children[0], key=lambda child: -tree.visits[child])
    assert [tree.tokens[child] for child in first_level] == [3, 9, 15]


def test_search_without_successors_stays_at_the_root():
    tree = search_with(lambda a, b: ([], []), iterations=10)
    assert tree.tokens == [2] and tree.visits == [10]


def test_probability_buckets():
    assert [probability_bucket(p) for p in (0.0, 0.05, 0.1, 0.3, 0.6, 0.8, 0.95, 1.0)] == [0, 0, 1, 2, 3, 4, 5, 5]


# ----------------------------------------------------------------------------------------------------- drafter


@pytest.mark.parametrize("copy_length", [0, 6])
@pytest.mark.parametrize("budget", [0, 1, 2, 5, 16, 40])
def test_proposals_respect_budget_order_and_scores(budget, copy_length):
    rng = random.Random(budget)
    drafter = AdedDrafter(max_depth=4, seed=budget, copy_length=copy_length)
    drafter.store = store_from_sequences(rng, count=60, alphabet=10)
    for _ in range(15):
        context = [rng.randrange(10) for _ in range(rng.randint(0, 12))]
        drafter.reset(context[:3])  # a new request; its context grows from here
        for end in range(len(context) + 1):
            tree = drafter.propose(tuple(context[:end]), budget)
            check_proposal(drafter, tree, end, budget)


def check_proposal(drafter: AdedDrafter, tree, context_length: int, budget: int) -> None:
    assert len(tree) <= budget
    if context_length < 2 or budget == 0:
        assert len(tree) == 0
        return
    assert all(parent < node for node, parent in enumerate(tree.parents))
    # A searched path is one token deeper than the search (its greedy extension); a copy is copy_length long.
    assert tree.max_depth <= max(drafter.max_depth + 1, drafter.copy_length)
    assert tree.scores is not None
    for node, parent in enumerate(tree.parents):
        assert 0 < tree.scores[node] <= 1
        if parent >= 0:
            assert tree.scores[node] <= tree.scores[parent]
    assert len(set(zip(tree.parents, tree.tokens))) == len(tree)


def tree_paths(tree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[node] for node in tree.path_to(index)) for index in range(len(tree))}


def test_drafts_follow_the_learned_sequence():
    """Pure tri-gram drafting: nothing before anything is learned, the learned sequence after."""
    sequence = [11, 12, 13, 14, 15, 16, 17, 18]
    drafter = AdedDrafter(copy_length=0, recycle_top_k=0)
    assert len(drafter.propose(sequence * 2, 16)) == 0  # nothing learned yet (and copying is off)
    drafter.reset(sequence * 3)  # the prompt's tri-grams
    tree = drafter.propose(tuple(sequence * 3 + sequence[:2]), 16)
    assert (13, 14, 15) in tree_paths(tree)
    assert tree.max_depth <= drafter.max_depth + 1


def test_copies_of_earlier_occurrences_join_the_tree():
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21, 1, 2, 3, 4]
    drafter = AdedDrafter(context_rate=0, copy_length=6)  # an empty store: copies only
    drafter.reset([])
    tree = drafter.propose(tuple(context), 16)
    assert (5, 6, 7, 8, 9, 20) in tree_paths(tree) and tree.max_depth == 6
    assert len(AdedDrafter(context_rate=0, copy_length=0).propose(tuple(context), 16)) == 0
    # The last 2-gram occurred twice: both continuations are copied (copy_matches=2), the latest first.
    context = [7, 8, 1, 2, 9, 7, 8, 3, 4, 5, 7, 8]
    drafter.reset([])
    paths = tree_paths(drafter.propose(tuple(context), 16))
    assert (3, 4, 5, 7, 8) in paths and (1, 2, 9, 7, 8, 3) in paths


def test_learns_online_from_an_empty_store(tiny_llama):
    drafter = AdedDrafter(copy_length=0, recycle_top_k=0)  # tri-grams only: what is drafted was learned
    assert len(drafter.propose(PROMPT, 16)) == 0
    first = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=30)
    assert len(drafter.store) > 0
    # The same request again: the store holds the model's own continuation now.
    second = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=30)
    assert second.token_ids == first.token_ids
    assert second.stats.mean_accepted_tokens > first.stats.mean_accepted_tokens
    assert second.stats.mean_accepted_tokens > 1.5
    context = tuple(PROMPT + first.token_ids[:10])
    tree = drafter.propose(context, 16)
    first_level = [tree.tokens[node] for node, parent in enumerate(tree.parents) if parent == -1]
    assert first.token_ids[10] in first_level


def test_recycled_predictions_join_the_tree(tiny_llama):
    drafter = AdedDrafter(copy_length=0, context_rate=0, learning_rate=0)  # the tri-gram store never learns
    result = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=30)
    assert len(drafter.store) == 0 and (drafter.recycled.matrix >= 0).any()
    # What is drafted now comes from the model's recycled top-k only: the root's children are among them.
    context = tuple(PROMPT + result.token_ids[:10])
    root = context[-1]
    tree = drafter.propose(context, 16)
    children = [tree.tokens[node] for node, parent in enumerate(tree.parents) if parent == -1]
    assert children and set(children) <= set(drafter.recycled.matrix[root].tolist())
    assert all(kind[0] == "recycled" for kind in drafter._kind_of_path.values())
    assert len(AdedDrafter(recycle_top_k=0, copy_length=0, context_rate=0).propose(context, 16)) == 0


def test_a_step_without_a_proposal_learns_its_own_pair(tiny_llama):
    drafter = AdedDrafter(context_rate=0)
    result = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=2)
    drafter.store.merge()
    assert pack_pair(PROMPT[-1], result.token_ids[0]) in drafter.store.keys.tolist()


def test_sources_never_verified_are_left_out_but_probed(tiny_llama):
    """Where the engine verifies none of the searched or recycled nodes (a large batch keeps a node or two a
    sequence), the drafter stops computing them after IDLE_PROPOSALS proposals, tries them again every PROBE_EVERY
    proposals, and drafts them again once one was verified."""
    drafter = AdedDrafter()
    result = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=30)
    drafter = drafter.fork()  # the learned tables, a fresh sequence
    context = tuple(PROMPT + result.token_ids[:10])
    logits = torch.zeros(1, tiny_llama.config.vocab_size)

    def propose() -> tuple[DraftTree, set[str]]:
        tree = drafter.propose(context, 16)
        return tree, {AdedDrafter._source(kind) for kind in drafter._kind_of_path.values()}

    def observe(tree: DraftTree) -> None:
        choices = [0] * (len(tree) + 1)  # (token 0 is never drafted here: nothing accepted)
        drafter.observe(StepOutcome(tree, verify_greedy(tree, choices), logits.expand(len(tree) + 1, -1), context,
                                    (0,)))

    for _ in range(AdedDrafter.IDLE_PROPOSALS):
        tree, sources = propose()
        assert {"search", "recycled"} <= sources
        observe(DraftTree())  # nothing verified
    for _ in range(AdedDrafter.PROBE_EVERY - AdedDrafter.IDLE_PROPOSALS - 1):
        _, sources = propose()
        assert not sources & {"search", "recycled"}
        observe(DraftTree())
    tree, sources = propose()  # a probe
    assert {"search", "recycled"} <= sources
    observe(tree)  # every node verified
    assert {"search", "recycled"} <= propose()[1]


def test_state_round_trip(tiny_llama, tmp_path):
    drafter = AdedDrafter()
    result = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=30)
    path = tmp_path / "aded.npz"
    drafter.save(path)
    restored = AdedDrafter(corpus=str(path))
    assert np.array_equal(restored.store.keys, drafter.store.keys)
    assert np.array_equal(restored.store.tokens, drafter.store.tokens)
    assert np.array_equal(restored.recycled.matrix, drafter.recycled.matrix)
    # A fresh drafter on the saved state proposes exactly what a fresh drafter on the original state does.
    same = AdedDrafter()
    same.store = drafter.store
    same.recycled = drafter.recycled
    context = PROMPT + result.token_ids
    for end in range(len(PROMPT), len(context)):
        proposed, expected = restored.propose(context[:end], 12), same.propose(context[:end], 12)
        assert (proposed.tokens, proposed.parents) == (expected.tokens, expected.parents)
        assert proposed.scores == expected.scores
    loaded = AdedDrafter()
    loaded.load(path)
    again = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=loaded, max_new_tokens=30)
    assert again.token_ids == result.token_ids
    assert again.stats.mean_accepted_tokens > 1.5


@pytest.mark.parametrize(
    "spec, message",
    [
        ("aded:iterations=0", "iterations"),
        ("aded:max_depth=0", "max_depth"),
        ("aded:rollout_depth=-1", "rollout_depth"),
        ("aded:paths=0", "paths"),
        ("aded:cap=0", "cap"),
        ("aded:learning_rate=-1", "learning_rate"),
        ("aded:top_k=0", "top_k"),
        ("aded:copy_length=-1", "copy_length"),
        ("aded:copy_matches=0", "copy_matches"),
        ("aded:recycle_top_k=-1", "recycle_top_k"),
        ("aded:recycle_depth=0", "recycle_depth"),
        ("aded:depth=3", "no option depth"),
        ("aded:corpus=/no/such/store.npz", "tri-gram store /no/such/store.npz does not exist"),
    ],
)
def test_bad_options_are_refused(spec, message):
    with pytest.raises(UnsupportedOptionError, match=message):
        make_drafter(spec)


def test_options_reach_the_drafter():
    drafter = make_drafter("aded:iterations=8,max_depth=3,top_k=4,seed=5")
    assert isinstance(drafter, AdedDrafter)
    assert (drafter.iterations, drafter.max_depth, drafter.store.top_k) == (8, 3, 4)


# ------------------------------------------------------------------------------------------------- exactness


def _cases(seed: int, count: int = 8) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [(repetitive_prompt(rng), rng.randint(20, 36)) for _ in range(count)]


def _self_store(model, cases) -> TrigramStore:
    """The tri-grams of the model's own greedy output after these prompts: a corpus that drafts well."""
    prompts, lengths = zip(*cases)
    outputs = ar_token_ids(model, None, prompts, max_new_tokens=lengths)
    documents = (np.array(prompt + output, dtype=np.int32) for prompt, output in zip(prompts, outputs))
    return TrigramCounter.of(documents).store()


def test_greedy_ids_equal_ar(tiny_model):
    prompts, lengths = zip(*_cases(31))
    references = ar_token_ids(tiny_model, None, prompts, max_new_tokens=lengths)
    # A fresh drafter per request, and one drafter across requests (its store keeps adapting: the prompts repeat
    # segments, so it drafts some of them).
    assert_same_ids_as_ar(tiny_model, None, prompts, "aded", max_new_tokens=lengths, expected=references,
                          require_drafting=False)
    assert_same_ids_as_ar(tiny_model, None, prompts, AdedDrafter(seed=3), max_new_tokens=lengths, expected=references,
                          budget=8)


def test_greedy_ids_equal_ar_with_a_corpus(tiny_model, tmp_path):
    cases = _cases(47)
    path = tmp_path / "corpus.npz"
    _self_store(tiny_model, cases).save(path)
    method = f"aded:corpus={path},iterations=24,copy_length=0"  # tri-grams only: acceptance comes from the corpus
    prompts, lengths = zip(*(cases + _cases(48, count=3)))
    results = assert_same_ids_as_ar(tiny_model, None, prompts, method, max_new_tokens=lengths)
    accepted = sum(result.stats.accepted_tokens for result in results)
    assert accepted > 0.5 * sum(new for _, new in cases), "the corpus holds these continuations: most are drafted"


def test_short_outputs_and_eos_inside_a_draft(tiny_llama, monkeypatch):
    """Output lengths 1 and 2 (no room to draft, one step) and an EOS met inside an accepted draft."""
    drafter = AdedDrafter()
    drafter.store = _self_store(tiny_llama, [(PROMPT, 30)])
    assert_same_ids_as_ar(tiny_llama, None, [PROMPT] * 3, drafter, max_new_tokens=[1, 2, 3], require_drafting=False)
    eos = ar_token_ids(tiny_llama, None, [PROMPT], max_new_tokens=30)[0][12]
    monkeypatch.setattr(tiny_llama.generation_config, "eos_token_id", eos)
    (result,) = assert_same_ids_as_ar(tiny_llama, None, [PROMPT], drafter, max_new_tokens=30, require_drafting=False)
    assert result.token_ids[-1] == eos and len(result.token_ids) <= 13


def test_saved_recycled_state_of_another_width_is_refused(tiny_llama, tmp_path):
    drafter = AdedDrafter()
    draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=10)
    path = tmp_path / "aded.npz"
    drafter.save(path)
    with pytest.raises(ValueError, match="successor matrix"):
        AdedDrafter(recycle_top_k=4).load(path)
    AdedDrafter(recycle_top_k=0).load(path)  # recycling off: the recycled arrays are not needed
