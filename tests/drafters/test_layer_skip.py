"""Layer-skip self-speculation: plain greedy decoding's ids on the lean forward in every dtype, batched too, the
target's cache left exactly as it was (by drafts and by matchness checks), the online skip-set search (random and
Bayesian, stopping rules), exact sampling, and a clear refusal elsewhere."""

from __future__ import annotations

import random

import pytest
import torch
from distributions import check_speculative_sampling
from equivalence import ar_token_ids, assert_same_ids_as_ar
from tiny import make_tiny_model, planned, repetitive_prompt

import draftwise
from draftwise.backend.forward.lean import LayerSkip, LeanTarget
from draftwise.decoding.latency import LatencyModel
from draftwise.decoding.sampling import SamplingParams
from draftwise.decoding.verify import greedy_choice
from draftwise.drafters.layer_skip import (
    LayerSkipDrafter,
    SkipSearch,
    as_layer_skip,
    chain_speedup,
    matchness,
    skippable,
)
from draftwise.errors import UnsupportedModelError


def deep_target(dtype, tmp_path, seed=0, **overrides) -> LeanTarget:
    return planned(make_tiny_model("llama", seed=seed, num_hidden_layers=6, **overrides).to(dtype), tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_equal_ar_alone_and_batched(dtype, tmp_path):
    target = deep_target(dtype, tmp_path)
    drafter = LayerSkipDrafter(ratio=0.3, threshold=0.0, adaptive=False, trials=40, window=8,
                               search_share=100.0)
    rng = random.Random(3)
    prompts = [repetitive_prompt(rng, low=10, high=70) for _ in range(6)]
    expected = ar_token_ids(target, None, prompts, max_new_tokens=40)
    assert_same_ids_as_ar(target, None, prompts, drafter, max_new_tokens=40, expected=expected)
    scored = len(drafter.search.history)
    assert scored > 0
    assert_same_ids_as_ar(target, None, prompts, drafter, max_new_tokens=40, expected=expected, max_batch=4,
                          require_drafting=False)
    assert len(drafter.search.history) > scored or not drafter.search.searching  # batched sequences search too


def test_greedy_ids_equal_ar_beside_a_float16_cache(tmp_path):
    """Quantised products keep keys and values in float16 (rounded as the forward makes them): a layer-skipping draft
    writes its rows there layer by layer, and the ids stay plain greedy's."""
    from draftwise.backend.calibration.invariance import plan_rows
    from draftwise.backend.calibration.machine import MeasurementStore

    target = LeanTarget(make_tiny_model("llama", seed=0, num_hidden_layers=6), quantization="q8_0")
    if target.kv_dtype != torch.float16:
        pytest.skip("quantised products run on the compiled kernels only")
    plan_rows(target, MeasurementStore(tmp_path))
    drafter = LayerSkipDrafter(ratio=0.3, threshold=0.0, adaptive=False, trials=40, window=8, search_share=100.0)
    rng = random.Random(4)
    prompts = [repetitive_prompt(rng, low=10, high=70) for _ in range(3)]
    assert_same_ids_as_ar(target, None, prompts, drafter, max_new_tokens=30)


def test_the_targets_cache_is_left_as_it_was(tmp_path):
    target = deep_target(torch.float32, tmp_path)
    drafter = LayerSkipDrafter(ratio=0.5, threshold=0.0, adaptive=False)
    prompt = repetitive_prompt(random.Random(1), low=30, high=40)
    with torch.inference_mode():
        cache = target.new_cache(128)
        target.prefill([cache], [prompt[:-1]])
        keys, values = cache.keys.clone(), cache.values.clone()
        from draftwise.decoding.drafter import SequenceSetup
        from draftwise.decoding.latency import LatencyModel

        drafter.attach(SequenceSetup(target, cache, SamplingParams(), LatencyModel()))
        tree = drafter.propose(tuple(prompt), 8)
    assert len(tree) == 8
    assert target.cache_length(cache) == len(prompt) - 1
    committed = len(prompt) - 1
    flat = lambda buffer: buffer.permute(0, 2, 1, 3, 4).reshape(buffer.shape[0], buffer.shape[2], -1, buffer.shape[-1])
    assert torch.equal(flat(cache.keys)[:, :, :committed], flat(keys)[:, :, :committed])
    assert torch.equal(flat(cache.values)[:, :, :committed], flat(values)[:, :, :committed])


def test_skip_search_keeps_the_first_and_last_layer_and_the_best_set():
    assert all(0 < layer < 7 for layer, _ in skippable(8))
    search = SkipSearch(layers=8, ratio=0.5, trials=30, patience=30, target_match=1.0, bayes_interval=5, seed=1)
    assert search.size == 6 and search.searching
    scores = {}
    for _ in range(30):
        candidate = search.candidate()
        assert len(candidate) == 6 and all(0 < layer < 7 for layer, _ in candidate)
        match = len([sub for sub in candidate if sub[1] == "mlp"]) / 6  # pretend skipping MLPs drafts better
        search.record(candidate, match)
        scores[candidate] = match
    assert not search.searching
    assert search.best_match == max(scores.values())
    assert scores[search.best] == search.best_match
    assert search.skip == as_layer_skip(search.best)


def test_skip_search_stops_at_the_target_match_or_out_of_patience():
    search = SkipSearch(layers=8, ratio=0.5, trials=100, patience=3, target_match=0.9)
    search.record(search.candidate(), 0.95)
    assert not search.searching
    search = SkipSearch(layers=8, ratio=0.5, trials=100, patience=3, target_match=0.9)
    search.record(search.candidate(), 0.5)
    for _ in range(3):
        assert search.searching
        search.record(search.candidate(), 0.4)
    assert not search.searching and search.best_match == 0.5


def test_skipped_logits_score_the_models_own_text_and_leave_the_cache_as_it_was(tmp_path):
    target = deep_target(torch.bfloat16, tmp_path)
    prompt = repetitive_prompt(random.Random(2), low=40, high=60)
    output = draftwise.generate(target, None, prompt_ids=prompt, method="ar", max_new_tokens=90).token_ids
    context = list(prompt) + output
    with torch.inference_mode():
        cache = target.new_cache(len(context) + 8)
        target.prefill([cache], [context[:-1]])
        keys, values = cache.keys.clone(), cache.values.clone()
        start = len(prompt)
        rows = context[start : start + 70]
        # Nothing skipped: the model predicts exactly the tokens it wrote (the window is aligned).
        assert matchness(greedy_choice(target.skipped_logits(cache, rows, start, LayerSkip()))[:-1], rows[1:]) == 1.0
        skipped = greedy_choice(target.skipped_logits(cache, rows, start, as_layer_skip(frozenset(skippable(6)[:5]))))
        assert skipped.shape == (70,)
    assert target.cache_length(cache) == len(context) - 1
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)
    with pytest.raises(ValueError, match="committed"):
        target.skipped_logits(cache, context[-3:], len(context) - 3, LayerSkip())


def test_the_search_runs_during_generation_and_keeps_ids(tmp_path):
    target = deep_target(torch.float32, tmp_path)
    drafter = LayerSkipDrafter(ratio=0.3, window=8, trials=12, patience=12, target_match=1.0, bayes_interval=4,
                               search_share=100.0)
    prompts = [repetitive_prompt(random.Random(seed), low=20, high=40) for seed in range(3)]
    assert_same_ids_as_ar(target, None, prompts, drafter, max_new_tokens=40, require_drafting=False)
    search = drafter.search
    assert search.history and not search.searching  # stopped: a perfect match, or all 12 sets scored
    assert search.best_match == 1.0 or len(search.history) == 12
    assert search.best_match == max(match for _, match in search.history)


def test_sampling_keeps_the_target_distribution(device, tmp_path):
    """The first three tokens' marginals equal plain sampling's, drafts accepted (four tokens to generate let the
    first step draft two levels from the skipped layers' distributions), on the engine's forward for the device."""
    model = make_tiny_model("llama", seed=3, vocab=24, scale=1.5, num_hidden_layers=4).to(device)
    target = planned(model, tmp_path)
    drafter = LayerSkipDrafter(ratio=0.5, threshold=0.0, adaptive=False, depth=3)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    accepted = check_speculative_sampling(target, model, prompt, drafter, {"temperature": 0.8, "top_p": 0.95})
    assert accepted > 100


def test_needs_the_lean_forward():
    model = make_tiny_model("llama", seed=0)
    with pytest.raises(UnsupportedModelError, match="lean"):
        draftwise.generate(model, None, prompt_ids=[1, 2, 3], method="layerskip", max_new_tokens=4)


def test_the_search_keeps_to_its_share_of_the_time(tmp_path):
    target = deep_target(torch.float32, tmp_path, scale=1.0)  # varied text: no skip set matches it all
    rng = random.Random(4)
    prompt = [rng.randrange(3, 60) for _ in range(30)]
    counts = {}
    for share in (0.05, 100.0):
        drafter = LayerSkipDrafter(ratio=0.5, window=4, trials=1000, patience=1000, target_match=1.0,
                                   search_share=share)
        draftwise.generate(target, None, prompt_ids=prompt, method=drafter, max_new_tokens=60)
        counts[share] = len(drafter.search.history)
    assert 1 <= counts[0.05] < counts[100.0]


def test_chain_speedup_prices_drafts_against_plain_steps():
    latency = LatencyModel()
    for rows in range(1, 10):
        latency.record(rows, 0.010 + 0.001 * rows)
    assert chain_speedup(1.0, 0.001, latency, 4) == pytest.approx(5 * 0.011 / (4 * 0.001 + 0.015))
    assert chain_speedup(0.2, 0.011, latency, 8) < 1.0  # a draft level costs a plain step and is rarely right
    assert chain_speedup(0.9, 0.005, latency, 1) == pytest.approx(1.9 * 0.011 / (0.005 + 0.012))


def test_a_search_that_cannot_pay_gives_up_and_stops_drafting(tmp_path):
    latency = LatencyModel()
    for rows in range(1, 10):
        latency.record(rows, 0.010 + 0.001 * rows)
    search = SkipSearch(layers=8, ratio=0.5, bayes_interval=4, patience=1000, target_match=1.0)
    sets = [frozenset(skippable(8)[index : index + 6]) for index in range(3)]
    for skipped, match in zip(sets, (0.1, 0.2)):
        search.record(skipped, match)
    search.judge(0.008, latency, 8)
    assert search.searching  # too few sets scored to judge
    search.record(sets[2], 0.15)
    search.judge(0.001, latency, 8)
    assert search.searching  # cheap drafts pay even when rarely right
    search.judge(0.008, latency, 8)
    assert search.given_up and not search.searching

    target = deep_target(torch.float32, tmp_path)
    drafter = LayerSkipDrafter(ratio=0.5, threshold=0.0, adaptive=False)
    prompt = repetitive_prompt(random.Random(6), low=20, high=30)
    expected = ar_token_ids(target, None, [prompt], max_new_tokens=30)
    (drafting,) = assert_same_ids_as_ar(target, None, [prompt], drafter, max_new_tokens=30, expected=expected,
                                        require_drafting=False)
    assert drafting.stats.drafted_tokens
    drafter.search.given_up = True
    (result,) = assert_same_ids_as_ar(target, None, [prompt], drafter, max_new_tokens=30, expected=expected,
                                      require_drafting=False)
    assert result.stats.drafted_tokens == 0


def test_the_best_set_is_ranked_by_its_mean_over_windows():
    search = SkipSearch(layers=8, ratio=0.5, trials=100, patience=100, target_match=1.0)
    first = search.candidate()
    search.record(first, 0.9)
    other = search.candidate()
    assert other != first
    search.record(other, 0.6)
    assert search.best == first
    search.rescore = True  # a new sequence: its window scores the best again
    assert search.candidate() == first and not search.rescore
    search.record(first, 0.1)
    assert search.best == other and search.best_match == 0.6
