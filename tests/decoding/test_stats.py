"""GenerationStats: hand-computed counters and derived metrics, and invariants on real generations."""

from __future__ import annotations

import json
import random

import pytest
from tiny import OracleTreeDrafter, WrongDrafter, repetitive_prompt

import draftwise
from draftwise.decoding.stats import GenerationStats

# (tiny models passed as they are draft on the transformers backend: see conftest.transformers_rows_trusted)
pytestmark = pytest.mark.usefixtures("transformers_rows_trusted")


def test_empty_stats():
    stats = GenerationStats()
    assert stats.mean_accepted_tokens == 0.0
    assert stats.acceptance_rate == 0.0
    assert stats.acceptance_per_position == []
    assert stats.tokens_per_s == 0.0
    assert stats.draft_time_share == 0.0


def test_record_step_hand_computed():
    stats = GenerationStats()
    stats.record_step(emitted=1, drafted=0, accepted=0, attempted=0)  # prefill
    stats.record_step(emitted=4, drafted=5, accepted=3, attempted=4)  # 3 of a 4-deep draft + bonus
    stats.record_step(emitted=1, drafted=2, accepted=0, attempted=1)  # rejected at the root
    stats.record_step(emitted=3, drafted=6, accepted=2, attempted=2)  # a 2-deep path fully accepted + bonus
    stats.record_step(emitted=1, drafted=0, accepted=0, attempted=0)  # nothing drafted
    assert stats.steps == 5
    assert stats.new_tokens == 10
    assert stats.drafted_tokens == 13
    assert stats.accepted_tokens == 5
    assert stats.accepted_lengths == [1, 4, 1, 3, 1]
    assert stats.attempts_per_position == [3, 2, 1, 1]
    assert stats.accepts_per_position == [2, 2, 1, 0]
    assert stats.acceptance_per_position == pytest.approx([2 / 3, 1.0, 1.0, 0.0])
    assert stats.mean_accepted_tokens == pytest.approx(2.0)
    assert stats.acceptance_rate == pytest.approx(5 / 13)
    stats.time_s = 2.5
    stats.draft_time_s = 0.5
    assert stats.tokens_per_s == pytest.approx(4.0)
    assert stats.draft_time_share == pytest.approx(0.2)


def test_to_dict_is_json_ready_and_complete():
    stats = GenerationStats()
    stats.record_step(emitted=1, drafted=0, accepted=0, attempted=0)
    stats.record_step(emitted=3, drafted=4, accepted=2, attempted=3)
    stats.time_s = 1.0
    data = stats.to_dict()
    json.dumps(data)
    assert data["new_tokens"] == 4
    assert data["steps"] == 2
    assert data["mean_accepted_tokens"] == pytest.approx(2.0)
    assert data["acceptance_rate"] == pytest.approx(0.5)
    assert data["acceptance_per_position"] == pytest.approx([1.0, 1.0, 0.0])
    assert data["tokens_per_s"] == pytest.approx(4.0)
    assert "draft_time_share" in data and "time_to_first_token_s" in data


def _cases():
    rng = random.Random(55)
    return [(repetitive_prompt(rng, low=10, high=40), rng.randint(20, 36)) for _ in range(5)]


CASES = _cases()


def assert_invariants(result):
    stats = result.stats
    assert stats.new_tokens == len(result.token_ids)
    assert sum(stats.accepted_lengths) == stats.new_tokens
    assert stats.steps == len(stats.accepted_lengths)
    assert all(length >= 1 for length in stats.accepted_lengths)
    assert stats.accepted_lengths[0] == 1  # the prefill emits one token
    assert 0 <= stats.accepted_tokens <= stats.drafted_tokens
    assert 0.0 <= stats.acceptance_rate <= 1.0
    assert all(0.0 <= rate <= 1.0 for rate in stats.acceptance_per_position)
    assert len(stats.attempts_per_position) == len(stats.accepts_per_position)
    assert all(a >= b >= 0 for a, b in zip(stats.attempts_per_position, stats.accepts_per_position))
    # Attempts can only fall with depth: reaching depth k+1 means depth k was offered.
    assert all(x >= y for x, y in zip(stats.attempts_per_position, stats.attempts_per_position[1:]))
    assert sum(stats.accepts_per_position) == stats.accepted_tokens
    assert stats.mean_accepted_tokens == pytest.approx(stats.new_tokens / stats.steps)
    assert 0.0 < stats.time_to_first_token_s <= stats.time_s
    assert 0.0 <= stats.draft_time_s <= stats.time_s
    assert stats.tokens_per_s > 0


@pytest.mark.parametrize("index", range(len(CASES)))
def test_invariants_ar(tiny_model, index):
    prompt, max_new_tokens = CASES[index]
    result = draftwise.generate(tiny_model, None, prompt_ids=prompt, method="ar", max_new_tokens=max_new_tokens)
    assert_invariants(result)
    stats = result.stats
    assert stats.mean_accepted_tokens == 1.0
    assert stats.drafted_tokens == 0
    assert stats.accepted_tokens == 0
    assert stats.steps == max_new_tokens
    assert stats.acceptance_per_position == []
    assert stats.draft_time_share < 1.0


@pytest.mark.parametrize("index", range(len(CASES)))
def test_invariants_pld(tiny_model, index):
    prompt, max_new_tokens = CASES[index]
    result = draftwise.generate(tiny_model, None, prompt_ids=prompt, method="pld", max_new_tokens=max_new_tokens)
    assert_invariants(result)


def test_invariants_custom_drafters(tiny_model):
    for prompt, max_new_tokens in CASES[:3]:
        reference = draftwise.generate(tiny_model, None, prompt_ids=prompt, method="ar",
                                       max_new_tokens=max_new_tokens).token_ids
        oracle = draftwise.generate(tiny_model, None, prompt_ids=prompt, budget=32, max_new_tokens=max_new_tokens,
                                    method=OracleTreeDrafter(prompt, reference))
        assert_invariants(oracle)
        # The oracle's first-level drafts are always accepted.
        assert oracle.stats.acceptance_per_position[0] == 1.0
        assert oracle.stats.new_tokens - oracle.stats.steps == oracle.stats.accepted_tokens
        wrong = draftwise.generate(tiny_model, None, prompt_ids=prompt, max_new_tokens=max_new_tokens,
                                   method=WrongDrafter(prompt, reference, shape="tree"))
        assert_invariants(wrong)
        assert wrong.stats.acceptance_per_position == [0.0]
        # One token per step; every step but the prefill and the last (no room for a draft) offered one.
        assert wrong.stats.steps == max_new_tokens
        assert wrong.stats.attempts_per_position == [max_new_tokens - 2]


def test_eos_cut_does_not_count_accepted_positions_as_rejected(tiny_llama, monkeypatch):
    prompt, max_new_tokens = CASES[0]
    reference = draftwise.generate(tiny_llama, None, prompt_ids=prompt, method="ar",
                                   max_new_tokens=max_new_tokens).token_ids
    index = next(i for i in range(3, 8) if reference[i] not in reference[:i])
    monkeypatch.setattr(tiny_llama.generation_config, "eos_token_id", reference[index])
    from tiny import OracleChainDrafter

    result = draftwise.generate(tiny_llama, None, prompt_ids=prompt, max_new_tokens=max_new_tokens,
                                method=OracleChainDrafter(prompt, reference, length=8))
    assert result.token_ids == reference[: index + 1]
    stats = result.stats
    # A greedy walk rejects at most once per step.
    rejections = sum(a - b for a, b in zip(stats.attempts_per_position, stats.accepts_per_position))
    assert rejections <= stats.steps - 1
