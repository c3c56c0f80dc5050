"""The lean forward: agreement with transformers, bitwise batch invariance in every dtype, the KV cache's rollback,
the measured row plan and its fallback, and every method's exactness on it."""

from __future__ import annotations

import json

import random
import warnings

import pytest
import torch
from equivalence import ar_token_ids, assert_same_ids_as_ar
from tiny import drafter_for, make_tiny_model, planned, prefilled_caches, repetitive_prompt

import draftwise
from draftwise.backend.calibration import costs, invariance
from draftwise.backend.calibration.costs import CostCurves, cost_curves, disturbed
from draftwise.backend.calibration.invariance import InvarianceReport, check_trees, plan_rows
from draftwise.backend.calibration.machine import MeasurementStore, auto_dtype, resolve_dtype
from draftwise.backend.forward.lean import BLOCK, PREFILL_PIECE, LeanTarget, _bucket_members, unsupported_reason
from draftwise.backend.rows import RowBlock
from draftwise.decoding.tree import DraftTree
from draftwise.errors import UnsupportedModelError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: Agreement with transformers' own forward, by device and dtype (the two compute the same formulas in different
#: orders; GPUs' float32 products round their inputs to TF32 or sum in other orders).
TOLERANCE = {
    "cpu": {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.05},
    "cuda": {torch.float32: 5e-3, torch.bfloat16: 0.25, torch.float16: 0.05},
}


def model_in(kind: str, dtype: torch.dtype, **overrides):
    return make_tiny_model(kind, seed=0, **overrides).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_logits_match_transformers(kind, dtype, device, tmp_path):
    """The engine's forward for the device (the lean forward on CPUs, its graphed form on GPUs): the prompt's last
    logits and those of a tree's rows on the true path agree with transformers' forward."""
    model = model_in(kind, dtype).to(device)
    target = planned(model, tmp_path)
    tolerance = TOLERANCE[device][dtype]
    rng = random.Random(1)
    prompt = repetitive_prompt(rng, low=70, high=90)
    continuation = [rng.randrange(model.config.vocab_size) for _ in range(12)]
    with torch.inference_mode():
        reference = model(torch.tensor([prompt + continuation], device=device)).logits[0].float()
        cache = target.new_cache(128)
        first = target.prefill([cache], [prompt]).logits[0][-1].float()
        torch.testing.assert_close(first, reference[len(prompt) - 1], atol=tolerance, rtol=0)
        # The continuation as a tree below its first token, two branches (the true one last): each row on the true
        # path equals the reference row at its position.
        tree = DraftTree.from_paths([[continuation[1], 5, 6], continuation[1:5]])
        logits = target.forward([cache], [tree.rows(continuation[0])]).logits[0].float()
        torch.testing.assert_close(logits[0], reference[len(prompt)], atol=tolerance, rtol=0)
        node = -1
        for depth, token in enumerate(continuation[1:5], 1):
            node = tree.child(node, token)
            torch.testing.assert_close(logits[node + 1], reference[len(prompt) + depth], atol=tolerance, rtol=0)


@pytest.mark.parametrize("kernel", [None, False], ids=["kernel", "library"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, BLOCK - 1, BLOCK + 1, PREFILL_PIECE + 5])
def test_prefill_of_any_length_matches_transformers(length, dtype, kernel, tmp_path):
    """The prompt as chains of verification rows of at most PREFILL_PIECE rows (compiled kernels) or causal
    attention (library) gives transformers' logits at the prompt's last position and at the row decoded after it,
    from a cache that had to grow."""
    model = model_in("llama", dtype, max_position_embeddings=2 * PREFILL_PIECE)
    target = planned(model, tmp_path, kernel=kernel)
    rng = random.Random(length)
    tokens = [rng.randrange(model.config.vocab_size) for _ in range(length + 1)]
    with torch.inference_mode():
        reference = model(torch.tensor([tokens])).logits[0].float()
        cache = target.new_cache(4)
        last = target.prefill([cache], [tokens[:-1]]).logits[0][-1].float()
        following = target.forward([cache], [RowBlock.chain([tokens[-1]])]).logits[0][0].float()
    torch.testing.assert_close(last, reference[length - 1], atol=TOLERANCE["cpu"][dtype], rtol=0)
    torch.testing.assert_close(following, reference[length], atol=TOLERANCE["cpu"][dtype], rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_ids_equal_transformers_generate(kind, tmp_path):
    model = model_in(kind, torch.float32)
    target = planned(model, tmp_path)
    prompt = repetitive_prompt(random.Random(2), low=30, high=40)
    with torch.inference_mode():
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, attention_mask=torch.ones(1, len(prompt))
        )[0, len(prompt):].tolist()
    for method in ("ar", "pld"):
        assert draftwise.generate(target, None, prompt_ids=prompt, method=method, max_new_tokens=40).token_ids == expected


@pytest.mark.parametrize("kernel", [None, False], ids=["kernel", "library"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_verification_rows_are_bitwise_plain_decoding(kind, dtype, kernel, device, tmp_path):
    """The measured plan makes every row of random trees (ancestors among siblings, cache lengths across block
    boundaries) equal, with torch.equal on whole logit rows, to plain one-row decoding, on either attention path of
    CPUs and on GPUs' graphed forward; and it finds the padding that makes them so (drafting stays on)."""
    if device == "cuda" and kernel is False:
        pytest.skip("the graphed forward of GPUs has one attention path")
    target = planned(model_in(kind, dtype).to(device), tmp_path, kernel=kernel)
    assert target.exact_trees, "the row plan found no exact padding: drafting is off"
    report = check_trees(target, trials=25, steps=2 * BLOCK + 10, prompt_length=BLOCK - 7, seed=3)
    assert report.exact, report.mismatches[:3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_big_trees_and_long_caches(dtype, tmp_path):
    """64-node trees with the true path at every depth up to 8, at cache lengths on and around block boundaries."""
    model = model_in("llama", dtype, max_position_embeddings=1024)
    target = planned(model, tmp_path)
    vocab = model.config.vocab_size
    rng = random.Random(4)
    prompt = [rng.randrange(vocab) for _ in range(3 * BLOCK - 7)]  # blocks end at 6 and 70 tokens on
    with torch.inference_mode():
        cache = target.new_cache(len(prompt) + 200)
        generated = [int(target.prefill([cache], [prompt]).logits[0][-1].argmax())]
        plain = []
        for _ in range(80):
            logits = target.forward([cache], [RowBlock.chain([generated[-1]])]).logits[0][0]
            target.commit(cache, [0])
            plain.append(logits)
            generated.append(int(logits.argmax()))
        for start in (0, 5, 6, 7, 60, 66, 70):
            trial = target.new_cache(len(prompt) + 200)
            target.prefill([trial], [prompt])
            if start:
                target.forward([trial], [RowBlock.chain(generated[:start])])
                target.commit(trial, range(start))
            truth = generated[start + 1 : start + 9]
            paths = [[*truth[:level], rng.randrange(vocab)] for level in range(8) for _ in range(7)] + [truth]
            rng.shuffle(paths)
            tree = DraftTree.from_paths(paths, budget=64)
            logits = target.forward([trial], [tree.rows(generated[start])]).logits[0]
            node = -1
            assert torch.equal(logits[0], plain[start])
            for level, token in enumerate(truth):
                node = tree.child(node, token)
                if node is None:
                    break
                assert torch.equal(logits[node + 1], plain[start + level + 1]), (start, level)


def test_commit_keeps_exactly_the_accepted_path(tmp_path):
    """After a tree forward, committing a path leaves the cache as if the path had been decoded one row at a time;
    rejected rows leave nothing behind, and the cache grows when needed."""
    model = model_in("qwen2", torch.float32)
    target = planned(model, tmp_path)
    prompt = repetitive_prompt(random.Random(5), low=20, high=25)
    with torch.inference_mode():
        chain = target.new_cache(8)
        target.prefill([chain], [prompt])
        plain_tokens = [7, 11, 13]
        for token in plain_tokens:
            target.forward([chain], [RowBlock.chain([token])])
            target.commit(chain, [0])
        tree_cache = target.new_cache(8)
        target.prefill([tree_cache], [prompt])
        # Rows: root 7, wrong 3, then 11 under 7, a sibling 4, then 13 under 11 -> accepted rows 0, 2, 4.
        block = RowBlock((7, 3, 11, 4, 13), (-1, 0, 0, 0, 2))
        target.forward([tree_cache], [block])
        target.commit(tree_cache, [0, 2, 4])
        assert tree_cache.length == chain.length == len(prompt) + 3
        assert tree_cache.capacity >= tree_cache.length
        for buffer, reference in ((tree_cache.keys, chain.keys), (tree_cache.values, chain.values)):
            for position in range(chain.length):  # block-major layout: (layer, block, head, offset, dim)
                block_index, offset = divmod(position, BLOCK)
                assert torch.equal(buffer[:, block_index, :, offset], reference[:, block_index, :, offset])
        # Next step's logits agree exactly too.
        a = target.forward([tree_cache], [RowBlock.chain([17])]).logits[0]
        b = target.forward([chain], [RowBlock.chain([17])]).logits[0]
        assert torch.equal(a, b)


def test_plan_is_kept_per_machine_and_a_failing_check_turns_drafting_off(tmp_path, monkeypatch):
    model = model_in("llama", torch.float32)
    store = MeasurementStore(tmp_path)
    target = LeanTarget(model)
    first = plan_rows(target, store)
    assert first.exact and first.report is not None
    recalled = plan_rows(LeanTarget(model), store)
    assert (recalled.linear_min_rows, recalled.attention_min_rows) == (first.linear_min_rows, first.attention_min_rows)
    assert recalled.report is None  # recalled, not measured again

    def never_exact(target, trials=12, **options):
        return InvarianceReport(rows_checked=3, mismatches=["simulated: kernels differ by row count"])

    monkeypatch.setattr(invariance, "check_trees", never_exact)
    broken = LeanTarget(model)
    with pytest.warns(RuntimeWarning, match="drafting is off"):
        plan = plan_rows(broken, MeasurementStore(tmp_path / "other"))
    assert not plan.exact and not broken.exact_trees
    prompt = repetitive_prompt(random.Random(6), low=20, high=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = draftwise.generate(broken, None, prompt_ids=prompt * 2, method="pld", max_new_tokens=20)
    assert result.stats.drafted_tokens == 0  # exact, at plain decoding's pace
    assert result.token_ids == draftwise.generate(model, None, prompt_ids=prompt * 2, method="ar", max_new_tokens=20).token_ids


def test_cost_curve_is_measured_once(tmp_path):
    target = LeanTarget(model_in("llama", torch.float32))
    store = MeasurementStore(tmp_path)
    assert cost_curves(target, store, measure=False) is None
    curves = cost_curves(target, store)
    assert set(curves.chain) >= {1, 8, 64} and all(seconds > 0 for seconds in curves.chain.values())
    assert min(curves.tree) == 3 and 64 in curves.tree and all(seconds > 0 for seconds in curves.tree.values())
    assert cost_curves(target, store, measure=False) == curves


def test_a_cost_curve_measured_while_the_machine_was_busy_is_measured_again(tmp_path, monkeypatch):
    # Saved on a 2-core machine while tests ran beside the measurement (seconds, chains): 4 rows cheaper than 3,
    # 8 rows a third of 6 rows' time, 16 rows 24x one row.
    busy = CostCurves({1: 0.032, 2: 0.056, 3: 0.083, 4: 0.059, 6: 0.243, 8: 0.084, 16: 0.77},
                      {3: 0.047, 4: 0.089, 8: 0.242, 16: 0.746})
    calm = CostCurves({1: 0.006, 2: 0.009, 3: 0.012, 4: 0.015, 8: 0.027, 16: 0.046}, {3: 0.012, 4: 0.015})
    assert disturbed(busy) and not disturbed(calm)
    assert not disturbed(CostCurves({1: 0.010, 2: 0.0095, 4: 0.0099}, {}))  # flat within noise (a GPU)
    target = LeanTarget(model_in("llama", torch.float32))
    store = MeasurementStore(tmp_path)
    measured = iter([busy, calm])
    monkeypatch.setattr(costs, "measure_cost_curves", lambda target: next(measured))
    assert cost_curves(target, store) == calm  # the busy measurement is taken again at once
    key_record = next(iter(tmp_path.glob("*.json")))
    record = json.loads(key_record.read_text())
    record["cost_curves"] = {shape: {str(rows): value for rows, value in getattr(busy, shape).items()}
                             for shape in ("chain", "tree")}
    key_record.write_text(json.dumps(record))  # a busy curve kept by an earlier version
    assert cost_curves(target, store, measure=False) == busy
    measured = iter([calm])
    assert cost_curves(target, store) == calm  # recalled, judged busy, measured again and kept
    assert cost_curves(target, store, measure=False) == calm


def test_unsupported_models_are_refused_or_run_by_transformers(tmp_path):
    model = make_tiny_model("llama", seed=0)
    model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    assert "rope type" in unsupported_reason(model)
    with pytest.raises(UnsupportedModelError, match="rope type"):
        LeanTarget(model)
    from draftwise.models import make_target

    assert make_target(model, calibrate=False).backend == "transformers"
    with pytest.raises(UnsupportedModelError):
        make_target(model, backend="lean", calibrate=False)


def test_auto_dtype_follows_the_cpu(monkeypatch):
    from draftwise.backend.calibration import machine

    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert auto_dtype("cpu") == torch.bfloat16
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx2"}))
    assert auto_dtype("cpu") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float77")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", sorted(set(draftwise.METHODS) - {"ar"}))
def test_every_method_matches_ar_on_the_lean_forward(method, dtype, device, tmp_path):
    """Every method, one drafter across the prompts, gives plain greedy decoding's ids on the engine's forward for
    the device, with drafts accepted; on GPUs batched too (on CPUs, test_batch checks every method's batched ids
    against its batch-1 ids)."""
    target = planned(model_in("qwen2", dtype).to(device), tmp_path)
    drafter = drafter_for(method, target)
    rng = random.Random(7)
    prompts = [repetitive_prompt(rng, low=20, high=60) for _ in range(3)]
    expected = ar_token_ids(target, None, prompts, max_new_tokens=40)
    assert_same_ids_as_ar(target, None, prompts, drafter, max_new_tokens=40, expected=expected)
    if device != "cpu":
        assert_same_ids_as_ar(target, None, prompts, drafter, max_new_tokens=40, expected=expected, max_batch=2)


def test_row_groups():
    from draftwise.backend.forward.lean import row_groups

    assert row_groups([3, 3, 3], 6) == [[0, 1], [2]]
    assert row_groups([10, 2, 2], 6) == [[0], [1, 2]]
    assert row_groups([1] * 4, 100) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_over_the_row_limit_runs_as_several_forwards(dtype, tmp_path, monkeypatch):
    """More rows than one product may stack: the sequences run in groups, each sequence's logits bitwise those of
    its forward alone."""
    from draftwise.backend.forward import lean

    monkeypatch.setattr(lean, "MAX_FORWARD_ROWS", 40)
    target = planned(model_in("qwen2", dtype), tmp_path)
    rng = random.Random(4)
    prompts = [repetitive_prompt(rng, low=8, high=30) for _ in range(5)]
    blocks = [RowBlock.chain([rng.randrange(target.config.vocab_size) for _ in range(15)]) for _ in prompts]

    with torch.inference_mode():
        caches = prefilled_caches(target, prompts, 64)
        together = target.forward(caches, blocks, hidden_states=True)
        caches = prefilled_caches(target, prompts, 64)
        alone = [target.forward([cache], [block]).logits[0] for cache, block in zip(caches, blocks)]
    assert len(together.logits) == len(together.hidden_states) == 5
    assert all(torch.equal(a, b) for a, b in zip(together.logits, alone))


def test_fixed_row_products_stay_exact(tmp_path):
    """The CUDA forward's fixed step shape, checked on the CPU: linear products run in fixed 8-row chunks still give
    every verification row plain decoding's bits, alone and batched; such a target has no row plan to set."""
    target = LeanTarget(model_in("qwen2", torch.float32), 8, 8, kernel=False, linear_fixed=True)
    plan = plan_rows(target, MeasurementStore(tmp_path))
    assert plan.linear_fixed and target.fixed_row_plan and all(product.fixed_rows for product in target.products)
    with pytest.raises(ValueError, match="fixed row count"):
        target.set_row_plan(1, 1)
    report = check_trees(target, trials=12, steps=2 * BLOCK + 10, prompt_length=BLOCK - 7, seed=5)
    assert report.exact, report.mismatches[:3]
    rng = random.Random(9)
    prompts = [repetitive_prompt(rng, low=5, high=50) for _ in range(5)]
    # Batched verification rows are checked bit for bit by check_trees above (trees verified several at a time in
    # one forward); end to end, whether a batch of five drafts at all follows the step times measured as it runs
    # (DraftingPolicy.after_step), so this run asserts the ids alone.
    assert_same_ids_as_ar(target, None, prompts, "pld", max_new_tokens=25, max_batch=5, require_drafting=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("min_rows", [1, 4])
def test_lone_row_attention_is_block_attention_bitwise(dtype, min_rows):
    """Plain decoding's attention paths (one sequence's lone row; lone rows of sequences of ragged lengths in one set
    of products) give exactly block_attention's bits, at lengths on and around block boundaries."""
    from draftwise.backend.forward.attention import (
        block_attention,
        rows_attention,
        rows_layout,
        single_row_attention,
        tail_layout,
    )

    generator = torch.Generator().manual_seed(0)
    kv_heads, group, head_dim, blocks = 2, 3, 16, 6
    lengths = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 17, 5 * BLOCK + 3]
    keys = [torch.randn(blocks, kv_heads, BLOCK, head_dim, generator=generator).to(dtype) for _ in lengths]
    values = [torch.randn(blocks, kv_heads, BLOCK, head_dim, generator=generator).to(dtype) for _ in lengths]
    query = torch.randn(len(lengths), kv_heads, group, head_dim, generator=generator).to(dtype)
    expected = [
        block_attention(query[index : index + 1], keys[index], values[index],
                        tail_layout(length, [-1], BLOCK, kv_heads), min_rows)
        for index, length in enumerate(lengths)
    ]
    for index, length in enumerate(lengths):
        alone = single_row_attention(query[index : index + 1], keys[index], values[index], length, min_rows)
        assert torch.equal(alone, expected[index]), length
    layout = rows_layout(lengths, [1] * len(lengths), BLOCK, kv_heads, group, min_rows)
    assert torch.equal(rows_attention(query, keys, values, layout), torch.cat(expected))


def _invariant_attention_rows(dtype: torch.dtype, head_dim: int, at_least: int) -> int:
    """The row count this machine's attention products of these shapes are invariant from (as a row plan measures
    it), at least ``at_least``."""
    from draftwise.backend.calibration.invariance import min_invariant_rows

    generator = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(3, 200, head_dim, generator=generator), torch.randn(3, head_dim, BLOCK, generator=generator)
    weights, values = torch.rand(3, 200, BLOCK, generator=generator), torch.randn(3, BLOCK, head_dim, generator=generator)
    pairs = [(a.to(dtype), b.to(dtype)) for a, b in ((queries, keys), (weights, values))]
    found = [min_invariant_rows(lambda rows, a=a, b=b: torch.bmm(a[:, :rows], b).transpose(0, 1), 200) for a, b in pairs]
    assert None not in found
    return max(at_least, *found)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("min_rows", [1, 4])
def test_chains_of_several_sequences_in_one_set_of_products_are_block_attention_bitwise(dtype, min_rows):
    """Several sequences' chains of different lengths (lone rows among them), at ragged lengths on and around block
    boundaries, in one set of products (and each sequence alone in it): every row exactly block_attention's bits."""
    from draftwise.backend.forward.attention import block_attention, rows_attention, rows_layout, tail_layout
    from draftwise.backend.rows import RowBlock

    generator = torch.Generator().manual_seed(1)
    kv_heads, group, head_dim, blocks = 2, 3, 16, 8
    min_rows = _invariant_attention_rows(dtype, head_dim, min_rows)
    lengths = [0, 5, BLOCK - 3, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 3 * BLOCK + 30, 4 * BLOCK - 9]
    sizes = [7, 1, 5, 4, 9, 2, 1, 12]
    keys = [torch.randn(blocks, kv_heads, BLOCK, head_dim, generator=generator).to(dtype) for _ in lengths]
    values = [torch.randn(blocks, kv_heads, BLOCK, head_dim, generator=generator).to(dtype) for _ in lengths]
    query = torch.randn(sum(sizes), kv_heads, group, head_dim, generator=generator).to(dtype)
    bounds = [sum(sizes[:index]) for index in range(len(sizes) + 1)]
    expected = []
    for index, (length, size) in enumerate(zip(lengths, sizes)):
        part = query[bounds[index] : bounds[index + 1]]
        chain = RowBlock.chain(range(size)).parents
        reference = block_attention(part, keys[index], values[index], tail_layout(length, chain, BLOCK, kv_heads),
                                    min_rows)
        alone = rows_attention(part, keys[index : index + 1], values[index : index + 1],
                               rows_layout([length], [size], BLOCK, kv_heads, group, min_rows))
        assert torch.equal(alone, reference), (length, size)
        expected.append(reference)
    layout = rows_layout(lengths, sizes, BLOCK, kv_heads, group, min_rows)
    assert torch.equal(rows_attention(query, keys, values, layout), torch.cat(expected))
    # This forward's keys and values given apart, the caches still without them: the same bits.
    new_keys, new_values, stale_keys, stale_values = [], [], [], []
    for length, size, own_keys, own_values in zip(lengths, sizes, keys, values):
        slots = torch.arange(length, length + size)
        new_keys.append(own_keys[slots // BLOCK, :, slots % BLOCK])
        new_values.append(own_values[slots // BLOCK, :, slots % BLOCK])
        stale_keys.append(own_keys.clone())
        stale_values.append(own_values.clone())
        stale_keys[-1][slots // BLOCK, :, slots % BLOCK] = 7.0
        stale_values[-1][slots // BLOCK, :, slots % BLOCK] = -7.0
    given = rows_attention(query, stale_keys, stale_values, layout, torch.cat(new_keys), torch.cat(new_values))
    assert torch.equal(given, torch.cat(expected))


def test_attention_groups_lone_rows_longer_chains_and_trees_by_size():
    sizes = [1, 3, 9, 1, 2, 5, 4, 12]
    chains = [True, True, True, True, True, False, False, False]
    assert _bucket_members(sizes, chains) == [[0, 3], [1, 2, 4], [6], [5], [7]]
    assert _bucket_members([1, 1], [True, True]) == [[0, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_lone_rows_chains_and_a_tree_is_each_sequence_alone(dtype, tmp_path):
    """Lone rows, chains of several lengths (one across a block boundary) and a tree in one forward, on caches
    holding garbage after their lengths: every sequence's logits, and its cache once its rows are committed, equal
    those of its forward alone (chains of a batch have their caches written once, after the last layer)."""
    target = planned(model_in("qwen2", dtype), tmp_path)
    rng = random.Random(12)
    vocab = target.config.vocab_size

    def tokens(count: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(count)]

    lengths = [10, BLOCK - 2, 30, BLOCK + 5, 3, 2 * BLOCK - 1]
    prompts = [tokens(length) for length in lengths]
    blocks = [RowBlock.chain(tokens(1)), RowBlock.chain(tokens(3)), RowBlock.chain(tokens(7)),
              RowBlock(tuple(tokens(5)), (-1, 0, 0, 1, 2)), RowBlock.chain(tokens(1)), RowBlock.chain(tokens(6))]
    kept = [list(range(len(block))) if block.parents == tuple(range(-1, len(block) - 1)) else [0, 2, 4]
            for block in blocks]

    def fresh_caches(garbage: bool) -> list:
        caches = []
        for prompt in prompts:
            cache = target.new_cache(len(prompt) + 16)
            target.prefill([cache], [prompt])
            if garbage:
                after = torch.arange(cache.length, cache.capacity)
                cache.keys[:, after // BLOCK, :, after % BLOCK] = 3.0
                cache.values[:, after // BLOCK, :, after % BLOCK] = -3.0
            caches.append(cache)
        return caches

    def committed(cache) -> tuple[torch.Tensor, torch.Tensor]:
        layers, blocks_, heads, block, dim = cache.keys.shape
        flat = [buffer.transpose(2, 3).reshape(layers, blocks_ * block, heads, dim)[:, : cache.length]
                for buffer in (cache.keys, cache.values)]
        return flat[0], flat[1]

    with torch.inference_mode():
        together_caches = fresh_caches(garbage=True)
        together = target.forward(together_caches, blocks).logits
        alone_caches = fresh_caches(garbage=False)
        alone = [target.forward([cache], [block]).logits[0] for cache, block in zip(alone_caches, blocks)]
        for cache_a, cache_b, rows in zip(together_caches, alone_caches, kept):
            target.commit(cache_a, rows)
            target.commit(cache_b, rows)
    for index, (a, b) in enumerate(zip(together, alone)):
        assert torch.equal(a, b), index
    for index, (cache_a, cache_b) in enumerate(zip(together_caches, alone_caches)):
        assert all(torch.equal(x, y) for x, y in zip(committed(cache_a), committed(cache_b))), index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_prefilled_in_pieces_beside_other_rows_is_the_prompt_prefilled_alone(dtype, tmp_path):
    """Chunked prefill: a prompt run in pieces of any size, each piece a chain in a forward with other sequences'
    lone rows, chains and trees, ends with the logits and the committed cache (torch.equal) of the same prompt
    prefilled whole; where the target cannot promise that (the library path), it says so."""
    target = planned(model_in("qwen2", dtype), tmp_path)
    assert target.chunked_prefill
    assert not planned(model_in("qwen2", dtype), tmp_path, kernel=False).chunked_prefill
    rng = random.Random(31)
    vocab = target.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(2 * BLOCK + 9)]
    others = [[rng.randrange(vocab) for _ in range(length)] for length in (12, BLOCK + 3)]

    def committed(cache) -> list[torch.Tensor]:
        layers, blocks_, heads, block, dim = cache.keys.shape
        return [buffer.transpose(2, 3).reshape(layers, blocks_ * block, heads, dim)[:, : cache.length]
                for buffer in (cache.keys, cache.values)]

    with torch.inference_mode():
        whole = target.new_cache(len(prompt))
        expected = target.prefill([whole], [prompt]).logits[0][-1]
        for pieces in ([1, 6, 50, BLOCK, len(prompt) - 121], [len(prompt)], [BLOCK - 1] * 2 + [11]):
            other_caches = []
            for other in others:
                other_caches.append(target.new_cache(len(other) + 64))
                target.prefill([other_caches[-1]], [other])
            cache, first = target.new_cache(8), 0
            for step, size in enumerate(pieces):
                beside = [RowBlock.chain([rng.randrange(vocab)]),
                          RowBlock(tuple(rng.randrange(vocab) for _ in range(4)), (-1, 0, 0, 1)) if step % 2
                          else RowBlock.chain([rng.randrange(vocab) for _ in range(3)])]
                output = target.forward(other_caches + [cache], beside + [RowBlock.chain(prompt[first : first + size])],
                                        last_only=[False, False, True])
                assert output.logits[2].shape[0] == 1 and output.logits[1].shape[0] == len(beside[1])
                for other_cache, block in zip(other_caches, beside):
                    target.commit(other_cache, [0])
                target.commit(cache, range(size))
                first += size
            assert torch.equal(output.logits[2][-1], expected), pieces
            for got, want in zip(committed(cache), committed(whole)):
                assert torch.equal(got, want), pieces
