"""Layer-skip self-speculation: plain greedy decoding's ids on the lean forward in every dtype, batched too, the
target's cache left exactly as it was, the online skip-set search, exact sampling, and a clear refusal elsewhere."""

from __future__ import annotations

import random

import pytest
import torch
from distributions import check_speculative_sampling
from tiny import make_tiny_model, planned, repetitive_prompt

import draftwise
from draftwise.backend.lean import LeanTarget
from draftwise.decoding.sampling import SamplingParams
from draftwise.drafters.layer_skip import LayerSkipDrafter, SkipSearch, skippable
from draftwise.errors import UnsupportedModelError


def deep_target(dtype, tmp_path, seed=0, **overrides) -> LeanTarget:
    return planned(make_tiny_model("llama", seed=seed, num_hidden_layers=6, **overrides).to(dtype), tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_equal_ar_alone_and_batched(dtype, tmp_path):
    target = deep_target(dtype, tmp_path)
    drafter = LayerSkipDrafter(ratio=0.3, threshold=0.0, adaptive=False, trials=6)
    rng = random.Random(3)
    prompts = [repetitive_prompt(rng, low=10, high=70) for _ in range(6)]
    expected = [draftwise.generate(target, None, prompt_ids=p, method="ar", max_new_tokens=40).token_ids for p in prompts]
    accepted = 0
    for prompt, ids in zip(prompts, expected):
        result = draftwise.generate(target, None, prompt_ids=prompt, method=drafter, max_new_tokens=40)
        assert result.token_ids == ids
        accepted += result.stats.accepted_tokens
    assert accepted > 0
    batched = draftwise.generate(target, None, prompt_ids=prompts, method=drafter, max_new_tokens=40, max_batch=4)
    assert [result.token_ids for result in batched] == expected


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
    search = SkipSearch(layers=8, ratio=0.5, trials=5, steps_per_trial=2, seed=1)
    assert len(search.current.skipped) == 6
    rates = {}
    for _ in range(5 * 2):
        skipped = search.current.skipped
        good = len([sub for sub in skipped if sub[1] == "mlp"])  # pretend skipping MLPs drafts better
        search.record(tokens=1 + good, seconds=1.0)
        rates[skipped] = 1 + good
    assert not search.searching
    assert search.current.skipped == max(rates, key=rates.get)
    assert all(len(skipped) == 6 for skipped in rates)


def test_sampling_keeps_the_target_distribution(tmp_path):
    model = make_tiny_model("llama", seed=3, vocab=24, scale=1.5, num_hidden_layers=4)
    target = planned(model, tmp_path)
    drafter = LayerSkipDrafter(ratio=0.5, threshold=0.0, adaptive=False, depth=3)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    accepted = check_speculative_sampling(target, model, prompt, drafter, {"temperature": 0.8, "top_p": 0.95})
    assert accepted > 100


def test_needs_the_lean_forward():
    model = make_tiny_model("llama", seed=0)
    with pytest.raises(UnsupportedModelError, match="lean"):
        draftwise.generate(model, None, prompt_ids=[1, 2, 3], method="layerskip", max_new_tokens=4)
