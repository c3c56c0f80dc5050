"""Lookahead decoding: window geometry, Jacobi update, n-gram harvest, tree budget, exactness on tiny models."""

from __future__ import annotations

import random

import pytest
import torch
from distributions import assert_same_distribution
from equivalence import ar_token_ids, assert_same_ids_as_ar
from tiny import VOCAB, make_tiny_model, repetitive_prompt

import draftwise
from draftwise.decoding.drafter import StepOutcome
from draftwise.decoding.latency import LatencyModel
from draftwise.decoding.sampling import SamplingParams, transform_logits
from draftwise.decoding.tree import DraftTree
from draftwise.decoding.verify import Verification
from draftwise.drafters.lookahead import (
    LookaheadDrafter,
    NGramPool,
    Window,
    harvest,
    initial_window,
    rows_by_path,
    shift_window,
)
from draftwise.errors import UnsupportedOptionError

# (tiny models passed as they are draft on the transformers backend: see conftest.transformers_rows_trusted)
pytestmark = pytest.mark.usefixtures("transformers_rows_trusted")


def counter(start: int = 1000):
    """A filler that hands out 1000, 1001, ... so tests can tell filler from real tokens."""
    state = [start]

    def fill() -> int:
        state[0] += 1
        return state[0] - 1

    return fill


def window_of(levels: list[list[int]], fresh: bool = True) -> Window:
    return Window(tuple(map(tuple, levels)), tuple((fresh,) * len(level) for level in levels))


def fake_outcome(tree: DraftTree, choices: dict[int, int], emitted: tuple[int, ...], root: int, vocab: int = 50):
    """A StepOutcome whose logits make ``choices[row]`` (default token 0) the greedy token of each row."""
    logits = torch.zeros(len(tree) + 1, vocab)
    for row in range(len(tree) + 1):
        logits[row, choices.get(row, 0)] = 1.0
    verification = Verification(accepted_nodes=(), tokens=emitted, attempted=1)
    return StepOutcome(tree, verification, logits, context=(7, root), emitted=emitted)


# ---------------------------------------------------------------------------------------------- window geometry


def test_initial_window_shape_and_filler():
    window = initial_window(width=4, levels=3, fill=counter())
    assert [len(level) for level in window.levels] == [3, 4, 4]
    assert window.width == 4
    assert not any(flag for flags in window.fresh for flag in flags)
    assert sorted(token for level in window.levels for token in level) == list(range(1000, 1011))


def test_column_paths_follow_the_published_mask():
    # Level 0 guesses root+1.., level l >= 1 guesses root+l..: a level-l token of column j sees level 0 up to the
    # column, then the column's tokens on levels 1..l.
    window = window_of([[10, 11, 12], [20, 21, 22, 23], [30, 31, 32, 33]])
    assert window.column_paths() == [(20, 30), (10, 21, 31), (10, 11, 22, 32), (10, 11, 12, 23, 33)]
    # Position of a node = root position + depth: column j's level-l token sits at depth j + l.
    for column, path in enumerate(window.column_paths()):
        assert len(path) == column + 2


def test_shift_keeps_every_guess_on_its_position():
    window = window_of([[10, 11, 12], [20, 21, 22, 23], [30, 31, 32, 33]])
    newest = [40, 41, 42, 43]
    # One token emitted: level 0 <- level 1 minus its first guess, level 1 <- level 2, level 2 <- the new iterates.
    one = shift_window(window, newest, emitted=1, fill=counter())
    assert one.levels == ((21, 22, 23), (30, 31, 32, 33), (40, 41, 42, 43))
    assert all(all(flags) for flags in one.fresh)
    # Three emitted: every level drops two more guesses (now in the past) and is refilled at its far end.
    three = shift_window(window, newest, emitted=3, fill=counter())
    assert three.levels == ((23, 1000, 1001), (32, 33, 1002, 1003), (42, 43, 1004, 1005))
    assert three.fresh == ((True, False, False), (True, True, False, False), (True, True, False, False))
    # Absolute positions (root r, then r + 3): level 2's column 2 guessed r + 4, and now sits at column 0 of
    # level 1, which guesses (r + 3) + 1.
    with pytest.raises(ValueError):
        shift_window(window, newest, emitted=0, fill=counter())


def test_shift_pads_columns_the_tree_did_not_evaluate():
    window = window_of([[10, 11], [20, 21, 22]])
    shifted = shift_window(window, [40], emitted=1, fill=counter())
    assert shifted.levels == ((21, 22), (40, 1000, 1001))
    assert shifted.fresh == ((True, True), (True, False, False))


def test_harvest_reads_columns_and_skips_filler():
    window = Window(
        ((10, 11, 12), (20, 21, 22, 23), (30, 31, 32, 33)),
        ((False, False, False), (True, True, False, True), (True, True, True, True)),
    )
    ngrams = list(harvest(window, root=5, newest=[40, 41, 42]))
    # Column 0 is keyed by the root, column j by level 0's token of column j - 1; column 2 holds filler; column 3
    # was not evaluated. Level 0 itself may be filler: only the key is read from it.
    assert ngrams == [(5, 20, 30, 40), (10, 21, 31, 41)]


def test_pool_is_bounded_per_key_and_most_recent_first():
    pool = NGramPool(capacity=2)
    for ngram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (9, 8, 7)]:
        pool.add(ngram)
    assert pool.guesses(1) == [(6, 7), (2, 3)]  # (4, 5) was the least recent
    assert pool.guesses(9) == [(8, 7)]
    assert pool.guesses(3) == []
    assert len(pool) == 3
    empty = NGramPool(capacity=0)
    empty.add((1, 2, 3))
    assert len(empty) == 0


def test_rows_by_path():
    tree = DraftTree.from_paths([(1, 2), (1, 3), (4,)])
    assert rows_by_path(tree) == {(1,): 1, (1, 2): 2, (1, 3): 3, (4,): 4}


# ---------------------------------------------------------------------------------------------- propose / observe


def primed_drafter(**options) -> LookaheadDrafter:
    drafter = LookaheadDrafter(context_ngrams=False, **options)
    drafter.reset([7, 5])
    return drafter


def token_paths(tree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[node] for node in tree.path_to(index)) for index in range(len(tree))]


def test_propose_scores_the_pool_and_the_window_like_any_draft():
    drafter = primed_drafter(window=3, levels=3, guess_set=2)
    drafter._window = window_of([[10, 11], [20, 21, 22], [30, 31, 32]])
    drafter.pool.add((5, 60, 61, 62))
    drafter.pool.add((5, 70, 71, 72))
    tree = drafter.propose([7, 5], budget=100)
    # Every verification n-gram and every column of the window, each node once.
    assert set(token_paths(tree)) == {
        (70,), (70, 71), (70, 71, 72), (60,), (60, 61), (60, 61, 62),
        (20,), (20, 30), (10,), (10, 21), (10, 21, 31), (10, 11), (10, 11, 22), (10, 11, 22, 32),
    }
    # Scored, so the engine verifies only the rows that pay; scores never grow along a path.
    assert tree.scores is not None and all(0 < score <= 1 for score in tree.scores)
    assert all(tree.scores[node] <= tree.scores[parent] for node, parent in enumerate(tree.parents) if parent >= 0)
    # Before anything is learned both kinds score alike: a budget keeps the shallowest nodes, the pool's first.
    cut = drafter.propose([7, 5], budget=5)
    assert token_paths(cut) == [(70,), (60,), (20,), (10,), (70, 71)]


def test_window_rows_that_never_pay_fall_behind_the_pool():
    drafter = primed_drafter(window=3, levels=3, guess_set=2)
    drafter._window = window_of([[10, 11], [20, 21, 22], [30, 31, 32]])
    drafter.pool.add((5, 60, 61, 62))
    for _ in range(30):
        tree = drafter.propose([7, 5], budget=100)
        pool = tree.child(-1, 60)
        # The pool's n-gram is accepted twice over, the window never.
        drafter.acceptance.learn_step(tree, Verification((pool, tree.child(pool, 61)), (60, 61, 9), 3), drafter._kind_of_path)
    tree = drafter.propose([7, 5], budget=100)
    window_scores = [tree.scores[tree.child(-1, token)] for token in (10, 20)]
    assert tree.scores[tree.child(-1, 60)] > 2 * max(window_scores)


def test_shared_chains_are_merged():
    drafter = primed_drafter(window=3, levels=2, guess_set=2)
    # Column 0's level-1 token equals level 0's first token (a converged guess), and a pool n-gram starts the same.
    drafter._window = window_of([[10, 11], [10, 21, 22]])
    drafter.pool.add((5, 10, 21))
    tree = drafter.propose([7, 5], budget=100)
    assert tree.tokens == (10, 21, 11, 22)
    assert tree.parents == (-1, 0, 0, 2)


@pytest.mark.parametrize("budget", [0, 1, 2, 5, 8, 13, 40])
def test_proposals_respect_budget_and_parent_order(tiny_llama, budget):
    drafter = LookaheadDrafter(window=4, levels=3, guess_set=3)
    prompt = repetitive_prompt(random.Random(budget), low=20, high=30)
    draftwise.generate(tiny_llama, None, prompt_ids=prompt, method=drafter, max_new_tokens=20)
    tree = drafter.propose([*prompt, 3], budget)
    assert len(tree) <= budget
    assert all(parent < node for node, parent in enumerate(tree.parents))
    full = drafter.propose([*prompt, 3], 1000)
    assert len(full) <= 3 + 4 * 2 + 3 * 3
    assert set(token_paths(tree)) <= set(token_paths(full))


def test_observe_applies_the_jacobi_update_and_harvests():
    drafter = primed_drafter(window=3, levels=2, guess_set=4)
    drafter._window = window_of([[10, 11], [20, 21, 22]])
    tree = drafter.propose([7, 5], budget=100)
    rows = rows_by_path(tree)
    # The model's greedy tokens at the newest level of each column: 40, 41, 42.
    choices = {rows[(20,)]: 40, rows[(10, 21)]: 41, rows[(10, 11, 22)]: 42}
    drafter.observe(fake_outcome(tree, choices, emitted=(9,), root=5))
    assert drafter.pool.guesses(5) == [(20, 40)]
    assert drafter.pool.guesses(10) == [(21, 41)]
    assert drafter.pool.guesses(11) == [(22, 42)]
    assert drafter._window.levels == ((21, 22), (40, 41, 42))
    assert drafter._window.fresh == ((True, True), (True, True, True))


def test_observe_of_a_cut_tree_updates_the_evaluated_columns_only():
    drafter = primed_drafter(window=3, levels=2, guess_set=4)
    drafter._window = window_of([[10, 11], [20, 21, 22]])
    tree = drafter.propose([7, 5], budget=100).cut(budget=3)  # nodes 20, 10, 21: column 2 is lost
    rows = rows_by_path(tree)
    assert set(rows) == {(20,), (10,), (10, 21)}
    drafter.observe(fake_outcome(tree, {rows[(20,)]: 40, rows[(10, 21)]: 41}, emitted=(9, 8), root=5))
    assert drafter.pool.guesses(5) == [(20, 40)] and drafter.pool.guesses(10) == [(21, 41)]
    assert drafter.pool.guesses(11) == []
    # Two tokens emitted: level 0 <- level 1 from column 2; level 1 <- new iterates from column 1, then filler.
    assert drafter._window.levels[0][0] == 22
    assert drafter._window.levels[1][0] == 41
    assert drafter._window.fresh == ((True, False), (True, False, False))


def test_filler_comes_from_the_context_and_is_not_harvested():
    drafter = LookaheadDrafter(window=4, levels=3, guess_set=3, context_ngrams=False, seed=5)
    prompt = [11, 12, 13, 14]
    drafter.reset(prompt)
    assert {token for level in drafter._window.levels for token in level} <= set(prompt)
    tree = drafter.propose([*prompt, 15], budget=100)
    # Two steps are needed before a column holds only model predictions on levels 1 and 2.
    for step in range(2):
        drafter.observe(fake_outcome(tree, {}, emitted=(3,), root=15))
        assert len(drafter.pool) == 0, step
        tree = drafter.propose([*prompt, 15, 3], budget=100)
    drafter.observe(fake_outcome(tree, {}, emitted=(3,), root=3))
    assert len(drafter.pool) > 0


def test_context_ngrams_seed_the_pool():
    drafter = LookaheadDrafter(window=2, levels=2, guess_set=3)
    drafter.reset([1, 2, 3, 1, 4, 5])
    tree = drafter.propose([1, 2, 3, 1, 4, 5, 1], budget=100)
    assert drafter.pool.guesses(1) == [(4, 5), (2, 3)]
    assert {(4,), (4, 5), (2,), (2, 3)} <= set(token_paths(tree))
    # Later calls index only the new tokens.
    drafter.propose([1, 2, 3, 1, 4, 5, 1, 6], budget=100)
    assert drafter.pool.guesses(5) == [(1, 6)]


# ---------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "spec",
    [
        "lookahead:window=0",
        "lookahead:levels=1",
        "lookahead:guess_set=-1",
        "lookahead:window=2.5",
        "lookahead:window=true",
        "lookahead:context_ngrams=3",
        "lookahead:seed=-1",
        "lookahead:ngram=4",
    ],
)
def test_bad_options_are_refused(spec):
    with pytest.raises(UnsupportedOptionError):
        draftwise.make_drafter(spec)


def test_options_and_registration():
    assert draftwise.METHODS["lookahead"] is LookaheadDrafter
    drafter = draftwise.make_drafter("lookahead:window=7,levels=4,guess_set=7,context_ngrams=false")
    assert (drafter.window, drafter.levels, drafter.guess_set, drafter.context_ngrams) == (7, 4, 7, False)
    with pytest.raises(UnsupportedOptionError):
        LookaheadDrafter(levels=0)


# ---------------------------------------------------------------------------------------------- end to end


def _cases(seed: int, count: int = 12):
    rng = random.Random(seed)
    return [(repetitive_prompt(rng), rng.randint(20, 40)) for _ in range(count)]


@pytest.mark.parametrize(
    "spec, budget, seed",
    [
        ("lookahead", 16, 1),
        ("lookahead:window=4,levels=3,guess_set=4,context_ngrams=false", 32, 2),
        ("lookahead:window=7,levels=4,guess_set=7", 8, 3),  # cut hard by the budget every step
        ("lookahead:window=1,levels=2,guess_set=0", 16, 4),
    ],
)
def test_greedy_ids_match_ar(tiny_model, spec, budget, seed, monkeypatch):
    # Rows priced as free, whatever is measured: whether a tiny model's drafts pay for their drafting time depends on
    # the machine's load, and this test is about lookahead's drafts being exact and accepted.
    monkeypatch.setattr(LatencyModel, "of", classmethod(lambda cls, target: cls(prior={1: 1.0, 1024: 1.0})))
    monkeypatch.setattr(LatencyModel, "record", lambda self, *args, **kwargs: None)
    drafter = draftwise.make_drafter(spec)  # one instance: the pool carries over between prompts
    prompts, lengths = zip(*_cases(seed))
    # Without guesses (guess_set=0) only the prompt's own n-grams draft: acceptance is not asked for.
    results = assert_same_ids_as_ar(tiny_model, None, prompts, drafter, max_new_tokens=lengths, budget=budget,
                                    require_drafting="guess_set=0" not in spec)
    for result in results:
        assert result.stats.drafted_tokens <= budget * (result.stats.steps - 1)


def test_pool_outlives_requests_and_helps(tiny_qwen2, monkeypatch):
    # Rows priced as free (as above): whether the first request's drafts pay for their drafting time, and so are
    # verified and harvested, depends on the machine's load; this test is about the pool.
    monkeypatch.setattr(LatencyModel, "of", classmethod(lambda cls, target: cls(prior={1: 1.0, 1024: 1.0})))
    monkeypatch.setattr(LatencyModel, "record", lambda self, *args, **kwargs: None)
    prompt = repetitive_prompt(random.Random(3), low=12, high=12)
    drafter = LookaheadDrafter(context_ngrams=False)
    first = draftwise.generate(tiny_qwen2, None, prompt_ids=prompt, method=drafter, max_new_tokens=40)
    harvested = len(drafter.pool)
    assert harvested > 0
    second = draftwise.generate(tiny_qwen2, None, prompt_ids=prompt, method=drafter, max_new_tokens=40)
    assert second.token_ids == first.token_ids == ar_token_ids(tiny_qwen2, None, [prompt], max_new_tokens=40)[0]
    assert second.stats.mean_accepted_tokens > first.stats.mean_accepted_tokens


def test_sampling_runs_and_is_reproducible(tiny_llama):
    prompt = repetitive_prompt(random.Random(8), low=20, high=20)
    options = dict(temperature=0.8, top_p=0.95, seed=4)
    runs = [
        draftwise.generate(tiny_llama, None, prompt_ids=prompt, method=LookaheadDrafter(), max_new_tokens=40, **options)
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert len(runs[0].token_ids) == 40
    assert all(0 <= token < VOCAB for token in runs[0].token_ids)


def exact_marginals(model, prompt, params: SamplingParams, count: int) -> list[torch.Tensor]:
    """Exact distribution of each of the first ``count`` generated tokens under plain sampling with ``params``."""
    marginals = []
    frontier = {(): 1.0}  # generated prefix -> its probability
    with torch.inference_mode():
        for _ in range(count):
            marginal = torch.zeros(model.config.vocab_size, dtype=torch.float64)
            grown = {}
            for prefix, weight in frontier.items():
                context = [*prompt, *prefix]
                logits = model(torch.tensor([context])).logits[0, -1:]
                probabilities = torch.softmax(transform_logits(logits, params, context)[0].double(), -1)
                marginal += weight * probabilities
                for token in torch.nonzero(probabilities).flatten().tolist():
                    grown[(*prefix, token)] = weight * float(probabilities[token])
            marginals.append(marginal)
            frontier = grown
    return marginals


def test_sampling_keeps_the_plain_distribution():
    model = make_tiny_model("llama", seed=3, vocab=12, scale=1.5)
    prompt = [1, 5, 7, 5, 7, 3]
    params = SamplingParams(temperature=0.9)
    expected = exact_marginals(model, prompt, params, count=3)
    drafter = LookaheadDrafter(window=3, levels=2, guess_set=3)
    samples: list[list[int]] = [[], [], []]
    accepted = 0
    for seed in range(1200):
        result = draftwise.generate(model, None, prompt_ids=prompt, method=drafter, max_new_tokens=3, seed=seed,
                                    temperature=0.9)
        for position, token in enumerate(result.token_ids):
            samples[position].append(token)
        accepted += result.stats.accepted_tokens
    # Drafts were on offer and taken, so the check covers tokens drawn at draft rows of a tree forward.
    assert accepted > 100
    for position in range(3):
        assert_same_distribution(samples[position], expected[position])
