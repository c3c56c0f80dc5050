"""The compiled kernels: the attention kernel's agreement with exact attention, every row bitwise its result alone
(whatever else shares the call, and at any thread count), batches of trees on the lean forward, its layout; the
sources building for CPUs with other vector units (x86 without AVX, with AVX2, with AVX-512, aarch64); and a failed
build leaving the lean forward on its library path."""

from __future__ import annotations

import contextlib
import os
import platform
import random
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from equivalence import ar_token_ids, assert_same_ids_as_ar
from tiny import make_tiny_model, planned, prefilled_caches, repetitive_prompt, torch_threads

from draftwise.backend import native
from draftwise.backend.forward.attention import ragged_layout
from draftwise.backend.forward.lean import BLOCK, LeanTarget
from draftwise.backend.rows import RowBlock
from draftwise.decoding.tree import DraftTree
from draftwise.errors import UnsupportedModelError

needs_kernels = pytest.mark.skipif(native.load_kernels(warn=False) is None,
                                   reason=f"the kernels cannot be built here: {native.unavailable_reason()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: Agreement with attention in float64, by dtype (the output is rounded to the dtype).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def random_caches(generator, lengths, kv_heads, head_dim, dtype, layers=2):
    blocks = [max(1, -(-(length + 40) // BLOCK)) for length in lengths]
    keys = [torch.randn(layers, count, kv_heads, BLOCK, head_dim, generator=generator).to(dtype) for count in blocks]
    values = [torch.randn(layers, count, kv_heads, BLOCK, head_dim, generator=generator).to(dtype) for count in blocks]
    return keys, values


def run(query, new_keys, new_values, keys, values, layer, lengths, parents):
    layout = ragged_layout(lengths, parents)
    return native.ragged_attention(query, new_keys, new_values, keys, values, layer, layout.row_sequence,
                                   layout.row_committed, layout.path_offsets, layout.path_rows)


def exact_attention(query, new_keys, new_values, keys, values, layer, lengths, parents):
    """The same attention in float64 with an explicit gather of each row's keys."""
    _, heads, head_dim = query.shape
    kv_heads = new_keys.shape[1]
    group = heads // kv_heads
    outputs = []
    start = 0
    for sequence, (length, own) in enumerate(zip(lengths, parents)):
        committed_keys = keys[sequence][layer].permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :length]
        committed_values = values[sequence][layer].permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :length]
        paths: list[list[int]] = []
        for row, parent in enumerate(own):
            paths.append([start + row] if parent < 0 else [*paths[parent], start + row])
            row_keys = torch.cat([committed_keys, new_keys[paths[-1]].transpose(0, 1)], 1).double()
            row_values = torch.cat([committed_values, new_values[paths[-1]].transpose(0, 1)], 1).double()
            q = query[start + row].view(kv_heads, group, head_dim).double()
            weights = torch.softmax(q @ row_keys.transpose(1, 2), -1)
            outputs.append((weights @ row_values).reshape(-1))
        start += len(own)
    return torch.stack(outputs)


def problem(dtype, head_dim, group, lengths, parents, seed=0, kv_heads=2):
    generator = torch.Generator().manual_seed(seed)
    rows = sum(len(own) for own in parents)
    keys, values = random_caches(generator, lengths, kv_heads, head_dim, dtype)
    query = (torch.randn(rows, kv_heads * group, head_dim, generator=generator) / head_dim**0.5).to(dtype)
    new_keys = torch.randn(rows, kv_heads, head_dim, generator=generator).to(dtype)
    new_values = torch.randn(rows, kv_heads, head_dim, generator=generator).to(dtype)
    return query, new_keys, new_values, keys, values


TREE = (-1, 0, 0, 1, 1, 2, 5)
#: A chain and a tree longer than sixteen rows: bfloat16 scores take keys sixteen at a time, this forward's too.
LONG_CHAIN = tuple(range(-1, 20))
WIDE_TREE = (-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 9, 10, 11, 12, 13, 14, 16, 17, 18, 18, 19, 20, 21, 22, 24, 25,
             26, 26, 28, 29, 30, 32, 33)
#: A prompt's rows (a chain from an empty cache): this forward's keys scored sixteen at a time for every row, then
#: one by one past the last whole sixteen, and long paths' values summed in registers.
PREFILL = tuple(range(-1, 40))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "group"), [(8, 2), (64, 3), (128, 1), (80, 4)])
def test_kernel_matches_exact_attention(dtype, head_dim, group):
    lengths = [0, 5, BLOCK, 2 * BLOCK + 3, 21, 0]
    parents = [(-1,), (-1, 0, 1), TREE, (-1,), WIDE_TREE, PREFILL]
    inputs = problem(dtype, head_dim, group, lengths, parents)
    output = run(*inputs, 1, lengths, parents)
    expected = exact_attention(*inputs, 1, lengths, parents)
    assert output.dtype == dtype and output.shape == expected.shape
    torch.testing.assert_close(output.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (128, 2), (80, 2)])
def test_every_row_is_bitwise_its_result_alone(dtype, head_dim, group):
    """A row's output is the same bits whether it is alone, one of its sequence's tree or chain, or one row of a
    batch of sequences; and whatever the thread count (two, then one). (Odd and even cache lengths: bfloat16 values
    are weighted two positions at a time, paired by parity.)"""
    lengths = [BLOCK - 1, 3, 2 * BLOCK + 17, 0, 2 * BLOCK, 37, 16, 0]
    parents = [TREE, (-1, 0, 1, 2), (-1,), (-1, 0), (-1, 0, 0, 1), LONG_CHAIN, WIDE_TREE, PREFILL]
    query, new_keys, new_values, keys, values = problem(dtype, head_dim, group, lengths, parents, seed=3)
    with torch_threads(2):
        together = run(query, new_keys, new_values, keys, values, 0, lengths, parents)
    with torch_threads(1):
        assert torch.equal(run(query, new_keys, new_values, keys, values, 0, lengths, parents), together)
    start = 0
    for sequence, (length, own) in enumerate(zip(lengths, parents)):
        paths: list[list[int]] = []
        for row, parent in enumerate(own):
            paths.append([row] if parent < 0 else [*paths[parent], row])
            # The row alone, as plain decoding computes it: its ancestors committed to the cache first.
            cache_keys, cache_values = keys[sequence].clone(), values[sequence].clone()
            for depth, ancestor in enumerate(paths[-1][:-1]):
                position = length + depth
                cache_keys[0, position // BLOCK, :, position % BLOCK] = new_keys[start + ancestor]
                cache_values[0, position // BLOCK, :, position % BLOCK] = new_values[start + ancestor]
            flat = start + row
            alone = run(query[flat : flat + 1], new_keys[flat : flat + 1], new_values[flat : flat + 1],
                        [cache_keys], [cache_values], 0, [length + len(paths[-1]) - 1], [(-1,)])
            assert torch.equal(alone[0], together[flat]), (sequence, row)
        start += len(own)


@needs_kernels
@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (128, 6), (80, 2), (8, 1)])
def test_float16_cache_beside_float32_queries_is_the_float32_kernel_on_its_values(head_dim, group):
    """A float16 cache (and this forward's keys and values in float16) beside float32 queries gives exactly the
    float32 kernel's output on the same keys and values widened to float32: the widening is exact and the arithmetic
    is the float32 kernel's. So its rows are bitwise plain decoding's as the float32 kernel's are; at any thread
    count too (two, then one)."""
    lengths = [BLOCK - 1, 3, 2 * BLOCK + 17, 0, 37, 16, 0]
    parents = [TREE, (-1, 0, 1, 2), (-1,), (-1, 0), LONG_CHAIN, WIDE_TREE, PREFILL]
    query, new_keys, new_values, keys, values = problem(torch.float16, head_dim, group, lengths, parents, seed=7)
    query = query.float() * 1.25  # (float32 queries: not float16 values)
    with torch_threads(2):
        mixed = run(query, new_keys, new_values, keys, values, 1, lengths, parents)
    widened = run(query, new_keys.float(), new_values.float(), [k.float() for k in keys], [v.float() for v in values],
                  1, lengths, parents)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, widened)
    with torch_threads(1):
        assert torch.equal(run(query, new_keys, new_values, keys, values, 1, lengths, parents), mixed)


@needs_kernels
def test_attention_refuses_caches_in_other_dtypes():
    lengths, parents = [5], [(-1,)]
    query, new_keys, new_values, keys, values = problem(torch.float32, 64, 2, lengths, parents)
    with pytest.raises(RuntimeError, match="float16 beside float32 queries"):
        run(query, new_keys.bfloat16(), new_values.bfloat16(), [keys[0].bfloat16()], [values[0].bfloat16()], 0,
            lengths, parents)
    with pytest.raises(RuntimeError, match="float16 beside float32 queries"):
        run(query.bfloat16(), new_keys.half(), new_values.half(), [keys[0].half()], [values[0].half()], 0, lengths,
            parents)
    with pytest.raises(RuntimeError, match="new keys and values in the caches' dtype"):
        run(query, new_keys, new_values, [keys[0].half()], [values[0].half()], 0, lengths, parents)


@needs_kernels
def test_the_cache_dtype_of_a_lean_target():
    """float16 caches by default where quantised products run on the kernels, the model's dtype elsewhere; an
    explicit choice where it can run, a clear error where it cannot."""
    model = make_tiny_model("llama", seed=0)
    assert LeanTarget(model).kv_dtype == torch.float32
    assert LeanTarget(model, quantization="q8_0").kv_dtype == torch.float16
    assert LeanTarget(model, quantization="q8_0", kv_cache_dtype="float32").kv_dtype == torch.float32
    assert LeanTarget(model, kv_cache_dtype="float16").kv_dtype == torch.float16
    target = LeanTarget(model, quantization="q4_0")
    cache = target.new_cache(10)
    assert cache.keys.dtype == cache.values.dtype == torch.float16
    with pytest.raises(UnsupportedModelError, match="bfloat16 cache cannot run beside float32"):
        LeanTarget(model, kv_cache_dtype="bfloat16")
    with pytest.raises(UnsupportedModelError, match="float16 cache cannot run beside float32"):
        LeanTarget(model, kernel=False, kv_cache_dtype="float16")
    with pytest.raises(UnsupportedModelError, match="unknown kv_cache_dtype"):
        LeanTarget(model, kv_cache_dtype="int8")
    assert LeanTarget(make_tiny_model("llama", seed=0).to(torch.bfloat16)).kv_dtype == torch.bfloat16


@needs_kernels
def test_a_float16_cache_keeps_verification_exact_and_close_to_float32(tmp_path):
    """With a float16 cache, batched trees and pld stay bitwise plain decoding (the cache's own), and the logits
    stay within float16's rounding of the float32 cache's."""
    from draftwise.backend.calibration.invariance import check_trees, plan_rows
    from draftwise.backend.calibration.machine import MeasurementStore

    model = make_tiny_model("qwen2", seed=2)
    half = LeanTarget(model, quantization="q8_0")
    full = LeanTarget(model, quantization="q8_0", kv_cache_dtype="float32")
    assert half.kv_dtype == torch.float16 and full.kv_dtype == torch.float32
    assert plan_rows(half, MeasurementStore(tmp_path)).exact
    report = check_trees(half, trials=8, steps=40, prompt_length=70, seed=4)
    assert report.exact, report.mismatches[:3]
    rng = random.Random(5)
    prompts = [repetitive_prompt(rng, low=20, high=120) for _ in range(3)]
    with torch.inference_mode():
        for prompt in prompts:
            a = half.prefill([half.new_cache(len(prompt) + 8)], [prompt]).logits[0]
            b = full.prefill([full.new_cache(len(prompt) + 8)], [prompt]).logits[0]
            assert not torch.equal(a, b)  # (the cache's rounding shows)
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert_same_ids_as_ar(half, None, prompts, "pld", max_new_tokens=30)


def test_ragged_layout():
    layout = ragged_layout([7, 2], [(-1, 0, 0, 2), (-1,)])
    assert layout.row_sequence.tolist() == [0, 0, 0, 0, 1]
    assert layout.row_committed.tolist() == [7, 7, 7, 7, 2]
    assert layout.path_offsets.tolist() == [0, 1, 3, 5, 8, 9]
    assert layout.path_rows.tolist() == [0, 0, 1, 0, 2, 0, 2, 3, 4]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_trees_on_the_kernel_are_bitwise_alone(dtype, tmp_path):
    """On the kernel a batch verifies whole trees (not only their best paths): every sequence's logits are bitwise
    those of its forward alone, and batched generation gives every sequence its batch-1 ids."""
    model = make_tiny_model("llama", seed=0).to(dtype)
    target = planned(model, tmp_path)
    assert target.attention_path == "kernel" and not target.batch_chains
    rng = random.Random(6)
    prompts = [repetitive_prompt(rng, low=10, high=90) for _ in range(4)]
    vocab = model.config.vocab_size
    trees = [DraftTree.from_paths([[rng.randrange(vocab) for _ in range(rng.randint(1, 4))] for _ in range(4)])
             for _ in prompts]
    blocks = [tree.rows(rng.randrange(vocab)) for tree in trees] + [RowBlock.chain([3])]
    prompts.append(repetitive_prompt(rng, low=60, high=70))
    with torch.inference_mode():
        together = target.forward(prefilled_caches(target, prompts, 128), blocks).logits
        alone = [target.forward([cache], [block]).logits[0]
                 for cache, block in zip(prefilled_caches(target, prompts, 128), blocks)]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    assert_same_ids_as_ar(target, None, prompts, "pld", max_new_tokens=30, max_batch=5)


#: Tiny shapes beside the default one (head_dim 8, hidden 32): head_dim 64, whose rotation runs in whole vectors (as
#: real models'), and a hidden width that is not a multiple of sixteen lanes.
HEAD_DIM_64 = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
ODD_WIDTH = dict(hidden_size=40, num_attention_heads=5, num_key_value_heads=1)


@needs_kernels
@pytest.mark.parametrize(("dtype", "weights", "bits", "shape"), [
    (torch.float32, None, 8, {}), (torch.bfloat16, None, 8, {}), (torch.float32, "q4_0", 8, {}),
    (torch.float32, "q4_0", 16, {}), (torch.float32, "q4_0", 16, HEAD_DIM_64), (torch.float32, None, 8, HEAD_DIM_64),
    (torch.bfloat16, None, 8, HEAD_DIM_64), (torch.float32, None, 8, ODD_WIDTH),
])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("padded", [False, True])
def test_compiled_layer_loop_is_bitwise_the_python_loop(dtype, weights, bits, shape, kind, padded, tmp_path):
    """The decoder layers as one compiled call give the logits and the cache contents of the Python loop over the
    same kernels, bit for bit, for lone rows, chains and trees of several sequences (qwen2: biased projections;
    q4_0: the quantised products, beside a float16 cache; ``padded``: products padded to 5 rows, so that forwards of
    fewer rows run on zero rows the loop's reused buffers keep)."""
    from draftwise.backend.calibration.invariance import plan_rows
    from draftwise.backend.calibration.machine import MeasurementStore
    from draftwise.backend.forward.lean import LeanTarget

    model = make_tiny_model(kind, seed=1, **shape).to(dtype)
    if weights is None:
        target = planned(model, tmp_path)
    else:
        target = LeanTarget(model, quantization=weights, activation_bits=bits)
        assert target.kv_dtype == torch.float16  # (the compiled loop rounds this forward's keys as the cache keeps them)
        plan_rows(target, MeasurementStore(tmp_path))
    if target.compiled_layers is None:
        pytest.skip(f"the blocked products do not run {dtype} on this CPU")
    if padded:
        target.set_row_plan(max(5, target.linear_min_rows), target.attention_min_rows)
    assert len(target.compiled_layers) == model.config.num_hidden_layers
    rng = random.Random(3)
    prompts = [repetitive_prompt(rng, low=10, high=140) for _ in range(3)]
    vocab = model.config.vocab_size
    tree = DraftTree.from_paths([[rng.randrange(vocab) for _ in range(3)], [rng.randrange(vocab)]])
    batches = [
        [RowBlock.chain([5])],
        [RowBlock.chain([5, 6, 7])],
        [tree.rows(9), RowBlock.chain([4]), RowBlock.chain([1, 2])],
    ]
    compiled = target.compiled_layers
    with torch.inference_mode():
        for blocks in batches:
            results = []
            for layers in (compiled, None):
                target.compiled_layers = layers
                caches = prefilled_caches(target, prompts[: len(blocks)], 160)
                logits = target.forward(caches, blocks).logits
                results.append((logits, [(cache.keys.clone(), cache.values.clone()) for cache in caches]))
            target.compiled_layers = compiled
            (fast, fast_caches), (slow, slow_caches) = results
            assert all(torch.equal(a, b) for a, b in zip(fast, slow))
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(fast_caches, slow_caches))


@needs_kernels
def test_kernel_choice_is_explicit():
    model = make_tiny_model("llama", seed=0)
    assert LeanTarget(model, kernel=False).attention_path == "library"
    assert LeanTarget(model, kernel=True).attention_path == "kernel"
    wide = make_tiny_model("llama", seed=0, hidden_size=160, num_attention_heads=10, num_key_value_heads=1)
    with pytest.raises(UnsupportedModelError, match="query heads per key/value head"):
        LeanTarget(wide, kernel=True)
    assert LeanTarget(wide).attention_path == "library"


# ---------------------------------------------------------------------------------------------- a failed build


@contextlib.contextmanager
def failing_kernel_build(reason: str) -> Iterator[None]:
    """The kernels' build failing with ``reason``, as it does on a machine without a compiler (and no earlier build):
    the builder raises, the loader's remembered outcome and its warn-once state are cleared first. On leaving, all of
    it is restored and the remembered outcome cleared again, so the next use loads the real build (from its build
    folder)."""
    from draftwise.backend.native import build

    def fail(*args, **kwargs):
        raise RuntimeError(f"Error building extension 'draftwise_native':\n{reason}")

    native._load.cache_clear()
    native.build_key.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(build, "load_extension", fail)
            patch.setattr(native, "_warned", [])
            yield
    finally:
        native._load.cache_clear()
        native.build_key.cache_clear()


def test_a_failed_build_warns_once_and_the_lean_forward_keeps_the_library_path(tmp_path):
    model = make_tiny_model("llama", seed=0)
    prompts = [repetitive_prompt(random.Random(seed), low=20, high=40) for seed in (8, 9)]
    usable_before = native.load_kernels(warn=False) is not None
    before = ar_token_ids(planned(model, tmp_path / "before"), None, prompts, max_new_tokens=30)

    with failing_kernel_build("simulated: no C++ compiler on this machine"):
        with pytest.warns(RuntimeWarning, match="could not be built .*simulated: no C\\+\\+ compiler"):
            target = planned(model, tmp_path / "after")
        assert target.attention_path == "library" and target.compiled_layers is None
        assert "simulated: no C++ compiler" in native.unavailable_reason()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once: a second target says nothing
            assert LeanTarget(model).attention_path == "library"
        assert ar_token_ids(target, None, prompts, max_new_tokens=30) == before
        assert_same_ids_as_ar(target, None, prompts, "pld", max_new_tokens=30, expected=before)
        with pytest.raises(UnsupportedModelError, match="simulated: no C\\+\\+ compiler"):
            LeanTarget(model, kernel=True)

    # The real build is back for every later test.
    assert (native.load_kernels(warn=False) is not None) == usable_before
    if usable_before:
        assert LeanTarget(model).attention_path == "kernel"


# ---------------------------------------------------------------------------------------------- other CPUs

#: The compiler flags of the build (native.CFLAGS) that hold for every CPU; -O0: the checks need no optimisation.
PORTABLE_FLAGS = [flag for flag in native.CFLAGS if not flag.startswith(("-march=", "-O"))] + ["-O0", "-std=c++20"]


def vector_sources() -> list[Path]:
    """The sources with vector code (GCC vector extensions and x86 intrinsics behind the macros of their vector
    units): the ones whose build depends on the CPU."""
    return [path for path in native.SOURCES
            if any(marker in path.read_text() for marker in ('"vectors.h"', "<immintrin.h>"))]


def cpu_builds() -> list[tuple[str, list[str]]]:
    """Compilations standing for CPUs other than this one, as (name, command without the source).

    On x86-64 with g++: the baseline without AVX and AVX2 with FMA compiled to assembly (discarded), since an
    intrinsic of a vector unit the target lacks is refused only when code is generated, not by a syntax check; the
    AVX-512 paths (bfloat16 and VNNI products included), which no intrinsic can outrun, checked for syntax. With an aarch64
    cross compiler: aarch64 checked for syntax (x86 intrinsics are undeclared there)."""
    builds = []
    if platform.machine() in ("x86_64", "AMD64") and shutil.which("g++"):
        builds += [("x86-64", ["g++", "-march=x86-64", "-S", "-o", os.devnull]),
                   ("x86-64-v3", ["g++", "-march=x86-64-v3", "-S", "-o", os.devnull]),
                   ("x86-64-v4+avx512bf16+vnni", ["g++", "-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni",
                                                  "-fsyntax-only"])]
    if shutil.which("aarch64-linux-gnu-g++"):
        builds.append(("aarch64", ["aarch64-linux-gnu-g++", "-march=armv8-a", "-fsyntax-only"]))
    return builds


def test_the_vector_sources_build_for_other_cpus(tmp_path):
    """The kernels' vector code compiles for CPUs with other vector units than this one's: every x86 intrinsic sits
    behind its vector unit's macros with a portable fallback. The vector sources go in as one translation unit per
    CPU (torch's headers are read once), the compilations side by side; the other sources hold no vector code."""
    builds = cpu_builds()
    if not builds:
        pytest.skip("needs g++ on x86-64, or an aarch64 cross compiler")
    from torch.utils.cpp_extension import include_paths

    sources = vector_sources()
    assert {path.name for path in sources} >= {"linear.cpp", "ragged_attention.cpp", "ranking.cpp", "row_ops.cpp"}
    for path in set(native.SOURCES) - set(sources):
        assert "_mm" not in path.read_text(), f"{path.name} uses intrinsics without vectors.h's guards"
    unit = tmp_path / "vector_sources.cpp"
    unit.write_text("".join(f'#include "{path}"\n' for path in sources))
    includes = [f"-I{path}" for path in include_paths()]
    runs = {name: subprocess.Popen([*command, *PORTABLE_FLAGS, "-w", *includes, str(unit)], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
            for name, command in builds}
    failures = {}
    for name, run in runs.items():
        output, _ = run.communicate(timeout=600)
        if run.returncode != 0:
            failures[name] = "\n".join(line for line in output.splitlines() if "error" in line)[:3000]
    assert not failures, "\n\n".join(f"{name}:\n{errors}" for name, errors in failures.items())
