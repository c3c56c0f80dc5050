"""The fixed-shape lean forward (GPUs' path): logits against transformers, every verification row bitwise plain
decoding (trees of more than one step, deep paths, chains longer than a step, batches), the cache's slots reused,
clear errors past its limits. On CPUs its steps run eagerly (the same operations a CUDA graph replays); with a CUDA
device the tests taking the ``device`` fixture run there too, through the graphs."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from equivalence import ar_token_ids, assert_same_ids_as_ar
from tiny import drafter_for, make_tiny_model, repetitive_prompt

from draftwise.backend.calibration.invariance import check_trees, plan_rows
from draftwise.backend.calibration.machine import MeasurementStore
from draftwise.backend.forward.graphed import (
    FLOAT32_STEP_ROWS,
    STEP_ROWS,
    TREE_DEPTH,
    GraphedLeanTarget,
    lean_target,
)
from draftwise.backend.forward.lean import LayerSkip, LeanTarget
from draftwise.backend.rows import RowBlock

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05}


def graphed(kind: str = "llama", dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, **overrides):
    model = make_tiny_model(kind, seed=seed, **overrides).to(device=device, dtype=dtype)
    return GraphedLeanTarget(model)


def random_tree(rng: random.Random, rows: int, vocab: int, depth: int) -> RowBlock:
    """``rows`` rows: a path of ``depth`` rows, the others hung below random earlier rows (no deeper than it)."""
    depth = min(depth, rows)
    parents, depths = [-1], [0]
    for row in range(1, depth):
        parents.append(row - 1)
        depths.append(row)
    while len(parents) < rows:
        parent = rng.randrange(len(parents))
        if depths[parent] + 1 < depth:
            parents.append(parent)
            depths.append(depths[parent] + 1)
    return RowBlock(tuple(rng.randrange(vocab) for _ in range(rows)), tuple(parents))


def plain_rows(target, prompt: list[int], block: RowBlock) -> list[torch.Tensor]:
    """Each row of ``block`` computed by plain one-row decoding of its path after ``prompt``."""
    rows = []
    for row in range(len(block.tokens)):
        path, node = [], row
        while node != -1:
            path.append(block.tokens[node])
            node = block.parents[node]
        cache = target.new_cache(len(prompt) + len(path) + 1)
        target.prefill([cache], [prompt])
        for token in reversed(path):
            logits = target.forward([cache], [RowBlock.chain([token])]).logits[0][0]
            target.commit(cache, [0])
        rows.append(logits)
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_logits_match_transformers(kind, dtype, device):
    target = graphed(kind, dtype, device)
    model = target.model
    rng = random.Random(1)
    prompt = repetitive_prompt(rng, low=150, high=170)  # three steps of prefill
    continuation = [rng.randrange(model.config.vocab_size) for _ in range(6)]
    with torch.inference_mode():
        reference = model(torch.tensor([prompt + continuation], device=device)).logits[0].float()
        cache = target.new_cache(256)
        first = target.prefill([cache], [prompt]).logits[0][-1].float()
        logits = target.forward([cache], [RowBlock.chain(continuation)]).logits[0].float()
    atol = TOLERANCE[dtype] * reference.abs().max().item()
    torch.testing.assert_close(first, reference[len(prompt) - 1], atol=atol, rtol=0)
    torch.testing.assert_close(logits, reference[len(prompt):], atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verification_rows_are_bitwise_plain_decoding(dtype, device):
    target = graphed("qwen2", dtype, device)
    report = check_trees(target, trials=24, steps=2 * 64 + 10, prompt_length=64 - 7, seed=5)
    assert report.exact, report.mismatches[:3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, depth, length", [
    (100, 9, 40), (70, TREE_DEPTH, 61), (STEP_ROWS + 1, 2, 127), (FLOAT32_STEP_ROWS + 1, 2, 100),
])
def test_trees_over_several_steps_and_deep_paths_are_bitwise_plain(rows, depth, length, dtype, device):
    target = graphed("llama", dtype, device, seed=2)
    rng = random.Random(rows)
    prompt = [rng.randrange(target.config.vocab_size) for _ in range(length)]
    block = random_tree(rng, rows, target.config.vocab_size, depth)
    cache = target.new_cache(length + rows + 1)
    target.prefill([cache], [prompt])
    tree = target.forward([cache], [block]).logits[0]
    for row, plain in enumerate(plain_rows(target, prompt, block)):
        assert torch.equal(tree[row], plain), row


def test_a_batch_gives_each_sequence_its_rows_alone(device):
    target = graphed("llama", torch.bfloat16, device, seed=4)
    rng = random.Random(4)
    vocab = target.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 140))] for _ in range(3)]
    blocks = [random_tree(rng, rng.randint(1, 30), vocab, rng.randint(1, 6)) for _ in prompts]
    caches = [target.new_cache(200) for _ in prompts]
    for cache, prompt in zip(caches, prompts):
        target.prefill([cache], [prompt])
    together = target.forward(caches, blocks).logits
    for prompt, block, rows in zip(prompts, blocks, together):
        cache = target.new_cache(200)
        target.prefill([cache], [prompt])
        assert torch.equal(target.forward([cache], [block]).logits[0], rows)


@pytest.mark.parametrize("method", ["pld", "aded", "lookahead", "layerskip", "draft"])
def test_methods_alone_and_batched_give_ar_ids(method, device, tmp_path):
    target = graphed("qwen2", torch.float32, device, seed=1)
    plan_rows(target, MeasurementStore(tmp_path))
    rng = random.Random(7)
    batch = [repetitive_prompt(rng, low=5, high=90) for _ in range(3)]
    ar = ar_token_ids(target, None, batch, max_new_tokens=40)
    drafter = drafter_for(method, target)
    assert_same_ids_as_ar(target, None, batch, drafter, max_new_tokens=40, expected=ar)
    assert_same_ids_as_ar(target, None, batch, drafter, max_new_tokens=40, expected=ar, max_batch=3)


def test_the_plan_is_fixed_and_checked(tmp_path):
    target = graphed("llama")
    plan = plan_rows(target, MeasurementStore(tmp_path))
    assert plan.exact and target.exact_trees and plan.linear_fixed and target.linear_min_rows == target.step_rows


def test_step_rows_follow_the_dtype_or_the_caller():
    """16-bit steps are as wide as tensor cores make cheap, float32 ones narrower; any width keeps rows bitwise."""
    assert graphed("llama", torch.bfloat16).step_rows == STEP_ROWS
    assert graphed("llama", torch.float32).step_rows == FLOAT32_STEP_ROWS
    target = GraphedLeanTarget(make_tiny_model("qwen2", seed=3), step_rows=5)
    assert target.linear_min_rows == 5
    report = check_trees(target, trials=8, steps=30, prompt_length=20, seed=3)
    assert report.exact, report.mismatches[:3]
    for wrong in (0, TREE_DEPTH + 1):
        with pytest.raises(ValueError, match="step_rows"):
            GraphedLeanTarget(make_tiny_model("qwen2", seed=3), step_rows=wrong)


def test_a_finished_sequence_slot_serves_the_next():
    target = graphed("llama", torch.bfloat16)
    prompt = list(range(1, 60))
    first = target.new_cache(100)
    expected = target.prefill([first], [prompt]).logits[0]
    slot = first.slot
    del first
    gc.collect()
    other = target.new_cache(100)
    assert other.slot is slot
    target.prefill([other], [[5] * 90])  # stale keys beyond the next prompt stay masked
    del other
    gc.collect()
    again = target.new_cache(100)
    assert again.slot is slot
    assert torch.equal(target.prefill([again], [prompt]).logits[0], expected)


def test_skipped_logits_leave_the_cache_as_it_was():
    target = graphed("llama", num_hidden_layers=4)
    cache = target.new_cache(100)
    target.prefill([cache], [list(range(2, 50))])
    keys, values = cache.keys.clone(), cache.values.clone()
    logits = target.skipped_logits(cache, list(range(10, 20)), 30, LayerSkip(attention=frozenset({1}), mlp=frozenset({2})))
    assert logits.shape[0] == 10 and cache.length == 48
    used = slice(0, target.positions - 1)  # (the last position is the padding rows' scratch)
    assert torch.equal(cache.keys[:, :, used], keys[:, :, used])
    assert torch.equal(cache.values[:, :, used], values[:, :, used])


def test_rows_past_the_span_or_too_deep_a_tree_are_clear_errors():
    target = GraphedLeanTarget(make_tiny_model("llama"), span=100)
    cache = target.new_cache(100)
    target.prefill([cache], [list(range(1, 95))])
    with pytest.raises(ValueError, match="span"):
        target.forward([cache], [RowBlock.chain(list(range(10)))])
    deep = random_tree(random.Random(0), TREE_DEPTH + 2, target.config.vocab_size, TREE_DEPTH + 1)
    with pytest.raises(ValueError, match="depth"):
        GraphedLeanTarget(make_tiny_model("llama")).forward([cache], [deep])
    with pytest.raises(ValueError, match="span must be"):
        GraphedLeanTarget(make_tiny_model("llama"), span=10**6)
    with pytest.raises(ValueError, match="CUDA"):
        GraphedLeanTarget(make_tiny_model("llama"), graphs=True)


def test_lean_target_picks_the_graphed_forward_on_cuda_only():
    model = make_tiny_model("llama")
    assert type(lean_target(model)) is LeanTarget
    if torch.cuda.is_available():
        assert type(lean_target(model.to("cuda"))) is GraphedLeanTarget


def test_a_limited_context_shrinks_every_step_and_keeps_rows_bitwise(device):
    """``limit_context`` (``max_model_len``): every step's attention covers the limit (plus room for a tree), not the
    model's context; verification rows stay bitwise plain decoding's, methods give ``ar``'s ids, and a sequence
    past the limit is a clear error."""
    target = graphed("qwen2", torch.float32, device, seed=1)
    full = target.positions
    target.limit_context(160)
    assert target.context_length == 160 and target.span == 160 and target.positions < full
    assert target.positions == -(-(160 + 256 + 1) // target.step_rows) * target.step_rows
    rng = random.Random(2)
    prompt = [rng.randrange(target.config.vocab_size) for _ in range(40)]
    block = random_tree(rng, 24, target.config.vocab_size, 8)
    cache = target.new_cache(100)
    target.prefill([cache], [prompt])
    assert torch.equal(target.forward([cache], [block]).logits[0], torch.stack(plain_rows(target, prompt, block)))
    batch = [repetitive_prompt(random.Random(7), low=5, high=60) for _ in range(2)]
    ar = ar_token_ids(target, None, batch, max_new_tokens=40)
    assert_same_ids_as_ar(target, None, batch, "pld", max_new_tokens=40, expected=ar)
    cache = target.new_cache(100)
    target.prefill([cache], [[token % target.config.vocab_size for token in range(1, 150)]])
    with pytest.raises(ValueError, match="span"):
        target.forward([cache], [RowBlock.chain(list(range(12)))])
    with pytest.raises(ValueError, match="max_model_len"):
        target.limit_context(10**6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_step_keeps_rows_bitwise_and_close_to_transformers(dtype, device):
    """``torch.compile`` fuses the step's operations: its rounding is its own, but every step runs the
    one compiled function (on a GPU inside the slot's CUDA graph), so trees' rows are still bitwise plain decoding's,
    and logits stay transformers'."""
    target = GraphedLeanTarget(make_tiny_model("qwen2", seed=6).to(device=device, dtype=dtype), step_rows=8,
                               compiled=True)
    assert target.compiled
    report = check_trees(target, trials=12, steps=30, prompt_length=13, seed=6)
    assert report.exact, report.mismatches[:3]
    rng = random.Random(6)
    prompt = repetitive_prompt(rng, low=20, high=30)
    with torch.inference_mode():
        reference = target.model(torch.tensor([prompt], device=device)).logits[0].float()
        cache = target.new_cache(64)
        logits = target.prefill([cache], [prompt[:-4]]).logits[0][-1:].float()
        logits = torch.cat([logits, target.forward([cache], [RowBlock.chain(prompt[-4:])]).logits[0].float()])
    atol = TOLERANCE[dtype] * reference.abs().max().item()
    torch.testing.assert_close(logits, reference[len(prompt) - 5:], atol=atol, rtol=0)
    assert not GraphedLeanTarget(make_tiny_model("qwen2")).compiled


def test_a_compiled_step_has_measurements_of_its_own():
    """A compiled step rounds and costs apart from the eager one: its row plan and cost curves are kept apart."""
    from draftwise.backend.calibration.invariance import model_shape

    model = make_tiny_model("qwen2", seed=6)
    eager, compiled = GraphedLeanTarget(model, packed=False), GraphedLeanTarget(model, compiled=True)
    assert "compiled" not in model_shape(eager) and model_shape(compiled)["compiled"] is True
    assert model_shape(compiled) != model_shape(eager)
