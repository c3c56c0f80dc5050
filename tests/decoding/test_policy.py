"""The drafting policy on its own: pricing and sizing drafts, pauses and their backoff, throughput judging,
exploration, and state kept apart per batch size. No model is needed: the policy sees trees, counters and times."""

from __future__ import annotations

import pytest

from draftwise.decoding.latency import LatencyModel
from draftwise.decoding.policy import (
    PAUSE_REASONS,
    BatchState,
    DraftingPolicy,
    MeasuredRate,
    explore,
    priced_by_acceptance,
    scored_by_acceptance,
)
from draftwise.decoding.stats import GenerationStats
from draftwise.decoding.tree import DraftTree

#: Prior forward costs where a second row costs 1.2 rows: a node scored 0.1 loses, one scored 0.9 wins.
MILD = {1: 1.0, 2: 1.2}
LOSING = DraftTree((1,), (-1,), (0.1,))
WINNING = DraftTree((1,), (-1,), (0.9,))


def paused_steps(policy: DraftingPolicy, batch_size: int) -> int:
    """Steps at ``batch_size`` that run without drafting before the policy asks the drafters again."""
    paused = 0
    while not policy.drafting(batch_size):
        paused += 1
    return paused


def test_unscored_drafts_are_priced_from_the_acceptance_so_far():
    """A batch scores a drafter's unscored tree from the sequence's acceptance by depth (Laplace-smoothed), shared
    evenly among siblings, never growing along a path."""
    stats = GenerationStats()
    stats.record_step(emitted=2, drafted=2, accepted=1, attempted=2)  # depth 1 accepted, depth 2 rejected
    tree = DraftTree((5, 6, 7), (-1, 0, 0))
    scored = scored_by_acceptance(tree, stats)
    assert scored.tokens == tree.tokens and scored.parents == tree.parents
    assert scored.scores == pytest.approx((2 / 3, 2 / 3 * 1 / 3 / 2, 2 / 3 * 1 / 3 / 2))
    assert scored_by_acceptance(DraftTree(), stats) == DraftTree()


def test_explore_keeps_the_single_best_node_of_a_batch():
    low = DraftTree((1, 2), (-1, 0), (0.2, 0.1))
    high = DraftTree((3, 4, 5), (-1, -1, 1), (0.1, 0.3, 0.25))
    unscored = DraftTree()
    explored = explore([low, high, unscored])
    assert [tree.tokens for tree in explored] == [(), (4,), ()]
    assert all(len(tree) == 0 for tree in explore([DraftTree(), DraftTree()]))


def test_a_fresh_policy_drafts_and_keeps_nothing_yet():
    policy = DraftingPolicy(LatencyModel())
    assert policy.drafting(1) and policy.drafting(8)
    assert policy.state(8) == BatchState()
    assert policy.state(8).measured_steps(True) == policy.state(8).measured_steps(False) == 0


def test_alone_an_unscored_tree_is_verified_whole():
    policy = DraftingPolicy(LatencyModel(prior={1: 1.0, 64: 64.0}))  # every row costs as much as the first
    tree = DraftTree.chain([4, 5, 6])
    choice = policy.choose([tree], [GenerationStats()])
    assert choice.trees[0] is tree and choice.drafted and not choice.exploring


def test_a_batch_prices_unscored_trees_and_keeps_what_pays():
    chain = DraftTree.chain([4, 5, 6])
    free = DraftingPolicy(LatencyModel(prior={1: 1.0, 16: 1.0}))  # up to 16 rows cost one
    choice = free.choose([chain, DraftTree.chain([7])], [GenerationStats(), GenerationStats()])
    assert choice.trees[0].tokens == (4, 5, 6)
    assert choice.trees[0].scores == pytest.approx((1 / 2, 1 / 4, 1 / 8))  # nothing measured yet: 1/2 a depth
    flat = DraftingPolicy(LatencyModel(prior={1: 1.0, 64: 64.0}))
    choice = flat.choose([chain, DraftTree.chain([7])], [GenerationStats(), GenerationStats()])
    assert not choice.drafted and not choice.exploring  # no node pays for its row
    assert flat.state(2).paused_steps_left == 1  # and the drafts were not worth asking for


def test_a_target_that_verifies_chains_more_cheaply_gets_best_paths():
    tree = DraftTree((1, 2, 3), (-1, 0, 0), (0.9, 0.5, 0.3))
    stats = [GenerationStats(), GenerationStats()]
    policy = DraftingPolicy(LatencyModel(prior={1: 1.0, 16: 1.0}))
    assert policy.choose([tree, tree], stats).trees[0] == tree
    assert [kept.tokens for kept in policy.choose([tree, tree], stats, batch_chains=True).trees] == [(1, 2)] * 2


def test_drafts_not_worth_their_time_pause_drafting_with_a_doubling_backoff():
    policy = DraftingPolicy(LatencyModel(prior=MILD))
    pauses = []
    for _ in range(9):
        policy.judge_drafting([LOSING], 0.0)
        pauses.append(paused_steps(policy, 1))
    assert pauses == [1, 2, 4, 8, 16, 32, 64, 64, 64]
    assert policy.MAX_DRAFT_PAUSE == 64
    # Winning drafts, once their drafting time is counted, can lose too.
    policy.judge_drafting([WINNING], 0.0)
    policy.judge_drafting([WINNING], 1.0)
    assert paused_steps(policy, 1) == 1


def test_drafting_resumes_once_it_pays_again_and_the_backoff_starts_over():
    policy = DraftingPolicy(LatencyModel(prior=MILD))
    for _ in range(3):
        policy.judge_drafting([LOSING], 0.0)
    assert policy.state(1).pause_length == 4
    policy.judge_drafting([WINNING], 0.0)
    assert policy.state(1).pause_length == 0
    assert policy.state(1).paused_steps_left == 4  # the pause under way runs out
    assert paused_steps(policy, 1) == 4
    assert policy.drafting(1)
    policy.judge_drafting([LOSING], 0.0)
    assert paused_steps(policy, 1) == 1  # the backoff starts over
    policy.judge_drafting([DraftTree.chain([1, 2])], 0.0)  # unscored trees say nothing
    assert policy.drafting(1)


def test_the_cost_rule_pauses_through_choose_but_empty_proposals_do_not():
    policy = DraftingPolicy(LatencyModel(prior=MILD))
    policy.choose([DraftTree()], [GenerationStats()])
    assert policy.drafting(1)
    policy.choose([LOSING], [GenerationStats()])  # dropped by the cost rule: not worth drafting
    assert paused_steps(policy, 1) == 1
    choice = policy.choose([WINNING], [GenerationStats()], draft_seconds=0.0)
    assert choice.trees == [WINNING] and policy.state(1).pause_length == 0


def test_a_batch_pauses_drafting_while_drafted_steps_emit_fewer_tokens_per_second():
    """Of several sequences, measured steps decide: drafted steps slower than plain ones pause drafting with a
    growing backoff; faster ones end it; batch 1 is left to the cost rule."""
    policy = DraftingPolicy(LatencyModel())
    for _ in range(DraftingPolicy.RATE_MIN_STEPS):
        policy.after_step(8, False, 8, 0.040)  # 200 tokens/s without drafts
    for _ in range(DraftingPolicy.RATE_MIN_STEPS - 1):
        policy.after_step(8, True, 10, 0.060)  # 167 tokens/s with them: not enough steps yet
    state = policy.state(8)
    assert state.paused_steps_left == 0
    assert state.rate_without_drafts == MeasuredRate(pytest.approx(200.0), DraftingPolicy.RATE_MIN_STEPS)
    policy.after_step(8, True, 10, 0.060)
    assert state.paused_steps_left == 1
    policy.after_step(8, True, 10, 0.060)
    assert state.paused_steps_left == 2 and state.throughput_pause_length == 2  # the backoff doubles
    for _ in range(20):
        policy.after_step(8, True, 16, 0.050)  # 320 tokens/s: drafting pays again
    assert state.throughput_pause_length == 0
    assert state.rate_with_drafts.tokens_per_second > state.rate_without_drafts.tokens_per_second


def test_each_paused_step_is_counted_by_its_reason():
    """Steps run without the drafters are counted by why: the cost rule, the throughput judge, or a plain step run
    to measure plain steps' rate."""
    policy = DraftingPolicy(LatencyModel(prior={1: 1.0, 64: 64.0}))
    policy.choose([DraftTree.chain([4]), DraftTree.chain([7])], [GenerationStats(), GenerationStats()])
    assert policy.state(2).pause_reason == "cost" and not policy.drafting(2)
    policy.after_step(8, True, 10, 0.060)  # no plain step measured yet at 8: the next one runs plain
    assert policy.state(8).pause_reason == "measuring" and not policy.drafting(8)
    for _ in range(DraftingPolicy.RATE_MIN_STEPS):
        policy.after_step(8, False, 8, 0.040)
    for _ in range(DraftingPolicy.RATE_MIN_STEPS):
        policy.after_step(8, True, 10, 0.060)  # slower than plain steps
    assert policy.state(8).pause_reason == "throughput"
    while not policy.drafting(8):
        pass
    assert policy.paused_steps["cost"] == 1 and policy.paused_steps["measuring"] == 1
    assert policy.paused_steps["throughput"] >= 1 and set(policy.paused_steps) == set(PAUSE_REASONS)


def test_alone_throughput_is_not_judged():
    policy = DraftingPolicy(LatencyModel())
    for _ in range(10):
        policy.after_step(1, False, 1, 0.010)
        policy.after_step(1, True, 1, 0.050)
    assert 1 not in policy.states
    assert all(policy.drafting(1) for _ in range(5))


def test_alone_under_sampling_throughput_is_judged():
    """Under sampling batch 1 is judged by measured rates too: drafted steps slower than plain ones pause drafting."""
    policy = DraftingPolicy(LatencyModel())
    for _ in range(DraftingPolicy.RATE_MIN_STEPS):
        policy.after_step(1, False, 1, 0.010, sampling=True)
        policy.after_step(1, True, 1, 0.012, sampling=True)
    assert policy.state(1).paused_steps_left >= 1 and policy.state(1).throughput_pause_length >= 1


def test_scored_drafts_are_capped_by_measured_acceptance():
    """A drafter's scores stand where the sequence's acceptance supports them and are lowered where it does not
    (siblings share the measured rate in proportion to their scores); paths never grow."""
    tree = DraftTree((5, 6, 7), (-1, -1, 0), (0.6, 0.2, 0.5))
    accepting = GenerationStats()
    for _ in range(50):
        accepting.record_step(emitted=3, drafted=2, accepted=2, attempted=2)
    assert priced_by_acceptance(tree, accepting).scores == tree.scores
    rejecting = GenerationStats()
    for _ in range(48):
        rejecting.record_step(emitted=1, drafted=2, accepted=0, attempted=1)
    rate = 1 / 50  # Laplace-smoothed: no accepts in 48 attempts
    priced = priced_by_acceptance(tree, rejecting)
    assert priced.scores == pytest.approx((rate * 0.75, rate * 0.25, rate * 0.75 * 0.5))
    assert priced.tokens == tree.tokens and priced.parents == tree.parents
    assert priced_by_acceptance(DraftTree.chain([1, 2]), rejecting).scores is not None  # unscored: scored


def test_under_sampling_alone_drafts_are_priced_by_acceptance():
    """Alone, a drafter's unscored tree is verified whole under greedy decoding, but priced by the sequence's
    acceptance under sampling: drafts that are rarely accepted are dropped."""
    policy = DraftingPolicy(LatencyModel(prior=MILD))
    rejecting = GenerationStats()
    for _ in range(40):
        rejecting.record_step(emitted=1, drafted=3, accepted=0, attempted=1)
    tree = DraftTree.chain([4, 5, 6])
    assert policy.choose([tree], [rejecting]).trees[0] is tree
    assert not DraftingPolicy(LatencyModel(prior=MILD)).choose([tree], [rejecting], sampling=True).drafted


def test_steps_that_say_nothing_of_drafting_are_not_measured():
    policy = DraftingPolicy(LatencyModel())
    policy.after_step(4, True, 1, 1.0, exploring=True)  # an exploring step is not expected to pay
    policy.after_step(4, False, 4, 0.0)  # no time measured
    # (the rejected exploration only lengthens the wait before the next one)
    assert policy.state(4) == BatchState(explore_wait=2 * DraftingPolicy.EXPLORE_EVERY)


def test_a_batch_that_always_drafts_still_measures_plain_steps():
    """Drafters that always propose something leave no plain steps to compare with: the policy runs one after each
    drafted step until enough are measured, then one every PLAIN_STEP_EVERY drafted steps."""
    policy = DraftingPolicy(LatencyModel())
    kinds = []
    for _ in range(2 * DraftingPolicy.RATE_MIN_STEPS + 2 * DraftingPolicy.PLAIN_STEP_EVERY):
        drafted = policy.drafting(8)
        kinds.append(drafted)
        policy.after_step(8, drafted, 12, 0.040)  # drafted and plain steps alike: drafting never paused
    warm_up = 2 * DraftingPolicy.RATE_MIN_STEPS
    assert kinds[:warm_up] == [True, False] * DraftingPolicy.RATE_MIN_STEPS
    assert [index for index, drafted in enumerate(kinds[warm_up:]) if not drafted] == [DraftingPolicy.PLAIN_STEP_EVERY]


def test_plain_steps_are_forced_every_plain_step_every_drafted_steps():
    policy = DraftingPolicy(LatencyModel(), rate_min_steps=2, plain_step_every=5)
    kinds = []
    for _ in range(4 + 3 * 6):
        drafted = policy.drafting(3)
        kinds.append(drafted)
        policy.after_step(3, drafted, 6, 0.030)
    assert kinds[:4] == [True, False, True, False]
    plain = [index for index, drafted in enumerate(kinds[4:]) if not drafted]
    assert plain == [5, 11, 17]  # five drafted steps, then a plain one
    assert DraftingPolicy.PLAIN_STEP_EVERY == 32  # the keyword changed this policy only


def test_exploration_after_explore_every_steps_without_a_verified_node():
    policy = DraftingPolicy(LatencyModel(prior={1: 1.0, 2: 10.0, 64: 640.0}))
    low = DraftTree((1, 2), (-1, 0), (0.01, 0.005))
    stats = [GenerationStats()]
    for _ in range(policy.EXPLORE_EVERY - 1):
        choice = policy.choose([low], stats)
        assert not choice.exploring and not choice.drafted
    pause_length = policy.state(1).pause_length
    choice = policy.choose([low], stats)
    assert choice.exploring and choice.drafted and [tree.tokens for tree in choice.trees] == [(1,)]
    assert policy.state(1).pause_length == pause_length  # an exploring step is not judged
    assert policy.state(1).steps_since_verified_draft == 0
    assert not policy.choose([low], stats).exploring  # the count starts over
    # Steps without drafts count too, but a step with nothing on offer explores nothing.
    explorer = DraftingPolicy(LatencyModel(prior={1: 1.0, 2: 10.0}), explore_every=3)
    assert not explorer.choose([DraftTree()], stats).exploring
    assert not explorer.choose([DraftTree()], stats).exploring
    assert not explorer.choose([DraftTree()], stats).exploring
    assert explorer.choose([low], stats).exploring
    # A verified node restarts the count.
    cheap = DraftingPolicy(LatencyModel(prior={1: 1.0, 16: 1.0}), explore_every=2)
    assert cheap.choose([WINNING], stats).drafted
    assert cheap.state(1).steps_since_verified_draft == 0


def test_rejected_explorations_wait_twice_as_long_before_the_next():
    """Where nothing is accepted, exploring rows come ever more rarely (16, 32, 64, ... steps apart, up to
    MAX_EXPLORE_EVERY); an accepted exploration, or drafts the cost rule keeps, restore the usual wait."""
    policy = DraftingPolicy(LatencyModel(prior={1: 1.0, 2: 10.0, 64: 640.0}), explore_every=4)
    low = DraftTree((1, 2), (-1, 0), (0.01, 0.005))
    stats = [GenerationStats()]

    def steps_to_next_exploration() -> int:
        for step in range(1, 1000):
            if policy.choose([low], stats).exploring:
                return step
        raise AssertionError("never explored")

    waits = []
    for _ in range(8):
        waits.append(steps_to_next_exploration())
        policy.after_step(1, True, 1, 0.01, exploring=True)  # rejected: one token for one sequence
    assert waits == [4, 8, 16, 32, 64, 128, 256, 256]
    policy.after_step(1, True, 2, 0.01, exploring=True)  # the last one accepted after all
    assert steps_to_next_exploration() == 4
    policy.after_step(1, True, 1, 0.01, exploring=True)
    assert policy.state(1).explore_wait == 8
    rare = DraftingPolicy(LatencyModel(prior={1: 1.0, 2: 10.0}), explore_every=1000)
    rare.after_step(1, True, 1, 0.01, exploring=True)
    assert rare.state(1).explore_wait == 1000  # (never shorter than the policy's own wait)
    cheap_costs = DraftingPolicy(LatencyModel(prior={1: 1.0, 16: 1.0}))
    cheap_costs.state(1).explore_wait = 64
    assert cheap_costs.choose([WINNING], stats).drafted and cheap_costs.state(1).explore_wait == 0


def test_each_batch_size_keeps_its_own_state():
    policy = DraftingPolicy(LatencyModel(prior=MILD))
    policy.judge_drafting([LOSING, LOSING], 0.0)  # batch 2 pauses
    assert not policy.drafting(2)
    assert policy.drafting(3) and policy.drafting(1)
    for _ in range(DraftingPolicy.RATE_MIN_STEPS):
        policy.after_step(8, False, 8, 0.040)
        policy.after_step(8, True, 4, 0.040)
    assert policy.state(8).throughput_pause_length > 0 and policy.state(8).paused_steps_left > 0
    assert policy.state(4) == BatchState() and policy.state(4).measured_steps(False) == 0
    assert policy.drafting(4) and not policy.drafting(8)
    assert policy.state(2).rate_with_drafts is None


def test_constants_can_be_overridden_by_subclass_or_keyword():
    class Impatient(DraftingPolicy):
        MAX_DRAFT_PAUSE = 4

    policy = Impatient(LatencyModel(prior=MILD))
    pauses = []
    for _ in range(5):
        policy.judge_drafting([LOSING], 0.0)
        pauses.append(paused_steps(policy, 1))
    assert pauses == [1, 2, 4, 4, 4]
    keyword = DraftingPolicy(LatencyModel(prior=MILD), max_draft_pause=2, rate_smoothing=0.5, explore_every=3)
    assert (keyword.MAX_DRAFT_PAUSE, keyword.RATE_SMOOTHING, keyword.EXPLORE_EVERY) == (2, 0.5, 3)
    assert (keyword.RATE_MIN_STEPS, keyword.PLAIN_STEP_EVERY) == (DraftingPolicy.RATE_MIN_STEPS, 32)
    assert DraftingPolicy.MAX_DRAFT_PAUSE == 64
