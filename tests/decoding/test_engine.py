"""The engine's stages one by one: accept, draft, the Decoder's prefill and step, and what a drafter is handed.

The drafting policy on its own (cost rule, pauses, throughput judging, exploration) is tested in test_policy.py."""

from __future__ import annotations

import random
import time

import pytest
import torch
from tiny import FixedCosts, OracleChainDrafter, planned, repetitive_prompt

import draftwise
from draftwise.decoding.drafter import Drafter, NoDrafter
from draftwise.decoding.engine import Decoder, FinishReason, SequenceState, accept, decode, draft
from draftwise.decoding.latency import LatencyModel
from draftwise.decoding.policy import DraftingPolicy
from draftwise.decoding.tree import DraftTree

# (tiny models passed as they are draft on the transformers backend: see conftest.transformers_rows_trusted)
pytestmark = pytest.mark.usefixtures("transformers_rows_trusted")

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


class SlowToPrepare(NoDrafter):
    """Prepares (as a draft model loads) for a second, once per target; every call is recorded."""

    def __init__(self) -> None:
        self.prepared: list[object] = []

    def prepare(self, target) -> None:
        if target not in self.prepared:
            time.sleep(1.0)
        self.prepared.append(target)


def test_a_drafter_prepares_before_the_sequences_clock_starts(tiny_llama):
    """Loading a draft model is setting up, not decoding: it is not counted in a sequence's time or its time to
    first token."""
    drafter = SlowToPrepare()
    result = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=4,
                                ignore_eos=True)
    assert len(result.token_ids) == 4 and drafter.prepared
    assert result.stats.time_s < 0.9 and result.stats.time_to_first_token_s < 0.9


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


class UnderratedOracle(OracleChainDrafter):
    """The true continuation, scored far below what any forward's cost would pay for."""

    def propose(self, context, budget):
        chain = super().propose(context, budget)
        return DraftTree(chain.tokens, chain.parents, (0.001,) * len(chain))

    def observe(self, outcome):
        self.outcomes.append(outcome)


def test_drafts_the_cost_rule_drops_are_still_verified_now_and_then(tiny_llama):
    """A source scored below break-even is never verified, so its score is never corrected: every EXPLORE_EVERY
    steps without a verified node, the best node on offer is verified anyway (one row), and the tokens stay plain
    decoding's."""
    count = 3 * DraftingPolicy.EXPLORE_EVERY + 4
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
    assert verified[0] + 1 >= DraftingPolicy.EXPLORE_EVERY
    # Each explored node is the truth: two tokens a step there.
    assert all(len(drafter.outcomes[index].emitted) == 2 for index in verified)



class NeverDrafting(DraftingPolicy):
    """A policy that never asks the drafters."""

    def drafting(self, batch_size):
        return False


def test_the_decoder_consults_its_policy(tiny_llama):
    reference = greedy_ids(tiny_llama, PROMPT, 8)
    drafter = OracleChainDrafter(PROMPT, reference, length=4)
    latency = LatencyModel()
    decoder = Decoder(tiny_llama, policy=NeverDrafting(latency))
    assert decoder.latency is latency  # a given policy's latency model is the decoder's
    state = decoder.start(PROMPT, drafter, max_new_tokens=8)
    decoder.prefill([state])
    while not state.finished:
        decoder.step([state])
    assert state.output == reference and state.stats.steps == 8  # one token a step: nothing was drafted
    assert drafter.proposals == 0
    assert isinstance(Decoder(tiny_llama).policy, DraftingPolicy)
    with pytest.raises(ValueError):  # a policy over another latency model than the decoder's
        Decoder(tiny_llama, latency=LatencyModel(), policy=DraftingPolicy(LatencyModel()))


def test_logprobs_are_the_models_distribution_and_the_same_whatever_is_drafted(tiny_qwen2, tmp_path):
    """Each emitted token's log-probability is the model's (transformers' forward over the whole text, within float
    tolerance), with the most likely alternatives, and bitwise the same when drafts were verified (the lean forward's
    verification rows are plain decoding's)."""
    target = planned(tiny_qwen2, tmp_path)
    prompt = repetitive_prompt(random.Random(5), low=30, high=40)

    def run(drafter: Drafter) -> SequenceState:
        decoder = Decoder(target)
        state = decoder.start(prompt, drafter, max_new_tokens=24, logprobs=4)
        decoder.prefill([state])
        while not state.finished:
            decoder.step([state])
        return state

    plain, drafted = run(NoDrafter()), run(draftwise.make_drafter("pld"))
    assert drafted.stats.accepted_tokens > 0
    assert drafted.token_logprobs == plain.token_logprobs
    assert [entry.token for entry in plain.token_logprobs] == plain.output
    with torch.inference_mode():
        reference = torch.log_softmax(tiny_qwen2(torch.tensor([prompt + plain.output])).logits[0].float(), dim=-1)
    for position, entry in enumerate(plain.token_logprobs):
        row = reference[len(prompt) - 1 + position]
        assert abs(entry.logprob - float(row[entry.token])) < 1e-4
        assert [token for token, _ in entry.top] == row.topk(4).indices.tolist()
        assert all(first >= second for (_, first), (_, second) in zip(entry.top, entry.top[1:]))


def test_generate_returns_the_log_probabilities_of_plain_decoding(tiny_qwen2, tmp_path):
    target = planned(tiny_qwen2, tmp_path)
    prompts = [repetitive_prompt(random.Random(seed), low=30, high=40) for seed in (5, 6)]
    # (40 tokens: room for the policy, which prices drafts with this machine's measured costs, to draft and hit)
    plain = draftwise.generate(target, None, prompt_ids=prompts, method="ar", max_new_tokens=40, logprobs=2)
    drafted = draftwise.generate(target, None, prompt_ids=prompts, method="pld", max_new_tokens=40, logprobs=2)
    assert sum(result.stats.accepted_tokens for result in drafted) > 0
    for plain_result, drafted_result in zip(plain, drafted):
        assert drafted_result.logprobs == plain_result.logprobs  # exact floats
        assert [entry.token for entry in plain_result.logprobs] == plain_result.token_ids
        assert all(len(entry.top) == 2 for entry in plain_result.logprobs)
    assert draftwise.generate(target, None, prompt_ids=prompts[0], method="ar", max_new_tokens=4).logprobs is None
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(draftwise.InvalidRequestError, match="logprobs"):
            draftwise.generate(target, None, prompt_ids=prompts[0], max_new_tokens=4, logprobs=bad)

