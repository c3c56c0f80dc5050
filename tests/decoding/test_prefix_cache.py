"""Prefix caching: blocks keyed by content and everything before them, bounded in bytes with the least recently used
leaves evicted first, and sequences started from cached blocks emitting exactly the tokens they emit alone (follow-up
turns that resend a conversation, prompts sharing a system prompt in one batch, greedy and seeded sampling, a cache
too small to hold much)."""

from __future__ import annotations

import random

import pytest
import torch
from gguf_files import TINY_QWEN, write_random_gguf
from tiny import repetitive_prompt

import draftwise
from draftwise.backend import native
from draftwise.backend.target import as_target
from draftwise.decoding.batch import Scheduler
from draftwise.decoding.engine import Decoder
from draftwise.decoding.prefix_cache import PrefixCache, block_digest
from draftwise.decoding.sampling import SamplingParams
from draftwise.errors import UnsupportedOptionError


class PositionTarget:
    """A stand-in target whose cache is a list of positions' "keys" (each position's value is its token): a position
    is 4 bytes of keys and 4 of values."""

    def cache_length(self, cache) -> int:
        return len(cache)

    def read_positions(self, cache, start, end):
        keys = torch.tensor(cache[start:end], dtype=torch.float32)[None, None, :, None]
        return keys, keys.clone()

    def write_positions(self, cache, start, keys, values):
        assert start == len(cache)
        cache.extend(int(value) for value in keys[0, 0, :, 0].tolist())


def test_blocks_are_found_by_their_tokens_and_everything_before_them():
    target, cache = PositionTarget(), PrefixCache(block=4)
    tokens = list(range(10))
    assert cache.store(target, tokens, tokens) == 2 and len(cache) == 2  # (the last 2 positions: no whole block)
    restored: list[int] = []
    assert cache.restore(target, restored, tokens + [99], limit=10) == 8 and restored == tokens[:8]
    assert cache.restore(target, [], [0, 1, 2, 3, 9, 9, 9, 9], limit=8) == 4  # the second block differs
    assert cache.restore(target, [], [9, 1, 2, 3, 4, 5, 6, 7], limit=8) == 0  # so does the first: nothing after it
    assert cache.restore(target, [], tokens, limit=7) == 4  # (the limit ends inside the second block)
    assert (cache.queried_tokens, cache.hit_tokens) == (11 + 8 + 8 + 10, 8 + 4 + 4)
    # The same second block after another first block is another block.
    assert cache.store(target, [7, 7, 7, 7, 4, 5, 6, 7], [7, 7, 7, 7, 4, 5, 6, 7]) == 2
    assert block_digest(None, [0, 1, 2, 3]) != block_digest(None, [7, 7, 7, 7])


def test_a_collision_is_never_taken_for_a_hit():
    target, cache = PositionTarget(), PrefixCache(block=2)
    cache.store(target, [1, 2], [1, 2])
    [entry] = cache._blocks.values()
    entry.tokens = (5, 6)  # as if (1, 2) and (5, 6) had the same digest
    assert cache.restore(target, [], [1, 2, 3], limit=2) == 0
    assert cache.store(target, [1, 2], [1, 2]) == 0 and len(cache) == 1  # and it is not overwritten


def test_the_least_recently_used_leaves_go_first_and_the_bytes_stay_bounded():
    target = PositionTarget()  # a block of 2 positions: 2 * 8 bytes
    cache = PrefixCache(capacity_bytes=5 * 16, block=2)
    first, second = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8]
    cache.store(target, first, first)  # three blocks
    cache.store(target, second, second)  # one new block, sharing two
    assert len(cache) == 4 and cache.bytes == 4 * 16
    cache.match(first)  # the first chain is now the most recent
    third = [9, 9, 8, 8]
    cache.store(target, third, third)  # two more blocks: one must go, the least recently used leaf (7, 8)
    assert cache.bytes <= 5 * 16 and cache.evicted_blocks == 1
    assert cache.restore(target, [], second, limit=6) == 4  # its shared blocks stay, continued by the first chain
    assert cache.restore(target, [], first, limit=6) == 6
    assert cache.restore(target, [], third, limit=4) == 4
    # An ancestor is never evicted before its continuations: evict everything.
    cache.capacity_bytes = 0
    cache.store(target, [], [])
    assert len(cache) == 0 and cache.bytes == 0


def test_a_bound_of_zero_keeps_nothing_and_bad_bounds_are_refused():
    target, cache = PositionTarget(), PrefixCache(capacity_bytes=0, block=2)
    cache.store(target, [1, 2, 3, 4], [1, 2, 3, 4])
    assert len(cache) == 0
    for capacity in (-1, 1.5, "1"):
        with pytest.raises(ValueError, match="capacity"):
            PrefixCache(capacity_bytes=capacity)
    with pytest.raises(ValueError, match="block"):
        PrefixCache(block=0)


def _run(target, prompts, prefix_cache, method="pld", sampling=None, max_new_tokens=12, max_prefill_rows=16,
         max_batch=4, join_after: int | None = None):
    """Every prompt through one scheduler (``join_after``: the later prompts join once that many are running);
    returns the sequences."""
    decoder = Decoder(target, prefix_cache=prefix_cache)
    scheduler = Scheduler(decoder, max_batch=max_batch, max_prefill_rows=max_prefill_rows)
    states = [decoder.start(prompt, draftwise.make_drafter(method), max_new_tokens=max_new_tokens,
                            sampling=(sampling or (lambda index: SamplingParams()))(index))
              for index, prompt in enumerate(prompts)]
    scheduler.submit(states if join_after is None else states[:join_after])
    while not scheduler.idle or any(state.submitted is None for state in states):
        if join_after is not None and states[join_after].submitted is None and scheduler.running:
            scheduler.submit(states[join_after:])
        scheduler.step()
    return states


@pytest.fixture
def lean(target):
    if not as_target(target).prefix_caching:
        pytest.skip("this target has no prefix caching (its prompts are not verification rows)")
    return as_target(target)


def test_a_target_without_bitwise_prompt_rows_is_refused(target):
    if as_target(target).prefix_caching:
        pytest.skip("this target has prefix caching")
    with pytest.raises(UnsupportedOptionError, match="prefix caching"):
        Decoder(target, prefix_cache=PrefixCache())


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_follow_up_turns_reuse_the_conversation_and_emit_their_own_tokens(lean, method):
    """Turn 2 resends turn 1's prompt and answer: both come from the cache (the answer's blocks too), and its tokens
    are those it gets alone, greedy and sampled."""
    rng = random.Random(3)
    first = repetitive_prompt(rng, low=60, high=70)
    for sampling in (None, lambda index: SamplingParams(temperature=0.8, top_k=30, seed=index)):
        cache = PrefixCache()
        [turn_one] = _run(lean, [first], cache, method, sampling, max_new_tokens=40)
        second = list(first) + turn_one.output + repetitive_prompt(rng, low=5, high=9)
        [turn_two] = _run(lean, [second], cache, method, sampling)
        [alone] = _run(lean, [second], None, method, sampling)
        assert turn_two.output == alone.output
        cached = turn_two.stats.cached_prompt_tokens
        assert cached == (len(first) + len(turn_one.output) - 1) // cache.block * cache.block > len(first)
        assert alone.stats.cached_prompt_tokens == 0
        assert turn_two.prefilled == len(second)


def test_a_batch_sharing_a_system_prompt_gets_its_batch_1_tokens(lean):
    """Prompts with one long beginning, submitted together and joining mid-flight, with a cache of a few blocks:
    every sequence emits what it emits alone, and later ones hit the blocks earlier ones left."""
    rng = random.Random(5)
    system = repetitive_prompt(rng, low=50, high=55)
    prompts = [system + repetitive_prompt(rng, low=3, high=30) for _ in range(6)]
    alone = [_run(lean, [prompt], None)[0].output for prompt in prompts]
    for capacity in (1 << 30, 3 * _block_bytes(lean)):
        cache = PrefixCache(capacity_bytes=capacity)
        states = _run(lean, prompts, cache, max_batch=3, join_after=2)
        assert [state.output for state in states] == alone, capacity
        assert cache.bytes <= capacity
        assert any(state.stats.cached_prompt_tokens for state in states[2:])
    assert cache.hit_tokens == sum(state.stats.cached_prompt_tokens for state in states)


def test_prompt_log_probabilities_are_computed_not_restored(lean):
    rng = random.Random(8)
    prompt = repetitive_prompt(rng, low=40, high=45)
    cache = PrefixCache()
    _run(lean, [prompt], cache)
    decoder = Decoder(lean, prefix_cache=cache)
    state = decoder.start(prompt, draftwise.make_drafter("ar"), max_new_tokens=2, logprobs=0, prompt_logprobs=True)
    decoder.open(state, reuse_prefix=True)
    assert state.prefilled == 0 and state.stats.cached_prompt_tokens == 0


@pytest.mark.skipif(native.load_kernels(warn=False) is None, reason="the compiled kernels are not available")
@pytest.mark.parametrize("activation_bits", [8, 16])
def test_a_quantised_file_reuses_its_conversation_bitwise(tmp_path, activation_bits):
    """The same on a GGUF file's own block-quantised products, 8- and 16-bit activations."""
    path = write_random_gguf(tmp_path / "model.gguf", TINY_QWEN, "Q4_K")
    target, _ = draftwise.load_model(str(path), weights="file", calibrate=False, cache_dir=tmp_path,
                                     activation_bits=activation_bits)
    assert target.prefix_caching
    rng = random.Random(1)
    first = repetitive_prompt(rng, low=50, high=60)
    cache = PrefixCache()
    [turn_one] = _run(target, [first], cache, max_new_tokens=30)
    second = list(first) + turn_one.output + repetitive_prompt(rng, low=4, high=8)
    [turn_two] = _run(target, [second], cache)
    assert turn_two.output == _run(target, [second], None)[0].output
    assert turn_two.stats.cached_prompt_tokens > len(first)


def _block_bytes(target) -> int:
    cache = target.new_cache(32)
    with torch.inference_mode():
        target.prefill([cache], [list(range(20))])
    keys, values = target.read_positions(cache, 0, 16)
    return keys.nbytes + values.nbytes


def test_positions_read_and_written_across_the_caches_blocks(lean):
    """A cache's positions copied into another, across its blocks of positions, are bitwise the same."""
    prompt = [int(token) for token in torch.randint(5, 90, (150,), generator=torch.Generator().manual_seed(0))]
    source = lean.new_cache(200)
    with torch.inference_mode():
        lean.prefill([source], [prompt])
    keys, values = lean.read_positions(source, 0, 130)
    copy = lean.new_cache(200)
    lean.write_positions(copy, 0, keys[:, :, :50], values[:, :, :50])
    lean.write_positions(copy, 50, keys[:, :, 50:], values[:, :, 50:])
    assert lean.cache_length(copy) == 130
    again = lean.read_positions(copy, 0, 130)
    assert torch.equal(again[0], keys) and torch.equal(again[1], values)
    with pytest.raises(ValueError, match="committed"):
        lean.read_positions(source, 100, 151)
    with pytest.raises(ValueError, match="after the committed"):
        lean.write_positions(copy, 0, keys, values)
