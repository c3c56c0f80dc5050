"""The engine's stages one by one: accept, draft, the Decoder's prefill and step, and what a drafter is handed."""

from __future__ import annotations

import torch
from tiny import OracleChainDrafter

from draftwise.decoding.drafter import Drafter, NoDrafter
from draftwise.decoding.engine import Decoder, FinishReason, SequenceState, accept, decode, draft, explore
from draftwise.decoding.latency import LatencyModel
from draftwise.decoding.tree import DraftTree

PROMPT = [3, 17, 42, 8, 8, 61, 5, 23]


def sequence(**options) -> SequenceState:
    return SequenceState(prompt_ids=tuple(PROMPT), drafter=NoDrafter(), context=list(PROMPT), **options)


def greedy_ids(model, prompt, count):
    return [token for event in decode(model, prompt, NoDrafter(), max_new_tokens=count) for token in event.tokens]


def test_accept_ends_where_plain_decoding_would():
    state = sequence(max_new_tokens=10, eos=frozenset({7}))
    event = accept(state, [1, 2, 7, 4])
    assert event.tokens == [1, 2, 7] and event.finish_reason == FinishReason.EOS
    assert state.output == [1, 2, 7] and state.context == [*PROMPT, 1, 2, 7] and state.finished

    state = sequence(max_new_tokens=3)
    assert accept(state, [1, 2, 3, 4]).tokens == [1, 2, 3] and state.finish_reason == FinishReason.LENGTH

    state = sequence(max_new_tokens=10, is_stopped=lambda output: output[-2:] == [2, 3])
    assert accept(state, [1, 2, 3, 4]).tokens == [1, 2, 3] and state.finish_reason == FinishReason.STOP

    state = sequence(max_new_tokens=10)
    assert accept(state, [1, 2]).finish_reason is None and not state.finished


class FixedDrafter(Drafter):
    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree
        self.calls = 0

    def propose(self, context, budget):
        self.calls += 1
        return self.tree


def test_draft_cuts_to_budget_and_depth_and_skips_the_drafter_without_room():
    tree = DraftTree.chain([1, 2, 3, 4, 5])
    drafter = FixedDrafter(tree)
    assert draft(drafter, PROMPT, 3, 10, LatencyModel()).tokens == (1, 2, 3)
    assert draft(drafter, PROMPT, 10, 2, LatencyModel()).tokens == (1, 2)
    calls = drafter.calls
    assert len(draft(drafter, PROMPT, 10, 0, LatencyModel())) == 0
    assert drafter.calls == calls  # no room to draft: the drafter is not asked


def test_draft_keeps_only_the_nodes_that_pay():
    scored = DraftTree((1, 2, 3), (-1, 0, 1), (0.9, 0.01, 0.001))
    latency = LatencyModel(prior={1: 1.0, 2: 1.0, 3: 2.0, 4: 3.0})
    assert draft(FixedDrafter(scored), PROMPT, 16, 10, latency).tokens == (1,)


def test_decoder_stages_over_sequence_state(tiny_llama):
    reference = greedy_ids(tiny_llama, PROMPT, 20)
    decoder = Decoder(tiny_llama, budget=8)
    state = decoder.start(PROMPT, OracleChainDrafter(PROMPT, reference, length=4), max_new_tokens=20)
    events = decoder.prefill([state])
    assert len(events) == 1 and len(events[0].tokens) == 1 and state.stats.steps == 1
    while not state.finished:
        [event] = decoder.step([state])
        assert event.tokens
    assert state.output == reference and state.finish_reason == FinishReason.LENGTH
    assert state.stats.new_tokens == 20 and state.stats.steps < 20
    # A finished sequence in a later step emits nothing and costs no forward.
    assert decoder.step([state])[0].tokens == []


class HiddenStateDrafter(Drafter):
    name = "hidden"
    wants_hidden_states = True

    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree
        self.outcomes = []

    def propose(self, context, budget):
        return self.tree

    def observe(self, outcome):
        self.outcomes.append(outcome)


def test_a_drafter_can_ask_for_hidden_states(tiny_llama):
    drafter = HiddenStateDrafter(DraftTree((5, 6, 7), (-1, 0, -1)))
    list(decode(tiny_llama, PROMPT, drafter, max_new_tokens=6))
    assert drafter.outcomes
    head = tiny_llama.get_output_embeddings()
    for outcome in drafter.outcomes:
        rows = len(outcome.tree) + 1
        assert outcome.hidden_states.shape == (rows, tiny_llama.config.hidden_size)
        with torch.inference_mode():
            torch.testing.assert_close(head(outcome.hidden_states), outcome.logits, rtol=1e-5, atol=1e-5)
    plain = HiddenStateDrafter(DraftTree((5,), (-1,)))
    plain.wants_hidden_states = False
    list(decode(tiny_llama, PROMPT, plain, max_new_tokens=3))
    assert all(outcome.hidden_states is None for outcome in plain.outcomes)


def test_step_outcome_names_the_root_and_the_emitted_tokens(tiny_llama):
    reference = greedy_ids(tiny_llama, PROMPT, 12)
    drafter = OracleChainDrafter(PROMPT, reference, length=3)
    list(decode(tiny_llama, PROMPT, drafter, max_new_tokens=12))
    emitted = 1
    for outcome in drafter.outcomes:
        assert list(outcome.context) == PROMPT + reference[:emitted]
        assert outcome.root == outcome.context[-1] and outcome.before_root == outcome.context[-2]
        assert list(outcome.emitted) == reference[emitted : emitted + len(outcome.emitted)]
        emitted += len(outcome.emitted)
    assert emitted == 12


def test_subtrees_keep_their_draft_distributions():
    probabilities = torch.softmax(torch.randn(4, 9), dim=-1)
    tree = DraftTree((1, 2, 3), (-1, 0, -1), (0.9, 0.2, 0.5), draft_probs=probabilities)
    best = tree.best(2)  # nodes 0 and 2
    assert best.tokens == (1, 3)
    assert torch.equal(best.draft_probs, probabilities[[0, 1, 3]])
    cut = tree.cut(max_depth=1)
    assert torch.equal(cut.draft_probs, probabilities[[0, 1, 3]])


def test_unscored_drafts_are_priced_from_the_acceptance_so_far():
    """A batch scores a drafter's unscored tree from the sequence's acceptance by depth (Laplace-smoothed), shared
    evenly among siblings, never growing along a path."""
    import pytest

    from draftwise.decoding.engine import scored_by_acceptance
    from draftwise.decoding.stats import GenerationStats
    from draftwise.decoding.tree import DraftTree

    stats = GenerationStats()
    stats.record_step(emitted=2, drafted=2, accepted=1, attempted=2)  # depth 1 accepted, depth 2 rejected
    tree = DraftTree((5, 6, 7), (-1, 0, 0))
    scored = scored_by_acceptance(tree, stats)
    assert scored.tokens == tree.tokens and scored.parents == tree.parents
    assert scored.scores == pytest.approx((2 / 3, 2 / 3 * 1 / 3 / 2, 2 / 3 * 1 / 3 / 2))
    assert scored_by_acceptance(DraftTree(), stats) == DraftTree()


def test_a_batch_pauses_drafting_while_drafted_steps_emit_fewer_tokens_per_second(tiny_llama):
    """Of several sequences, measured steps decide: drafted steps slower than plain ones pause drafting with a
    growing backoff; faster ones end it; batch 1 is left to the cost rule."""
    decoder = Decoder(tiny_llama)
    for _ in range(Decoder.RATE_MIN_STEPS):
        decoder._judge_by_throughput(8, False, 8, 0.040)  # 200 tokens/s without drafts
    for _ in range(Decoder.RATE_MIN_STEPS - 1):
        decoder._judge_by_throughput(8, True, 10, 0.060)  # 167 tokens/s with them: not enough steps yet
    assert decoder._pauses.get(8, [0, 0])[0] == 0
    decoder._judge_by_throughput(8, True, 10, 0.060)
    assert decoder._pauses[8][0] == 1
    decoder._judge_by_throughput(8, True, 10, 0.060)
    assert decoder._pauses[8][0] == 2  # the backoff doubles
    for _ in range(20):
        decoder._judge_by_throughput(8, True, 16, 0.050)  # 320 tokens/s: drafting pays again
    assert decoder._throughput_pauses[8] == 0
    for _ in range(10):
        decoder._judge_by_throughput(1, False, 1, 0.010)
        decoder._judge_by_throughput(1, True, 1, 0.050)
    assert 1 not in decoder._pauses


def test_a_batch_that_always_drafts_still_measures_plain_steps(tiny_llama):
    """Drafters that always propose something leave no plain steps to compare with: the decoder runs one after each
    drafted step until enough are measured, then one every PLAIN_STEP_EVERY drafted steps."""
    decoder = Decoder(tiny_llama)

    def next_step_drafts() -> bool:
        pause = decoder._pauses.setdefault(8, [0, 0])
        drafting = pause[0] == 0
        pause[0] = max(0, pause[0] - 1)
        return drafting

    kinds = []
    for _ in range(2 * Decoder.RATE_MIN_STEPS + 2 * Decoder.PLAIN_STEP_EVERY):
        drafted = next_step_drafts()
        kinds.append(drafted)
        decoder._judge_by_throughput(8, drafted, 12, 0.040)  # drafted and plain steps alike: drafting never paused
    warm_up = 2 * Decoder.RATE_MIN_STEPS
    assert kinds[:warm_up] == [True, False] * Decoder.RATE_MIN_STEPS
    assert [index for index, drafted in enumerate(kinds[warm_up:]) if not drafted] == [Decoder.PLAIN_STEP_EVERY]


class UnderratedOracle(OracleChainDrafter):
    """The true continuation, scored far below what any forward's cost would pay for."""

    def propose(self, context, budget):
        chain = super().propose(context, budget)
        return DraftTree(chain.tokens, chain.parents, (0.001,) * len(chain))

    def observe(self, outcome):
        self.outcomes.append(outcome)


class FixedCosts(LatencyModel):
    """Forward costs from the prior alone: measured forwards change nothing."""

    def record(self, rows, seconds, sequences=1, tree=False):
        pass


def test_drafts_the_cost_rule_drops_are_still_verified_now_and_then(tiny_llama):
    """A source scored below break-even is never verified, so its score is never corrected: every EXPLORE_EVERY
    steps without a verified node, the best node on offer is verified anyway (one row), and the tokens stay plain
    decoding's."""
    count = 3 * Decoder.EXPLORE_EVERY + 4
    reference = greedy_ids(tiny_llama, PROMPT, count)
    drafter = UnderratedOracle(PROMPT, reference, length=4)
    decoder = Decoder(tiny_llama, budget=8, latency=FixedCosts(prior={1: 1.0, 2: 10.0, 64: 640.0}))
    state = decoder.start(PROMPT, drafter, max_new_tokens=count)
    decoder.prefill([state])
    while not state.finished:
        decoder.step([state])
    assert state.output == reference
    verified = [index for index, outcome in enumerate(drafter.outcomes) if len(outcome.tree)]
    assert len(verified) >= 2 and all(len(drafter.outcomes[index].tree) == 1 for index in verified)
    assert verified[0] + 1 >= Decoder.EXPLORE_EVERY
    # Each explored node is the truth: two tokens a step there.
    assert all(len(drafter.outcomes[index].emitted) == 2 for index in verified)


def test_explore_keeps_the_single_best_node_of_a_batch():
    low = DraftTree((1, 2), (-1, 0), (0.2, 0.1))
    high = DraftTree((3, 4, 5), (-1, -1, 1), (0.1, 0.3, 0.25))
    unscored = DraftTree()
    explored = explore([low, high, unscored])
    assert [tree.tokens for tree in explored] == [(), (4,), ()]
    assert all(len(tree) == 0 for tree in explore([DraftTree(), DraftTree()]))
